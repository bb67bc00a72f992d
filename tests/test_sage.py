"""sage.py's pieces: the config and its presets, rewards shaping, micro-batching, the k1_return path
on a fake GPU, the anchor's reference, and the SFT warm start (extras/sft.py)."""

import contextlib
import copy
import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
import torch

import bounds
import guides
import loss
import sage
from extras import demo, dynamic_sampling, sft
from machinery import cli, fast_logprobs, runs
from task.problems import DataError, PromptSampler, format_completion, load_rows


def test_paper_defaults_for_model_runs():
    config = sage.parse_config(["--model", "some/model"])
    assert (config.steps, config.prompts_per_step, config.rollouts) == (1000, 8, 8)
    assert (config.loss.beta, config.lr, config.lora_rank, config.seed) == (0.05, 5e-6, 8, 3407)
    assert (config.temperature, config.min_p, config.top_p, config.top_k) == (1.0, 0.01, 1.0, -1)
    losses = config.loss
    assert (losses.advantage, losses.aggregation, losses.kl, losses.kl_estimator) == (
        "grpo",
        "grpo",
        "reverse",
        "k3",
    )
    assert (
        config.max_train_samples == 2000 and config.guide.name == "branch"
    )  # SAGE: the main variant
    assert (config.guide.tau, config.guide.ratio, config.guide.q_min, config.guide.q_max) == (
        1.2,
        0.3,
        0.6,
        1.4,
    )
    assert (
        config.loss.max_completion_length == 2048 - 512
    )  # dr_grpo's divisor: the completion budget


@pytest.mark.parametrize(
    "algo, expected",
    [
        (
            "grpo",
            dict(
                advantage="grpo",
                aggregation="grpo",
                eps_high=0.2,
                kl="reverse",
                dynamic_sampling=False,
            ),
        ),
        ("dr_grpo", dict(advantage="dr_grpo", aggregation="dr_grpo", eps_high=0.2, kl="reverse")),
        ("bnpo", dict(advantage="bnpo", aggregation="batch_token_mean", kl="none")),
        (
            "dapo",
            dict(
                advantage="grpo",
                aggregation="dapo",
                eps_high=0.28,
                kl="none",
                dynamic_sampling=True,
            ),
        ),
    ],
)
def test_algo_presets(algo, expected):
    """Each preset as the plain algorithm (--guide none); with the default guide, its anchor."""
    config = sage.parse_config(["--model", "m", "--algo", algo, "--guide", "none"])
    for key, value in expected.items():
        owner = config.extras["dynamic_sampling"] if key == "dynamic_sampling" else config.loss
        assert getattr(owner, key) == value, key


def test_explicit_flags_beat_presets_and_a_guide_keeps_the_anchor():
    config = sage.parse_config(
        ["--model", "m", "--algo", "dapo", "--eps-high", "0.3", "--advantage", "rloo"]
    )
    assert config.loss.eps_high == 0.3 and config.loss.advantage == "rloo"
    guided = sage.parse_config(["--model", "m", "--algo", "dapo", "--guide", "branch"])
    assert guided.loss.kl == "reverse"  # a guide acts only through the anchor
    by_default = sage.parse_config(["--model", "m", "--algo", "dapo"])  # --guide branch
    assert by_default.guide.name == "branch" and by_default.loss.kl == "reverse"
    assert (
        sage.parse_config(["--model", "m", "--algo", "dapo", "--no-dynamic-sampling"])
        .extras["dynamic_sampling"]
        .dynamic_sampling
        is False
    )


def test_a_config_built_in_code_is_the_sage_default():
    """Config() outside the CLI is complete: every default is a value, none a sentinel."""
    config = sage.Config()
    assert (
        config.loss.advantage,
        config.loss.aggregation,
        config.loss.eps_high,
        config.loss.kl,
    ) == ("grpo", "grpo", 0.2, "reverse")
    assert config.guide == guides.GuideConfig() and config.loss.max_completion_length == 1536
    assert config.guide.name == "branch" and config.loss.kl_estimator == "k3"  # the paper's SAGE


