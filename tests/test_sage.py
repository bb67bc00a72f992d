"""sage.py's pieces: config presets, batching, rewards shaping, micro-batching, checkpoints, SFT."""

import json
import os
import random

import pytest
import torch

import guides
import loss
import sage


# ---- configuration ----


def test_paper_defaults_for_model_runs():
    config = sage.parse_config(["--model", "some/model"])
    assert (config.steps, config.prompts_per_step, config.rollouts) == (1000, 8, 8)
    assert (config.beta, config.lr, config.lora_rank, config.seed) == (0.05, 5e-6, 8, 3407)
    assert (config.temperature, config.min_p, config.top_p, config.top_k) == (1.0, 0.01, 1.0, -1)
    assert (config.advantage, config.loss_agg, config.kl, config.kl_estimator) == ("grpo", "grpo", "reverse", "k3")
    assert config.max_train_samples == 2000 and config.guide == "none"


@pytest.mark.parametrize(
    "algo, expected",
    [
        ("grpo", dict(advantage="grpo", loss_agg="grpo", eps_high=0.2, kl="reverse", dynamic_sampling=0)),
        ("dr_grpo", dict(advantage="dr_grpo", loss_agg="dr_grpo", eps_high=0.2, kl="reverse")),
        ("bnpo", dict(advantage="bnpo", loss_agg="batch_token_mean", kl="none")),
        ("dapo", dict(advantage="grpo", loss_agg="dapo", eps_high=0.28, kl="none", dynamic_sampling=1)),
    ],
)
def test_algo_presets(algo, expected):
    config = sage.parse_config(["--model", "m", "--algo", algo])
    for key, value in expected.items():
        assert getattr(config, key) == value, key


def test_explicit_flags_beat_presets_and_a_guide_keeps_the_anchor():
    config = sage.parse_config(["--model", "m", "--algo", "dapo", "--eps-high", "0.3", "--advantage", "rloo"])
    assert config.eps_high == 0.3 and config.advantage == "rloo"
    guided = sage.parse_config(["--model", "m", "--algo", "dapo", "--guide", "branch"])
    assert guided.kl == "reverse"  # a guide acts only through the anchor


