"""sage.py's pieces: the config and its presets, rewards shaping, micro-batching, the k1_return path
on a fake GPU, SFT."""

import dataclasses
import random

import pytest
import torch

import cli
import data
import demo
import guides
import loss
import sage
import task


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
        ("grpo", dict(advantage="grpo", loss_agg="grpo", eps_high=0.2, kl="reverse", dynamic_sampling=False)),
        ("dr_grpo", dict(advantage="dr_grpo", loss_agg="dr_grpo", eps_high=0.2, kl="reverse")),
        ("bnpo", dict(advantage="bnpo", loss_agg="batch_token_mean", kl="none")),
        ("dapo", dict(advantage="grpo", loss_agg="dapo", eps_high=0.28, kl="none", dynamic_sampling=True)),
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
    assert config.model == "" and config.guide == "branch" and config.steps == demo.DEMO_SIZES["steps"]


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
    docs = cli.field_docs(sage.Config)
    assert {f.name for f in dataclasses.fields(sage.Config)} == set(docs)


def test_model_runs_default_to_settings_that_fit_one_gpu_and_help_says_so(capsys):
    config = sage.parse_config(["--model", "Qwen/Qwen2.5-Math-7B"])
    assert config.gradient_checkpointing and config.micro_batch_size == 4 and config.sft_max_samples == 500
    demo_config = sage.parse_config([])
    assert not demo_config.gradient_checkpointing
    assert demo_config.micro_batch_size == demo.DEMO_SIZES["micro_batch_size"]
    with pytest.raises(SystemExit):
        sage.parse_config(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "gradient checkpointing on, micro-batch 4" in help_text


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
    count = len(completions)
    rollouts = sage.Rollouts(prompts, completions, [""] * count, ["stop"] * count, [[0.0] * len(c) for c in completions],
                             ["p"] * count, ["1"] * count)
    return rollouts, rewards


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
    rollouts, rewards = _rollouts(num_groups=3, group_size=4)
    advantages = loss.compute_advantages(rewards, 4, "grpo")
    reference = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=1).requires_grad_(False)
    gradients = []
    for micro_batch_size in (12, 5):
        config = sage.Config(model="m", rollouts=4, micro_batch_size=micro_batch_size, loss_agg=aggregation,
                             advantage="grpo", kl="reverse", guide=guide, max_seq_len=32, min_p=0.0, steps=10,
                             max_grad_norm=1e9)
        policy = demo.build_tiny_model(tokenizer, max_position_embeddings=160)
        recorder = GradientRecorder(policy.parameters())
        # token guide: per-completion normalization, so micro-batch boundaries must not matter either
        guide_config = guides.GuideConfig(name=guide, tau=0.0, ratio=0.1, token_sigma=(0.0, 0.0))
        sage.update_policy(policy, reference, recorder, rollouts, rewards, advantages, config, guide_config,
                           torch.Generator().manual_seed(0), 0, tokenizer.pad_token_id)
        gradients.append(recorder.gradient)
    assert gradients[0].abs().max() > 0
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-6, rtol=1e-4)


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


def test_sft_lowers_the_loss(tiny):
    _, tokenizer = tiny
    model = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=3)
    config = sage.Config(max_seq_len=160)
    examples = [{"problem": "What is 1 + 2?", "completion": task.format_completion("1+2=3", "3")}] * 8
    pairs, _ = data.tokenize_sft_examples(tokenizer, examples, max_tokens=160)
    losses = sage.sft(model, pairs, tokenizer.pad_token_id, config, epochs=3, lr=3e-3, batch_size=4, warmup_steps=1,
                      progress=False)
    assert losses[-1] < 0.5 * losses[0]


def test_a_config_built_in_code_is_complete():
    """Config() outside the CLI takes its preset's values: no sentinel reaches the loss (an
    eps_high of -1 would clip the ratio to [0.8, 0.0] and drop every positive advantage)."""
    config = sage.Config()
    assert (config.advantage, config.loss_agg, config.eps_high, config.kl, config.dynamic_sampling) == (
        "grpo", "grpo", 0.2, "reverse", False)
    dapo = sage.Config(algo="dapo")
    assert (dapo.eps_high, dapo.kl, dapo.dynamic_sampling, dapo.loss_agg) == (0.28, "none", True, "dapo")
    assert sage.Config(algo="dapo", guide="branch").kl == "reverse"  # a guide keeps its anchor
    assert sage.Config(algo="dapo", eps_high=0.3).eps_high == 0.3


def test_plain_grpo_anchors_to_the_full_softmax_reference(tiny):
    """With q = 1 the anchor is exactly pi_ref, the reference's full softmax at the sampling
    temperature (the authors' anchor). Replaying the sampler's min-p on it would renormalize over
    the kept tokens: an implicit guide q = 1 / M_ref >= 1, M_ref the reference mass min-p keeps."""
    model, tokenizer = tiny
    prompt, completion = tokenizer("What is 3 + 4?")["input_ids"], tokenizer("3+4=7")["input_ids"]
    batch = loss.collate([prompt, prompt[1:]], [completion, completion[:4]], tokenizer.pad_token_id, "cpu")
    config = sage.Config(model="m", temperature=0.8, min_p=0.3)
    full = sage.held_fixed_logps(model, model, batch, config, need_old=False)["ref_logps"]
    replayed = sage.held_fixed_logps(model, model, batch, dataclasses.replace(config, reference_min_p=True),
                                     need_old=False)["ref_logps"]
    with torch.no_grad():
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], logits_to_keep=positions).logits
    expected, _ = loss.plain_token_logps_and_entropies(logits, batch["completion_ids"], 0.8, 0.0)
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(full[mask], expected[mask], atol=1e-5, rtol=0)
    probs = (logits / 0.8).softmax(-1)
    kept_mass = torch.where(probs >= 0.3 * probs.amax(-1, keepdim=True), probs, 0.0).sum(-1)  # M_ref [B, C]
    implicit_log_q = (replayed - full)[mask]
    assert (implicit_log_q >= -1e-6).all() and implicit_log_q.max() > 1e-3
    # the sampled token may sit below the min-p threshold here (these tokens were not sampled): then
    # the replay keeps it as the sampler would have, and M_ref gains its own mass
    own = probs.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)
    below = own < 0.3 * probs.amax(-1)
    kept_mass = torch.where(below, kept_mass + own, kept_mass)
    torch.testing.assert_close(implicit_log_q, -kept_mass.log()[mask], atol=1e-5, rtol=0)