def test_the_model_is_required_and_the_demo_is_named(capsys):
    with pytest.raises(SystemExit):
        sage.parse_config([])
    assert "--model is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--guide", "entropy"], "argument --guide: invalid choice: 'entropy'"),
        (["--kl-estimator", "k4"], "argument --kl-estimator: invalid choice: 'k4'"),
        (["--algo", "ppo"], "argument --algo: invalid choice: 'ppo'"),
        (["--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
        (["--rollouts", "1"], "--rollouts 1: must be a finite number >= 2"),
        (["--guide", "branch", "--beta", "0"], "acts only through the KL anchor"),
        (["--q-min", "1.2"], "--q-min 1.2: must be a finite number in (0, 1]"),
        (["--sft-only"], "--sft-only needs --sft-dataset"),
    ],
)
def test_bad_flags_give_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        sage.parse_config(["--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_every_field_and_every_flag_has_a_docstring(capsys):
    for cls in (
        sage.Config,
        loss.LossConfig,
        guides.GuideConfig,
        *sage.EXTRAS.values(),
    ):
        docs = cli.field_docs(cls)
        assert {f.name for f in dataclasses.fields(cls)} == set(docs), cls
    with pytest.raises(SystemExit):
        sage.parse_config(["--help"])
    help_text = capsys.readouterr().out
    for flag in (
        "--model",
        "--beta",
        "--loss-agg",
        "--guide",
        "--tau",
        "--sft-dataset",
        "--dynamic-sampling",
        "--self-hints",
        "--eval-every",
        "--eval-top-p",
        "--random-eps UPPER LOWER",  # a schedule's (upper, lower) bounds: one flag, two values
        "--guide-cycle-decay",
    ):
        assert flag in help_text, flag
    assert "--extras" not in help_text  # a dict: no flag


def test_model_runs_default_to_settings_that_fit_one_gpu_and_help_says_so(capsys):
    config = sage.parse_config(["--model", "Qwen/Qwen2.5-Math-7B"])
    assert config.gradient_checkpointing and config.micro_batch_size == 4
    assert config.extras["sft"].sft_max_samples == 500
    with pytest.raises(SystemExit):
        sage.parse_config(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "gradient checkpointing on, 4 sequences per micro batch" in help_text


def test_overlong_penalty_and_informative_groups():
    penalty = dynamic_sampling.overlong_penalty(
        torch.tensor([10.0, 80.0, 90.0, 100.0, 130.0]), max_len=100, buffer=20
    )
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert sage.informative_groups(rewards, 2).tolist() == [False, True, False]


@pytest.mark.parametrize("max_rounds", [4, 1])
def test_dynamic_sampling_keeps_the_groups_with_signal_and_refills_the_step(max_rounds):
    """--dynamic-sampling: a group whose rewards are all equal is dropped and fresh prompts are
    sampled until the step holds prompts x G rows of groups with signal, or --max-refill-rounds
    ends it; frac_zero_signal_groups counts every round's groups. Here 2 prompts x G = 2: the
    first round has one group with signal, the second none, the third one."""
    flags = ["--model", "m", "--prompts-per-step", "2", "--rollouts", "2", "--dynamic-sampling"]
    config = sage.parse_config([*flags, "--max-refill-rounds", str(max_rounds)])
    problems = [{"problem": f"p{i}", "answer": "1", "prompt_ids": [10 + i]} for i in range(6)]

    def rollouts_of(chosen):
        rows = [problem for problem in chosen for _ in range(2)]
        return sage.Rollouts(
            prompt_ids=[p["prompt_ids"] for p in rows],
            completion_ids=[[5]] * 4,
            texts=["x"] * 4,
            finish_reasons=["stop"] * 4,
            engine_logps=[[0.0]] * 4,
            problems=[p["problem"] for p in rows],
            answers=[p["answer"] for p in rows],
        )

    later_rounds = iter([torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])])
    drawn = []

    def sample(chosen, seed):
        drawn.append(chosen)
        return rollouts_of(chosen), next(later_rounds)

    rollouts, rewards, metrics = dynamic_sampling.refill(
        PromptSampler(len(problems), seed=0),
        problems,
        rollouts=rollouts_of(problems[:2]),
        rewards=torch.tensor([0.0, 0.0, 1.0, 0.0]),  # only the second group has signal
        config=config,
        step=0,
        sample=sample,
        informative=sage.informative_groups,
    )
    if max_rounds == 4:  # the first round's second group, then the third round's first
        assert len(drawn) == 2 and rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
        assert rollouts.problems == ["p1", "p1", drawn[1][0]["problem"], drawn[1][0]["problem"]]
        assert metrics["frac_zero_signal_groups"] == pytest.approx(4 / 6)
        sampled = 4 / 12  # the logged reward and accuracy: every round's, not the kept rows'
    else:  # one refill round, without signal: the step trains on the one group it has
        assert len(drawn) == 1 and rewards.tolist() == [1.0, 0.0]
        assert rollouts.problems == ["p1", "p1"]
        assert metrics["frac_zero_signal_groups"] == pytest.approx(3 / 4)
        sampled = 3 / 8
    assert metrics["reward"] == metrics["accuracy"] == pytest.approx(sampled)


def test_dapo_chooses_groups_by_their_answers_and_adds_the_length_penalty_to_the_returns(
    monkeypatch,
):
    """--dynamic-sampling keeps the groups whose answers differ (DAPO's 0 < correct < G) and
    --overlong-buffer lowers the returns of the rows it kept: a group all right, one of its
    completions deep in the overlong zone, is dropped (its shaped rewards would differ), and the
    advantages are of the rewards plus the penalty. Completion budget 10, buffer 4: no penalty
    up to 6 tokens, -0.5 at 8."""
    flags = ["--model", "m", "--prompts-per-step", "2", "--rollouts", "2", "--algo", "dapo"]
    flags += ["--guide", "none", "--max-refill-rounds", "0", "--overlong-buffer", "4"]
    config = sage.parse_config([*flags, "--max-seq-len", "20", "--max-prompt-len", "10"])
    replies = [[("right", 2), ("right", 8)], [("right", 8), ("wrong", 2)]]  # (text, tokens)

    def generate(prompts, sampling):
        return [
            [
                SimpleNamespace(
                    text=text,
                    token_ids=[7] * length,
                    finish_reason="stop",
                    logprobs=[-1.0] * length,
                )
                for text, length in group
            ]
            for group in replies
        ]

    def reward(completions, problems, answers):
        return [float(text == "right") for text in completions]

    problems = [{"problem": f"p{i}", "answer": "1", "prompt_ids": [10 + i]} for i in range(2)]
    task = sage.Task(problems, sampler=PromptSampler(2, seed=0), reward_function=reward)
    task.sampler.take = lambda count: [0, 1]
    engine = SimpleNamespace(generate=generate)
    rollouts, rewards, metrics = sage.collect_rollouts(
        engine, task, config, step=0, timer=runs.PhaseTimer()
    )
    assert rollouts.problems == ["p1", "p1"] and rewards.tolist() == [1.0, 0.0]
    assert metrics["frac_zero_signal_groups"] == 0.5

    def advantages_of(returns, *args, **kwargs):
        raise LookupError(returns.tolist())  # the returns the advantages would be of

    monkeypatch.setattr(sage, "step_advantages", advantages_of)
    learner = sage.Learner(SimpleNamespace(device="cpu"), None, None, None, torch.Generator(), 0)
    with pytest.raises(LookupError) as returns:
        sage.train_on(learner, rollouts, rewards, config, step=0, timer=runs.PhaseTimer())
    assert returns.value.args[0] == [0.5, 0.0]


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
    rollouts = sage.Rollouts(
        prompts,
        completions,
        [""] * count,
        ["stop"] * count,
        [[0.0] * len(c) for c in completions],
        ["p"] * count,
        ["1"] * count,
    )
    return rollouts, rewards


def longest_micro_batch(rollouts, config, pad_id) -> dict:
    """The micro-batch of the step with the longest sequences: the n of its bound."""
    batches = [batch for _, batch in sage.micro_batches(rollouts, config, pad_id, "cpu")]
    return max(batches, key=lambda batch: batch["input_ids"].shape[1])


def gradient_bound(model, batch, gradient) -> float:
    """How far two float64 computations of one step's gradient entry can differ by rounding:
    bounds.model_bound's backward over ``batch`` (the step's longest), terms up to the gradient's
    largest entry."""
    magnitude = gradient.abs().max().item()
    return bounds.model_bound(model, batch, magnitude=magnitude, gradient=True)


class GradientRecorder:
    """Stands in for the optimizer: records the accumulated gradient at step()."""

    def __init__(self, params):
        self.params, self.gradient = list(params), None

    def step(self):
        self.gradient = torch.cat([p.grad.flatten() for p in self.params if p.grad is not None])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("aggregation", ["grpo", "batch_token_mean", "dr_grpo", "dapo"])
@pytest.mark.parametrize("guide", ["branch", "token"])
def test_micro_batches_accumulate_the_full_batch_gradient(tiny, aggregation, guide, float64_qwen2):
    """Splitting a step into micro-batches must not change its gradient, nor the loss it logs:
    --micro-batch-size is a memory setting (batch_token_mean too is the step's token mean, not
    TRL's per-micro-batch one). In float64, held to float64's rounding bound."""
    _, tokenizer = tiny
    rollouts, rewards = _rollouts(num_groups=3, group_size=4)
    advantages = loss.compute_advantages(rewards, 4, "grpo")
    reference = (
        demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=1)
        .double()
        .requires_grad_(False)
    )
    gradients, losses, logged = [], [], []
    for micro_batch_size in (12, 5):
        # token guide: per-completion normalization, so micro-batch boundaries must not matter
        config = sage.Config(
            model="m",
            rollouts=4,
            micro_batch_size=micro_batch_size,
            max_seq_len=32,
            max_prompt_len=16,
            loss=loss.LossConfig(aggregation=aggregation, kl="reverse"),
            min_p=0.0,
            steps=10,
            guide=guides.GuideConfig(name=guide, tau=0.0, ratio=0.1, token_sigma=(0.0, 0.0)),
            max_grad_norm=1e9,
        )
        policy = demo.build_tiny_model(tokenizer, max_position_embeddings=160).double()
        recorder = GradientRecorder(policy.parameters())
        batches = sage.micro_batches(rollouts, config, tokenizer.pad_token_id, "cpu")
        if len(batches) == 1:
            whole = batches[0][1]  # the step in one micro-batch: its longest sequences
        generator = torch.Generator().manual_seed(0)
        fixed = [sage.held_fixed_logps(policy, reference, batch, config) for _, batch in batches]
        metrics = sage.update_policy(
            policy, recorder, batches, fixed, advantages, config, step=0, generator=generator
        )
        gradients.append(recorder.gradient)
        losses.append(metrics["loss"])
        logged.append(metrics)
    assert gradients[0].dtype == torch.float64 and gradients[0].abs().max() > 0
    tolerance = gradient_bound(policy, whole, gradients[0])
    torch.testing.assert_close(gradients[1], gradients[0], atol=tolerance, rtol=0)
    # the token means' micro-batch losses are shares of the step's: their row-weighted mean was
    # about the step's loss over the number of micro-batches
    assert losses[1] == pytest.approx(losses[0], rel=1e-12, abs=1e-15)
    # and every other metric is the step's token mean (or extreme): entropy, kl/*, q/*, clip
    # fractions (their row-weighted means of the micro-batches' token means were off by ~1%).
    # The fractions are float32 sums over the step's tokens: float32's bound over that many.
    assert {"entropy", "kl/ref_k3", "kl/anchor_k3", "q/mean"} <= logged[0].keys()
    assert logged[1].keys() == logged[0].keys()
    bound = bounds.gamma(int(whole["completion_mask"].sum()), torch.float32)
    for key in logged[0].keys() - {"loss", "grad_norm"}:
        assert logged[1][key] == pytest.approx(logged[0][key], rel=bound, abs=1e-15), key