def test_demo_sizes_apply_without_model():
    config = sage.parse_config([])
    assert config.model == "" and config.guide == "branch" and config.steps == sage.DEMO["steps"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--guide", "entropy"], "unknown --guide"),
        (["--kl-estimator", "k4"], "unknown --kl-estimator"),
        (["--algo", "ppo"], "unknown --algo"),
        (["--rollouts", "1"], "--rollouts must be >= 2"),
        (["--guide", "branch", "--beta", "0"], "acts only through the KL anchor"),
    ],
)
def test_bad_flags_give_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        sage.parse_config(["--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_every_field_has_a_docstring():
    docs = sage.field_docs(sage.Config)
    import dataclasses

    assert {f.name for f in dataclasses.fields(sage.Config)} == set(docs)


# ---- the demo task and data ----


def test_demo_split_is_disjoint_and_answers_are_right():
    train, held_out = sage.demo_problems(seed=3407, num_held_out=100)
    assert len(train) == 300 and len(held_out) == 100
    assert not {p["problem"] for p in train} & {p["problem"] for p in held_out}
    for problem in train + held_out:
        a, b = problem["working"].split("=")[0].split("+")
        assert int(a) + int(b) == int(problem["answer"])


def test_rows_without_an_answer_are_an_error():
    rows = [{"prompt": "1+1", "solution": "2"}, {"prompt": "2+2", "solution": ""}]
    with pytest.raises(SystemExit, match="row 1 has no answer"):
        sage.training_problems(rows, "prompt", "solution", 0, "data.jsonl")
    with pytest.raises(SystemExit, match="--problem-key"):
        sage.training_problems(rows, "question", "solution", 0, "data.jsonl")


def test_local_dataset_loads_and_missing_dataset_is_one_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1", "solution": str(i + 1)}) for i in range(5)))
    problems = sage.training_problems(sage.load_rows(str(path)), "prompt", "solution", 3, str(path))
    assert problems == [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(3)]
    with pytest.raises(SystemExit, match="cannot load dataset") as error:
        sage.load_rows("no-such-user/no-such-dataset-xyz")
    assert "\n" not in str(error.value)


def test_prompt_sampler_resumes_exactly():
    sampler = sage.PromptSampler(10, seed=0)
    first = sampler.take(7)
    state = sampler.state_dict()
    rest = sampler.take(9)
    resumed = sage.PromptSampler(10, seed=0)
    resumed.load_state_dict(state)
    assert resumed.take(9) == rest
    assert sorted(first + rest[:3]) == list(range(10))  # one epoch is a permutation


# ---- batching and log-probs ----


@pytest.fixture(scope="module")
def tiny():
    tokenizer = sage.build_tiny_tokenizer()
    model = sage.build_tiny_model(tokenizer, max_position_embeddings=160).eval()
    return model, tokenizer


def test_left_padding_does_not_change_log_probs(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("What is 3 + 4?")["input_ids"]
    completion = tokenizer("<start_working_out>3+4=7")["input_ids"]
    alone = sage.collate([prompt], [completion], tokenizer.pad_token_id, "cpu")
    padded = sage.collate([[1, 2, 3, 4, 5] + prompt, prompt], [completion[:3], completion], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logps_alone, entropies_alone = sage.completion_logps(model, alone, 1.0, 0.0)
        logps_padded, entropies_padded = sage.completion_logps(model, padded, 1.0, 0.0)
    torch.testing.assert_close(logps_padded[1], logps_alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropies_padded[1], entropies_alone[0], atol=1e-5, rtol=0)
    assert padded["completion_mask"][0].tolist() == [1.0] * 3 + [0.0] * (len(completion) - 3)


def test_completion_logps_match_a_full_forward(tiny):
    model, tokenizer = tiny
    prompt, completion = tokenizer("Add 2 and 5.")["input_ids"], tokenizer("2+5=7")["input_ids"]
    batch = sage.collate([prompt], [completion], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logps, _ = sage.completion_logps(model, batch, 0.7, 0.05)
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / 0.7
        keep = logits.softmax(-1) >= 0.05 * logits.softmax(-1).max(-1, keepdim=True).values
        expected = logits.masked_fill(~keep, float("-inf")).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])
    torch.testing.assert_close(logps[0], expected[:, 0], atol=1e-5, rtol=0)


# ---- rewards, groups, micro-batches ----


def test_overlong_penalty_and_informative_groups():
    penalty = sage.overlong_penalty(torch.tensor([10.0, 80.0, 90.0, 100.0, 130.0]), max_len=100, buffer=20)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert sage.informative_groups(rewards, 2).tolist() == [False, True, False]


def _rollouts(num_groups, group_size, seed=0):
    rng = random.Random(seed)
    prompts, completions = [], []
    for _ in range(num_groups):
        prompt = [rng.randrange(5, 300) for _ in range(rng.randint(4, 9))]
        for _ in range(group_size):
            prompts.append(prompt)
            completions.append([rng.randrange(5, 300) for _ in range(rng.randint(1, 6))])
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in completions])
    return sage.Rollouts(prompts, completions, [""] * len(completions), ["stop"] * len(completions),
                         [[0.0] * len(c) for c in completions], ["1"] * len(completions), rewards)


class GradientRecorder:
    """Stands in for the optimizer: records the accumulated gradient at step()."""

    def __init__(self, params):
        self.params, self.gradient = list(params), None

    def step(self):
        self.gradient = torch.cat([p.grad.flatten() for p in self.params if p.grad is not None])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("aggregation", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("guide", ["branch", "token"])
def test_micro_batches_accumulate_the_full_batch_gradient(tiny, aggregation, guide):
    """Splitting a step into micro-batches must not change its gradient (TRL's per-micro-batch
    token mean, batch_token_mean, is the one aggregation defined per micro-batch)."""
    _, tokenizer = tiny
    rollouts = _rollouts(num_groups=3, group_size=4)
    advantages = loss.compute_advantages(rollouts.rewards, 4, "grpo")
    reference = sage.build_tiny_model(tokenizer, max_position_embeddings=160, seed=1).requires_grad_(False)
    gradients = []
    for micro_batch_size in (12, 5):
        config = sage.Config(model="m", rollouts=4, micro_batch_size=micro_batch_size, loss_agg=aggregation,
                             advantage="grpo", kl="reverse", guide=guide, max_seq_len=32, min_p=0.0, steps=10,
                             max_grad_norm=1e9)
        policy = sage.build_tiny_model(tokenizer, max_position_embeddings=160)
        recorder = GradientRecorder(policy.parameters())
        # token guide: per-completion normalization, so micro-batch boundaries must not matter either
        guide_config = guides.GuideConfig(name=guide, tau=0.0, ratio=0.1, token_sigma=(0.0, 0.0))
        sage.update_policy(policy, reference, recorder, rollouts, advantages, config, guide_config,
                           torch.Generator().manual_seed(0), 0, tokenizer.pad_token_id)
        gradients.append(recorder.gradient)
    assert gradients[0].abs().max() > 0
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-6, rtol=1e-4)


# ---- records ----


def test_checkpoint_write_is_atomic(tmp_path, tiny, monkeypatch):
    model, _ = tiny
    optimizer, scheduler = sage.make_optimizer(model, 1e-3, 0.0, 10, 1)
    state = {"step": 1, "sampler": {"epoch": 0, "position": 3}, "guide_generator": torch.Generator().get_state()}
    sage.save_checkpoint(str(tmp_path), model, optimizer, scheduler, state)
    with open(tmp_path / "checkpoint" / "trainer_state.json") as handle:
        assert json.load(handle)["step"] == 1

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(SystemExit, match="previous checkpoint .* is intact"):
        sage.save_checkpoint(str(tmp_path), model, optimizer, scheduler, {**state, "step": 2})
    with open(tmp_path / "checkpoint" / "trainer_state.json") as handle:
        assert json.load(handle)["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]


def test_truncate_metrics_drops_steps_to_redo(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    for step in range(5):
        sage.append_metrics(path, {"step": step, "reward": step / 10})
    sage.truncate_metrics(path, 3)
    with open(path) as handle:
        assert [json.loads(line)["step"] for line in handle] == [0, 1, 2]


# ---- SFT ----


def test_sft_lowers_the_loss(tiny):
    _, tokenizer = tiny
    model = sage.build_tiny_model(tokenizer, max_position_embeddings=160, seed=3)
    config = sage.Config(max_seq_len=160)
    examples = [{"problem": "What is 1 + 2?", "completion": sage.format_completion("1+2=3", "3")}] * 8
    pairs, _ = sage.tokenize_sft_examples(tokenizer, examples, max_tokens=160)
    losses = sage.sft(model, pairs, tokenizer.pad_token_id, config, epochs=3, lr=3e-3, batch_size=4, warmup_steps=1,
                      progress=False)
    assert losses[-1] < 0.5 * losses[0]


# ---- the paper's run on one GPU node: what a first run would hit ----


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_sft_examples_are_never_cut_and_keep_the_closing_format(tmp_path, tiny):
    """OpenMathReasoning rows run to thousands of tokens: a cut example would lose </SOLUTION> and
    EOS and teach the model not to close the format. Long rows are dropped whole instead."""
    _, tokenizer = tiny
    rows = [
        {"problem": "What is 2 + 2?", "generated_solution": "<think>\n2+2=4\n</think>\nSo it is 4.", "expected_answer": "4"},
        {"problem": "What is 3 + 4?", "generated_solution": "<think>" + "3+4 " * 200 + "</think>", "expected_answer": "7"},
        {"problem": "Name the sum.", "generated_solution": "It is seven.", "expected_answer": "seven"},
        {"problem": "What is 1 + 5?", "generated_solution": "1+5=6", "expected_answer": "6"},
    ]
    config = sage.Config(model="m", sft_dataset=write_jsonl(tmp_path / "sft.jsonl", rows))
    examples, not_numeric = sage.sft_examples(config)
    assert not_numeric == 1 and len(examples) == 3
    pairs, stats = sage.tokenize_sft_examples(tokenizer, examples, max_tokens=128)
    assert stats["kept"] == 2 and stats["dropped_too_long"] == 1 and stats["max_tokens"] == 128
    closing = tokenizer("</SOLUTION>", add_special_tokens=False)["input_ids"]
    for prompt, completion in pairs:
        assert len(prompt) + len(completion) <= 128
        assert completion[-1] == tokenizer.eos_token_id
        assert completion[-1 - len(closing) : -1] == closing
        assert "think>" not in tokenizer.decode(completion)
    assert tokenizer.decode(pairs[0][1][:-1]).startswith("<start_working_out>2+2=4")
    first, _ = sage.tokenize_sft_examples(tokenizer, examples, max_tokens=128, max_samples=1)
    assert first == pairs[:1]
    with pytest.raises(SystemExit, match="no SFT example fits in 10 tokens"):
        sage.tokenize_sft_examples(tokenizer, examples, max_tokens=10)


def test_model_runs_default_to_settings_that_fit_one_gpu_and_help_says_so(capsys):
    config = sage.parse_config(["--model", "Qwen/Qwen2.5-Math-7B"])
    assert config.gradient_checkpointing and config.micro_batch_size == 4 and config.sft_max_samples == 500
    demo = sage.parse_config([])
    assert not demo.gradient_checkpointing and demo.micro_batch_size == sage.DEMO["micro_batch_size"]
    with pytest.raises(SystemExit):
        sage.parse_config(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "gradient checkpointing on, micro-batch 4" in help_text


def test_gradient_checkpointing_keeps_the_lora_gradient(tmp_path):
    """With the adapters the only trainable weights, checkpointed layers must still pass them a
    gradient (the input-gradient hook) and the same one as without checkpointing."""
    model_dir = sage.save_tiny_model(tmp_path / "model", max_position_embeddings=160)
    gradients = []
    for checkpointing in (False, True):
        model, tokenizer = sage.load_base_model(model_dir, gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        policy = sage.wrap_lora(model, rank=4, alpha=8)
        with torch.no_grad():  # a nonzero B, so every adapter weight gets a gradient
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
        policy.train()
        prompt, completion = tokenizer("What is 3 + 4?")["input_ids"], tokenizer("3+4=7")["input_ids"]
        batch = sage.collate([prompt, prompt[2:]], [completion, completion[:3]], tokenizer.pad_token_id, "cpu")
        logps, _ = sage.completion_logps(policy, batch, 1.0, 0.0)
        (logps * batch["completion_mask"]).sum().backward()
        gradients.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad})
    assert gradients[1].keys() == gradients[0].keys() and all(g.abs().sum() > 0 for g in gradients[1].values())
    for name in gradients[0]:
        torch.testing.assert_close(gradients[1][name], gradients[0][name], atol=1e-5, rtol=1e-4)


def test_k1_return_shaping_keeps_every_tensor_on_the_log_probs_device():
    """On a GPU the rewards come from the grader on the CPU and the log-probs from the model on the
    GPU. A fake CUDA device (PyTorch's FakeTensorMode, no GPU needed) raises on any op that mixes
    the two, so this runs the k1_return path as the trainer does on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])  # the grader's, on the CPU
    config = sage.Config(model="m", rollouts=3, advantage="rloo", kl="reverse", kl_estimator="k1_return", steps=10)
    for guide in guides.GUIDES:
        guide_config = guides.GuideConfig(name=guide, tau=0.5)
        with FakeTensorMode(allow_non_fake_inputs=True):
            batches, fixed = [], []
            for rows in (4, 2):
                mask = torch.ones(rows, 5, device="cuda")
                batches.append({"completion_mask": mask})
                fixed.append({"old_logps": -torch.rand(rows, 5, device="cuda"),
                              "entropies": torch.rand(rows, 5, device="cuda") * 2,
                              "ref_logps": -torch.rand(rows, 5, device="cuda")})
            advantages = sage.return_shaped_advantages(rewards, [[0, 1, 2, 3], [4, 5]], batches, fixed, config,
                                                       guide_config, torch.Generator().manual_seed(0), step=0)
            assert advantages.shape == (6,)
            assert all(part["log_q"].device.type == "cuda" for part in fixed)