def test_a_non_finite_loss_or_gradient_stops_the_update_in_one_line_naming_where(tiny):
    """A NaN loss (here, from NaN advantages) stops the update before its backward. A NaN
    gradient under a finite loss (here, one weight's gradient made NaN by a hook) stops it before
    AdamW's step, naming how many trained tensors got one and the one nearest the loss. The hint
    blames --lr only once an update has run: at the first, the learning rate has not acted."""
    _, tokenizer = tiny
    rollouts, rewards = _rollouts(num_groups=2, group_size=4)
    config = sage.Config(model="m", rollouts=4, max_seq_len=32, max_prompt_len=16, steps=10)
    reference = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=1)
    reference.requires_grad_(False)

    def update(policy, advantages, step):
        batches = sage.micro_batches(rollouts, config, tokenizer.pad_token_id, device="cpu")
        held = [sage.held_fixed_logps(policy, reference, batch, config) for _, batch in batches]
        sage.update_policy(
            policy,
            torch.optim.AdamW(policy.parameters(), lr=1e-3),
            batches=batches,
            held=held,
            advantages=advantages,
            config=config,
            step=step,
            generator=torch.Generator().manual_seed(0),
        )

    policy = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=2)
    advantages = loss.compute_advantages(rewards, group_size=4, kind="grpo")
    with pytest.raises(FloatingPointError, match=r"^the loss is nan: lower --lr or --beta$"):
        update(policy, torch.full_like(advantages, math.nan), step=1)
    with pytest.raises(FloatingPointError) as stopped:
        update(policy, torch.full_like(advantages, math.nan), step=0)
    assert str(stopped.value) == f"the loss is nan: {sage.FIRST_UPDATE_HINT}"
    assert "not --lr" in sage.FIRST_UPDATE_HINT and "divides --rollouts" in sage.FIRST_UPDATE_HINT
    parameters = list(policy.named_parameters())
    name, weight = parameters[3]
    weight.register_hook(lambda gradient: gradient * math.nan)
    where = f"not finite in 1 of {len(parameters)} gradients, the one nearest the loss: {name}"
    for step, hint in ((3, "lower --lr or --beta"), (0, sage.FIRST_UPDATE_HINT)):
        with pytest.raises(FloatingPointError) as stopped:
            update(policy, advantages, step=step)
        assert str(stopped.value) == f"the gradient norm is nan ({where}): {hint}"
    with torch.no_grad():  # a diverged model: NaN logits, which the fast kernel refuses
        weight.fill_(math.nan)
    with pytest.raises(SystemExit, match=r"^error: logits have NaN or inf .*forward pass"):
        cli.run(lambda: update(policy, advantages, step=3))  # sage.py's one line, exit 1


def test_k1_return_shaping_keeps_every_tensor_on_the_log_probs_device():
    """On a GPU the rewards come from the grader on the CPU and the log-probs from the model on the
    GPU. A fake CUDA device (PyTorch's FakeTensorMode, no GPU needed) raises on any op that mixes
    the two, so this runs the k1_return path as the trainer does on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])  # the grader's, on the CPU
    for guide in guides.GUIDES:
        config = sage.Config(
            model="m",
            rollouts=3,
            steps=10,
            guide=guides.GuideConfig(name=guide, tau=0.5),
            loss=loss.LossConfig(advantage="rloo", kl="reverse", kl_estimator="k1_return"),
        )
        generator = torch.Generator().manual_seed(0)
        # on a GPU node, the real device (torch.nanquantile is data-dependent under fake CUDA);
        # a CPU build that says it sees a GPU (the gpu_sim sweep) keeps the fake one
        real_gpu = torch.version.cuda is not None and torch.cuda.is_available()
        on_gpu = contextlib.nullcontext() if real_gpu else None
        with on_gpu or FakeTensorMode(allow_non_fake_inputs=True):
            batches, fixed = [], []
            for rows in ([0, 1, 2, 3], [4, 5]):
                mask = torch.ones(len(rows), 5, device="cuda")
                old_logps, entropies = (
                    -torch.rand(len(rows), 5, device="cuda"),
                    torch.rand(len(rows), 5, device="cuda") * 2,
                )
                log_q = guides.compute_log_q(
                    config.guide, old_logps, entropies, mask, 0, config.steps, generator
                )
                batches.append((rows, {"completion_mask": mask}))
                fixed.append(
                    loss.HeldFixed(
                        old_logps=old_logps,
                        ref_logps=-torch.rand(len(rows), 5, device="cuda"),
                        log_q=log_q,
                        entropies=entropies,
                    )
                )
            returns = sage.kl_shaped_returns(
                rewards, batches, fixed, config, step=0, generator=generator
            )
            advantages = loss.compute_advantages(returns, config.rollouts, config.loss.advantage)
            assert advantages.shape == (6,) and returns.device.type == "cpu"
            assert all(held.log_q.device.type == "cuda" for held in fixed)


def test_sft_examples_are_never_cut_and_keep_the_closing_format(tmp_path, tiny):
    """OpenMathReasoning rows run to thousands of tokens: a cut example would lose </SOLUTION> and
    EOS and teach the model not to close the format. Long rows are dropped whole instead."""
    _, tokenizer = tiny
    rows = [
        {
            "problem": "What is 2 + 2?",
            "generated_solution": "<think>\n2+2=4\n</think>\nSo it is 4.",
            "expected_answer": "4",
        },
        {
            "problem": "What is 3 + 4?",
            "generated_solution": "<think>" + "3+4 " * 200 + "</think>",
            "expected_answer": "7",
        },
        {
            "problem": "Name the sum.",
            "generated_solution": "It is seven.",
            "expected_answer": "seven",
        },
        {"problem": "What is 1 + 5?", "generated_solution": "1+5=6", "expected_answer": "6"},
    ]
    path = str(tmp_path / "sft.jsonl")
    runs.write_jsonl_atomic(path, rows)
    examples, not_numeric = sft.sft_examples(
        load_rows(path), "problem", "generated_solution", "expected_answer", path
    )
    assert not_numeric == 1 and len(examples) == 3
    pairs, stats = sft.tokenize_sft_examples(tokenizer, examples, max_tokens=128)
    assert stats["kept"] == 2 and stats["dropped_too_long"] == 1 and stats["max_tokens"] == 128
    closing = tokenizer("</SOLUTION>", add_special_tokens=False)["input_ids"]
    for prompt, completion in pairs:
        assert len(prompt) + len(completion) <= 128
        assert completion[-1] == tokenizer.eos_token_id
        assert completion[-1 - len(closing) : -1] == closing
        assert "think>" not in tokenizer.decode(completion)
    assert tokenizer.decode(pairs[0][1][:-1]).startswith("<start_working_out>2+2=4")
    first, _ = sft.tokenize_sft_examples(tokenizer, examples, max_tokens=128, max_samples=1)
    assert first == pairs[:1]
    with pytest.raises(DataError, match="no SFT example fits in 10 tokens"):
        sft.tokenize_sft_examples(tokenizer, examples, max_tokens=10)


def test_sft_lowers_the_loss(tiny):
    _, tokenizer = tiny
    model = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=3)
    examples = [{"problem": "What is 1 + 2?", "completion": format_completion("1+2=3", "3")}] * 8
    pairs, _ = sft.tokenize_sft_examples(tokenizer, examples, max_tokens=160)
    settings = sft.SFTConfig(sft_epochs=3, sft_lr=3e-3, sft_batch_size=4, sft_warmup_steps=1)
    losses = sft.sft(
        model, pairs, tokenizer.pad_token_id, settings, sage.Config(max_seq_len=160), progress=False
    )
    assert losses[-1] < 0.5 * losses[0]


def test_plain_grpo_anchors_to_the_full_softmax_reference(tiny, float64_qwen2):
    """With q = 1 the anchor is exactly pi_ref, the reference's full softmax at the sampling
    temperature (the authors' anchor). Replaying the sampler's min-p on it would renormalize over
    the kept tokens: an implicit guide q = 1 / M_ref >= 1, M_ref the reference mass min-p keeps."""
    model, tokenizer = copy.deepcopy(tiny[0]).double(), tiny[1]  # float64: a tight bound
    prompt, completion = tokenizer("What is 3 + 4?")["input_ids"], tokenizer("3+4=7")["input_ids"]
    batch = loss.collate(
        [prompt, prompt[1:]], [completion, completion[:4]], tokenizer.pad_token_id, "cpu"
    )
    batch["engine_logps"] = torch.zeros_like(batch["completion_mask"])
    config = sage.Config(model="m", temperature=0.8, min_p=0.3)
    full = sage.held_fixed_logps(model, model, batch, config).ref_logps
    replay = dataclasses.replace(
        config, loss=dataclasses.replace(config.loss, reference_min_p=True)
    )
    replayed = sage.held_fixed_logps(model, model, batch, replay).ref_logps
    with torch.no_grad():
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            logits_to_keep=positions,
        ).logits
    expected, _ = loss.token_logps_and_entropies(logits, batch["completion_ids"], 0.8, 0.0)
    mask = batch["completion_mask"].bool()
    tolerance = bounds.model_bound(model, batch)
    torch.testing.assert_close(full[mask], expected[mask], atol=tolerance, rtol=0)
    probs = (logits / 0.8).softmax(-1)
    kept_mass = torch.where(probs >= 0.3 * probs.amax(-1, keepdim=True), probs, 0.0).sum(
        -1
    )  # M_ref [B, C]
    implicit_log_q = (replayed - full)[mask]
    # two log-probs of one forward pass: 2 tolerances; 1e-3 is the effect, far above rounding
    assert (implicit_log_q >= -2 * tolerance).all() and implicit_log_q.max() > 1e-3
    # the sampled token may sit below the min-p threshold here (these tokens were not sampled): then
    # the replay keeps it as the sampler would have, and M_ref gains its own mass
    own = probs.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)
    below = own < 0.3 * probs.amax(-1)
    kept_mass = torch.where(below, kept_mass + own, kept_mass)
    # two log-probs (n = forward_length each) and the log of a sum over the vocabulary
    tolerance = 3 * tolerance
    torch.testing.assert_close(implicit_log_q, -kept_mass.log()[mask], atol=tolerance, rtol=0)


def test_loss_distribution_sets_what_the_policy_log_probs_and_the_guide_read(tiny, float64_qwen2):
    """--loss-distribution full (default): the policy's log-probs and the H_t the guide reads are
    pi_T's full softmax, as in TRL; min_p: the sampler's truncation, renormalized, its entropy
    too. The reference stays the full softmax either way (unless --reference-min-p)."""
    model, tokenizer = copy.deepcopy(tiny[0]).double(), tiny[1]  # float64: a tight bound
    prompt, completion = tokenizer("What is 3 + 4?")["input_ids"], tokenizer("3+4=7")["input_ids"]
    batch = loss.collate([prompt], [completion], tokenizer.pad_token_id, "cpu")
    batch["engine_logps"] = torch.zeros_like(batch["completion_mask"])
    with torch.no_grad():
        logits = fast_logprobs.completion_logits(model, batch)  # [1, C, V]
    ids, read = batch["completion_ids"], {}
    for distribution in ("full", "min_p"):
        config = sage.Config(
            model="m", temperature=0.8, min_p=0.3, guide=guides.GuideConfig(name="branch", tau=0.0)
        )
        config.loss = dataclasses.replace(
            config.loss, distribution=distribution, kl_estimator="k1_return"
        )
        with torch.no_grad():
            logps, entropies = sage.sampled_logps(model, batch, config=config)
        held = sage.held_fixed_logps(model, model, batch, config)
        sage.guide_log_q(held, batch["completion_mask"], config, step=0, generator=None)
        min_p = 0.3 if distribution == "min_p" else 0.0
        expected, expected_entropies = loss.token_logps_and_entropies(logits, ids, 0.8, min_p)
        tolerance = bounds.model_bound(model, batch)
        torch.testing.assert_close(logps, expected, atol=tolerance, rtol=0)
        torch.testing.assert_close(entropies, expected_entropies, atol=tolerance, rtol=0)
        full_ref, _ = loss.token_logps_and_entropies(logits, ids, 0.8, 0.0)
        torch.testing.assert_close(held.ref_logps, full_ref, atol=tolerance, rtol=0)
        # the guide reads these entropies: q_t = 1 + 0.3 H_t (tau 0), clamped; guides.py keeps
        # float64 (product, sum, log; then exp here: 4 rounded operations)
        expected_q = (1.0 + 0.3 * expected_entropies).clamp(0.6, 1.4)
        assert held.log_q.dtype == torch.float64
        torch.testing.assert_close(
            held.log_q.exp(), expected_q, atol=0.3 * tolerance, rtol=bounds.gamma(4, torch.float64)
        )
        read[distribution] = (logps, entropies)
    # truncation raises a kept token's log-prob and lowers the entropy, somewhere
    assert (read["min_p"][0] >= read["full"][0] - 2 * tolerance).all()  # two paths' log-probs
    assert (read["min_p"][1] < read["full"][1] - 2 * tolerance).any()


def test_guide_entropy_reference_takes_q_from_the_reference_pass(tiny):
    """--guide-entropy reference: q comes from pi_ref's entropies, computed by the reference pass
    the anchor makes anyway, and is held for the update; by default (policy) the update's own
    forward pass gives it."""
    reference, tokenizer = tiny
    policy = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=5)
    prompt, completion = tokenizer("What is 3 + 4?")["input_ids"], tokenizer("3+4=7")["input_ids"]
    batch = loss.collate([prompt, prompt], [completion, completion[:3]], 0, "cpu")
    batch["engine_logps"] = torch.zeros_like(batch["completion_mask"])
    mask = batch["completion_mask"]
    held = {}
    for entropy in ("reference", "policy"):
        guide = guides.GuideConfig(name="branch", tau=0.1, q_max=4.0, entropy=entropy)
        config = sage.Config(model="m", guide=guide, min_p=0.0)
        held[entropy] = sage.held_fixed_logps(policy, reference, batch, config)
        if entropy == "reference":
            sage.guide_log_q(held[entropy], mask, config, step=0, generator=None)
    assert held["policy"].old_logps is None  # the update's own forward pass gives the signals
    reference_logps, reference_entropies = loss.completion_logps(reference, batch, 1.0, 0.0)
    policy_logps, policy_entropies = loss.completion_logps(policy, batch, 1.0, 0.0)
    guide = guides.GuideConfig(name="branch", tau=0.1, q_max=4.0)
    from_reference = guides.compute_log_q(guide, reference_logps, reference_entropies, mask, 0, 1)
    from_policy = guides.compute_log_q(guide, policy_logps, policy_entropies, mask, 0, 1)
    torch.testing.assert_close(held["reference"].log_q, from_reference)
    assert (held["reference"].log_q - from_policy).abs().max() > 1e-5


# ---- The trainer's wiring: what sage.py feeds the loss, against the loss computed by hand ------


def _wiring_config(**changes):
    """A step whose guide matters: q = 1 + 0.3 H_t varies by token and stays inside the clamp, and
    beta is large enough that the anchor moves the gradient."""
    guide = guides.GuideConfig(name="branch", tau=0.0, ratio=0.3, q_max=4.0)
    settings = dict(
        model="m",
        rollouts=4,
        micro_batch_size=6,
        max_seq_len=32,
        max_prompt_len=16,
        min_p=0.0,
        steps=10,
        guide=guide,
        loss=loss.LossConfig(kl="reverse", kl_estimator="k3", beta=0.5),
        max_grad_norm=1e9,
    )
    return sage.Config(**{**settings, **changes})


def _wiring_models(tokenizer):
    """Policy and reference in float64 (with the float64_qwen2 fixture: throughout), so that the
    wiring tests hold sage.py's step to float64's rounding bound."""
    policy = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=2).double()
    reference = demo.build_tiny_model(tokenizer, max_position_embeddings=160, seed=1).double()
    return policy, reference.requires_grad_(False)


def _sage_step(policy, reference, rollouts, rewards, config, pad_id):
    """sage.py's own step 3-7 on fixed rollouts: (its gradient, its advantages)."""
    recorder = GradientRecorder(policy.parameters())
    batches = sage.micro_batches(rollouts, config, pad_id, "cpu")
    generator = torch.Generator().manual_seed(0)
    held = [sage.held_fixed_logps(policy, reference, b, config) for _, b in batches]
    advantages = sage.step_advantages(rewards, batches, held, config, step=0, generator=generator)
    sage.update_policy(
        policy, recorder, batches, held, advantages, config, step=0, generator=generator
    )
    return recorder.gradient, advantages


def _loss_by_hand(policy, reference, rollouts, advantages, config, pad_id, with_guide=True):
    """The gradient of the step's loss built from loss.py and guides.py directly: per
    micro-batch, log q from guides.compute_log_q on the policy's own signals, loss.policy_loss,
    each micro-batch weighted by its rows."""
    params = [p for p in policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    batches = sage.micro_batches(rollouts, config, pad_id, "cpu")
    total_rows = sum(len(rows) for rows, _ in batches)
    step_tokens = float(sum(batch["completion_mask"].sum() for _, batch in batches))
    for rows, batch in batches:
        mask = batch["completion_mask"]
        logps, entropies = loss.completion_logps(policy, batch, temperature=1.0, min_p=0.0)
        with torch.no_grad():
            ref_logps, _ = loss.completion_logps(reference, batch, temperature=1.0, min_p=0.0)
        log_q = None
        if with_guide:
            log_q = guides.compute_log_q(
                config.guide, logps.detach(), entropies, mask, step=0, total_steps=config.steps
            )
        fixed = loss.HeldFixed(
            old_logps=logps.detach(), ref_logps=ref_logps, log_q=log_q, entropies=entropies
        )
        value, _ = loss.policy_loss(
            logps, advantages[rows], mask, fixed, config.loss, step_tokens=step_tokens
        )
        (value * len(rows) / total_rows).backward()
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


def test_the_update_puts_the_guides_log_q_into_the_anchor(tiny, float64_qwen2):
    """sage.update_policy's gradient is that of loss.policy_loss fed the log q that
    guides.compute_log_q gives on the policy's own forward pass, and not that of the loss with no
    guide: an update that dropped log q would pass every shape and finiteness check."""
    _, tokenizer = tiny
    rollouts, rewards = _rollouts(num_groups=3, group_size=4, seed=7)
    config = _wiring_config()
    policy, reference = _wiring_models(tokenizer)
    gradient, advantages = _sage_step(
        policy, reference, rollouts, rewards, config, tokenizer.pad_token_id
    )
    pad_id = tokenizer.pad_token_id
    guided = _loss_by_hand(policy, reference, rollouts, advantages, config, pad_id)
    unguided = _loss_by_hand(
        policy, reference, rollouts, advantages, config, pad_id, with_guide=False
    )
    whole = longest_micro_batch(rollouts, config, pad_id)
    tolerance = gradient_bound(policy, whole, guided)
    torch.testing.assert_close(gradient, guided, atol=tolerance, rtol=0)
    assert (guided - unguided).abs().max() > 1e-3 * guided.abs().max()


def test_k1_return_advantages_are_those_of_the_shaped_returns(tiny, float64_qwen2):
    """With k1_return each reward is shaped by beta times its completion's k1 against
    p~ = pi_ref * q before the advantage (Eq. 8); the unshaped rewards give other advantages."""
    _, tokenizer = tiny
    rollouts, rewards = _rollouts(num_groups=3, group_size=4, seed=7)
    estimator = loss.LossConfig(kl="reverse", kl_estimator="k1_return", beta=0.5, advantage="rloo")
    config = _wiring_config(loss=estimator)
    policy, reference = _wiring_models(tokenizer)
    _, advantages = _sage_step(policy, reference, rollouts, rewards, config, tokenizer.pad_token_id)
    shaped, tolerance = [], 0.0
    for rows, batch in sage.micro_batches(rollouts, config, tokenizer.pad_token_id, "cpu"):
        mask = batch["completion_mask"]
        with torch.no_grad():
            logps, entropies = loss.completion_logps(policy, batch, temperature=1.0, min_p=0.0)
            ref_logps, _ = loss.completion_logps(reference, batch, temperature=1.0, min_p=0.0)
        log_q = guides.compute_log_q(
            config.guide, logps, entropies, mask, step=0, total_steps=config.steps
        )
        shaped.append(loss.kl_shaped_rewards(rewards[rows], logps, ref_logps, log_q, mask, 0.5))
        # a shaped reward: r - 0.5 sum_t (log pi - log pi_ref - log q) over C tokens, each term
        # off by two log-probs' bounds (log q follows log pi's entropy: a third), then the sum
        terms = (logps - ref_logps - log_q).abs().max().item()
        per_term = 3 * bounds.model_bound(policy, batch)
        length = mask.shape[1]
        error = 0.5 * (
            length * per_term + bounds.difference_bound(length + 2, terms, torch.float64)
        )
        tolerance = max(tolerance, error)
    expected = loss.compute_advantages(torch.cat(shaped), 4, "rloo")
    # rloo: r_i - the mean of the group's 3 others, each off by at most that; then its own rounding
    magnitude = torch.cat(shaped).abs().max().item()
    tolerance = 2 * tolerance + bounds.difference_bound(4, magnitude, torch.float64)
    torch.testing.assert_close(advantages, expected, atol=tolerance, rtol=0)
    unshaped = loss.compute_advantages(rewards, 4, "rloo")
    assert (advantages - unshaped).abs().max() > 1e-3


def test_the_dapo_update_divides_by_the_steps_token_count(tiny, float64_qwen2):
    """--loss-agg dapo: each micro-batch's token sum is divided by the whole step's completion
    tokens (step_tokens), so the micro-batches' gradients add up to that of loss.policy_loss on
    the whole batch at once; a wrong step_tokens scales the gradient and fails here."""
    _, tokenizer = tiny
    rollouts, rewards = _rollouts(num_groups=3, group_size=4, seed=7)
    config = _wiring_config(loss=loss.LossConfig(aggregation="dapo", kl="reverse", beta=0.5))
    policy, reference = _wiring_models(tokenizer)
    pad_id = tokenizer.pad_token_id
    gradient, advantages = _sage_step(policy, reference, rollouts, rewards, config, pad_id)
    assert len(sage.micro_batches(rollouts, config, pad_id, "cpu")) == 2
    whole_batch = dataclasses.replace(config, micro_batch_size=len(rollouts.completion_ids))
    expected = _loss_by_hand(policy, reference, rollouts, advantages, whole_batch, pad_id)
    assert expected.abs().max() > 0
    whole = longest_micro_batch(rollouts, whole_batch, pad_id)
    tolerance = gradient_bound(policy, whole, expected)
    torch.testing.assert_close(gradient, expected, atol=tolerance, rtol=0)


class SteppingRecorder(GradientRecorder):
    """Records the gradient at each step(), then takes a plain SGD step with it."""

    def __init__(self, params, lr):
        super().__init__(params)
        self.lr, self.gradients = lr, []

    def step(self):
        super().step()
        self.gradients.append(self.gradient)
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)


def test_ppo_epochs_step_after_each_pass_against_the_pi_old_held_before_the_first(
    tiny, monkeypatch, float64_qwen2
):
    """--ppo-epochs E is TRL's num_iterations: each pass over the step's rollouts ends in an
    optimizer step, so the second pass runs on moved parameters, its ratio pi_theta / pi_old
    leaves 1 and the clip acts, while pi_old, pi_ref and log q stay those held before the first
    pass (Eq. 3). The first pass is the on-policy step of E = 1."""
    _, tokenizer = tiny
    rollouts, rewards = _rollouts(num_groups=3, group_size=4, seed=7)
    pad_id = tokenizer.pad_token_id
    on_policy, _ = _sage_step(
        *_wiring_models(tokenizer), rollouts, rewards, _wiring_config(), pad_id
    )
    config = _wiring_config(ppo_epochs=2)
    policy, reference = _wiring_models(tokenizer)
    batches = sage.micro_batches(rollouts, config, pad_id, "cpu")
    generator = torch.Generator().manual_seed(0)
    held = [sage.held_fixed_logps(policy, reference, b, config) for _, b in batches]
    for (_, b), fixed in zip(batches, held):  # log q held before the update, as k1_return's
        sage.guide_log_q(fixed, b["completion_mask"], config, step=0, generator=generator)
    names = ("old_logps", "ref_logps", "log_q")
    before = [{name: getattr(fixed, name).clone() for name in names} for fixed in held]
    advantages = sage.step_advantages(rewards, batches, held, config, step=0, generator=generator)
    calls, policy_loss = [], loss.policy_loss  # what each micro-batch of each pass fed the loss

    def recording_loss(logps, *args, **kwargs):
        value, metrics = policy_loss(logps, *args, **kwargs)
        calls.append((logps.detach(), kwargs["fixed"], kwargs["completion_mask"].bool(), metrics))
        return value, metrics

    monkeypatch.setattr(loss, "policy_loss", recording_loss)
    optimizer = SteppingRecorder(policy.parameters(), lr=0.01)
    metrics = sage.update_policy(
        policy, optimizer, batches, held, advantages, config, step=0, generator=generator
    )
    assert len(optimizer.gradients) == 2 and len(calls) == 2 * len(batches)
    whole = longest_micro_batch(rollouts, config, pad_id)
    tolerance = gradient_bound(policy, whole, on_policy)
    torch.testing.assert_close(optimizer.gradients[0], on_policy, atol=tolerance, rtol=0)
    assert (optimizer.gradients[1] - optimizer.gradients[0]).abs().max() > 1e-3
    for i, fixed in enumerate(held):
        first, second = calls[i], calls[len(batches) + i]
        for name in names:  # held fixed: the same tensors in both passes, never written to
            torch.testing.assert_close(getattr(fixed, name), before[i][name], rtol=0, atol=0)
            assert getattr(first[1], name) is getattr(fixed, name)
            assert getattr(second[1], name) is getattr(fixed, name)
        logps, _, mask, first_metrics = first
        ratio_one = bounds.model_bound(policy, batches[i][1])  # ratio 1: two forward passes
        torch.testing.assert_close(logps[mask], fixed.old_logps[mask], atol=ratio_one, rtol=0)
        assert first_metrics["clip_ratio/region"] == 0.0
        logps, _, mask, _ = second
        assert (logps - fixed.old_logps)[mask].abs().max() > 0.3  # outside [0.8, 1.2]
    assert max(call[3]["clip_ratio/region"] for call in calls[len(batches) :]) > 0
    # the loss is the passes' mean of what the backward took: each micro-batch's loss times its
    # weight, summed over the pass
    rows = [mask.shape[0] for _, _, mask, _ in calls]
    losses = [call[3]["loss"] for call in calls]
    expected_loss = 0.0
    for n, value in zip(rows, losses):
        expected_loss += value * loss.micro_batch_weight(
            config.loss.aggregation, micro_rows=n, total_rows=sum(rows) // 2
        )
    assert metrics["loss"] == expected_loss / 2  # the same float64 operations in the same order
    # clip_grad_norm_'s norm of per-parameter norms against one norm of all N entries: sums of
    # squares (positive terms, relative error gamma_(N + P)), a sqrt per parameter, a square and
    # the last sqrt; then the mean of two passes
    norms = [gradient.norm().item() for gradient in optimizer.gradients]
    count, parameters = on_policy.numel(), len(list(policy.parameters()))
    rel = 2 * bounds.gamma(count + parameters + 8, torch.float64)
    assert metrics["grad_norm"] == pytest.approx(sum(norms) / 2, rel=rel, abs=0)


# The last three load the model onto the device (CUDA on a GPU node) before the data refuses
LOADED = pytest.mark.cuda_kernels


@pytest.mark.parametrize(
    "case, message",
    [
        ("a directory without a model", "cannot load model"),
        pytest.param(
            "a malformed dataset", "train.jsonl: line 2 does not parse as JSON", marks=LOADED
        ),
        pytest.param("a wrong --problem-key", "has no field 'question'", marks=LOADED),
        pytest.param(
            "an --eval-solution-key no held-out row has",
            "--eval-solution-key proof: no problem",
            marks=LOADED,
        ),
    ],
)
def test_a_run_that_cannot_start_ends_in_one_line_and_writes_nothing(
    case, message, tmp_path, tiny_model_dir
):
    """The run directory is written only once the model, the data and the reward have loaded."""
    rows = '{"prompt": "1+1", "solution": "2"}\n'
    rows += '{"prompt": "2+2",\n' if case == "a malformed dataset" else rows
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "empty").mkdir()
    model = str(tmp_path / "empty") if case == "a directory without a model" else tiny_model_dir
    argv = ["--model", model, "--dataset", str(tmp_path / "train.jsonl"), "--backend", "hf"]
    argv += ["--out", str(tmp_path / "runs"), "--name", "x", "--steps", "1"]
    argv += ["--problem-key", "question"] if case == "a wrong --problem-key" else []
    if case == "an --eval-solution-key no held-out row has":
        (tmp_path / "held.jsonl").write_text('{"problem": "3+3", "answer": "6"}\n')
        argv += ["--eval-every", "1", "--eval-benchmarks", str(tmp_path / "held.jsonl")]
        argv += ["--eval-solution-key", "proof"]
    with pytest.raises((SystemExit, cli.UsageError)) as ended:
        sage.main(argv)
    text = str(ended.value)
    assert message in text and "\n" not in text and "internet" not in text
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "case, message",
    [
        ("a directory without a model", "cannot load model"),  # as in the test above
        ("a 7B --full-finetune", "alone take 121.8 GB: drop --full-finetune (LoRA"),
    ],
)
def test_on_cuda_a_model_that_cannot_load_or_fit_is_one_line_before_it_loads(
    case, message, tmp_path, monkeypatch
):
    """The memory plan runs on CUDA only, so this CPU forces its path (an 80 GB card): a model
    directory without a model gives the same line as on the CPU (the cheaper check speaks before
    the plan), a 7B --full-finetune (on the CPU: tests/test_sage_cli.py) the plan's one refusal
    naming --full-finetune, and neither any --backend hf advice the plan cannot back."""
    from transformers import Qwen2Config

    from machinery import memory_plan

    card = type("Card", (), {"total_memory": 80 * 10**9})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    (tmp_path / "model").mkdir()
    argv = ["--model", str(tmp_path / "model"), "--out", str(tmp_path / "runs"), "--name", "x"]
    if case == "a 7B --full-finetune":
        seven_b = Qwen2Config(**memory_plan.QWEN25_MATH_7B, tie_word_embeddings=False)
        seven_b.save_pretrained(tmp_path / "model")
        argv += ["--full-finetune"]
    else:
        argv += ["--backend", "hf"]
    with pytest.raises((SystemExit, cli.UsageError)) as ended:
        sage.main(argv)
    text = str(ended.value)
    assert message in text and "\n" not in text and "--backend hf" not in text, text
    assert not (tmp_path / "runs").exists()


def test_on_cuda_the_engine_is_bf16_even_for_a_full_finetune(tiny, monkeypatch):
    """--full-finetune trains float32 weights on CUDA; the engine starts in bf16 (the memory
    plan counts a bf16 engine, and the push casts). On the CPU it stays float32."""
    import rollout

    model, _ = tiny
    started = []
    monkeypatch.setattr(rollout, "make_engine", lambda *args, **kwargs: started.append(kwargs))
    config = sage.Config(model="tiny", full_finetune=True)
    for cuda in (False, True):  # what decides the device, forced both ways
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        learner = sage.Learner(
            policy=model,
            reference=None,
            optimizer=None,
            scheduler=None,
            guide_generator=torch.Generator(),
            pad_id=0,
        )
        sage.start_engine(config, "tiny", learner)
    assert next(model.parameters()).dtype == torch.float32
    assert [kwargs["dtype"] for kwargs in started] == ["float32", "bfloat16"]
