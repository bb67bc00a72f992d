"""trl_sage.py: SAGE on TRL's GRPOTrainer.

* Differential: on identical inputs, the trainer's loss and gradient equal loss.policy_loss on
  log-probs and entropies computed independently from the model's logits, with a non-trivial
  guide (branch, token), to 1e-6; at q = 1 they equal TRL's own GRPO loss for each loss type.
* Guard: the one private TRL method the integration calls still has the pinned signature.
* End to end: the CLI as a subprocess on the tiny model (transformers generation, CPU), one process
  and two processes under `accelerate launch` (gloo).

Skipped as a whole when TRL is not installed.
"""

import inspect
import json
import os
import subprocess
import sys
import warnings

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402

import bounds  # noqa: E402
import guides  # noqa: E402
import loss  # noqa: E402
from machinery.fast_logprobs import chunked_token_logps_and_entropies  # noqa: E402
from task.grading import math_reward  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl import GRPOConfig, GRPOTrainer  # noqa: E402

    from extras import trl_sage  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCUMULATION = 2


# --------------------------------------------------------------------------------------------
# A trainer on the tiny model and one hand-made batch
# --------------------------------------------------------------------------------------------


def make_trainer(
    model_dir,
    tmp_path,
    *,
    loss_type="grpo",
    beta=0.05,
    guide=None,
    kl_estimator="k3",
    bias_correction=False,
):
    from datasets import Dataset
    from peft import LoraConfig

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION,
        num_generations=2,
        max_completion_length=8,
        beta=beta,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        use_bias_correction_kl=bias_correction,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        use_cpu=True,
        max_steps=10,
    )
    dataset = Dataset.from_list(
        [
            {
                "prompt": trl_sage.prompt_messages(f"What is {i} + 1?"),
                "problem": f"What is {i} + 1?",
                "answer": str(i + 1),
            }
            for i in range(8)
        ]
    )
    settings = trl_sage.SageSettings(
        guide=guide or guides.GuideConfig("none"), kl_estimator=kl_estimator
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl_sage.SageGRPOTrainer(
            model_dir,
            [trl_sage.trl_reward(math_reward)],
            args,
            sage=settings,
            train_dataset=dataset,
            peft_config=LoraConfig(
                r=4, lora_alpha=8, target_modules=trl_sage.LORA_TARGETS, task_type="CAUSAL_LM"
            ),
        )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference (LoRA starts at B = 0)
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = ACCUMULATION
    return trainer


def make_inputs(trainer, *, off_policy=False, importance=None):
    """A batch as TRL's generation step returns it: left-padded prompts, right-padded
    completions."""
    generator = torch.Generator().manual_seed(1)
    vocab = trainer.model.config.vocab_size
    prompt_lengths, completion_lengths = [5, 3, 4, 5], [6, 2, 4, 1]
    prompt_ids = torch.zeros(4, 5, dtype=torch.long)
    prompt_mask = torch.zeros(4, 5, dtype=torch.long)
    completion_ids = torch.zeros(4, 6, dtype=torch.long)
    completion_mask = torch.zeros(4, 6, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_ids[row, 5 - p :] = torch.randint(10, vocab - 10, (p,), generator=generator)
        prompt_mask[row, 5 - p :] = 1
        completion_ids[row, :c] = torch.randint(10, vocab - 10, (c,), generator=generator)
        completion_mask[row, :c] = 1
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(4, generator=generator),
        # as if the generation batch held more tokens
        "num_items_in_batch": completion_mask.sum() * 3,
    }
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, 6
        )
        with trainer.model.disable_adapter():
            ref, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, 6
            )
    if trainer.beta != 0:
        inputs["ref_per_token_logps"] = ref
    if off_policy:  # pi_old != pi: ratios away from 1, some clipped
        inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=generator)
    if importance is not None:
        inputs["importance_sampling_ratio"] = importance
    return inputs


def reference_loss(trainer, inputs, guide_config, kl_estimator):
    """loss.policy_loss on log-probs and entropies from the model's plain logits (not TRL's
    pass)."""
    completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
    length = completion_ids.shape[1]
    logits = trainer.model(
        input_ids=torch.cat([inputs["prompt_ids"], completion_ids], 1),
        attention_mask=torch.cat([inputs["prompt_mask"], mask], 1),
    ).logits
    logps, entropies = chunked_token_logps_and_entropies(
        logits[:, -length - 1 : -1], completion_ids, trainer.temperature, inplace_backward=False
    )
    old = inputs.get("old_per_token_logps", logps.detach())
    log_q = None
    if guide_config.name != "none":
        log_q = guides.compute_log_q(
            guide_config,
            old,
            entropies,
            mask,
            0,
            trainer.args.max_steps,
            trl_sage.guide_generator(trainer.args.seed, 0, 0, 0),
        )
    aggregation = trl_sage.AGGREGATIONS[trainer.loss_type]
    global_tokens = None  # TRL's bnpo: each micro-batch's own token mean
    if aggregation == "dapo":  # TRL's dapo: over the accumulation window's tokens
        global_tokens = (
            inputs["num_items_in_batch"] * ACCUMULATION / trainer.args.steps_per_generation
        )
    importance = inputs.get("importance_sampling_ratio")
    weights = None if importance is None else importance.expand_as(mask)
    fixed = loss.HeldFixed(
        old, inputs.get("ref_per_token_logps"), log_q, importance_weights=weights
    )
    config = loss.LossConfig(
        aggregation=aggregation,
        eps_low=0.2,
        eps_high=0.28,
        kl_estimator=kl_estimator,
        beta=trainer.args.beta,
        max_completion_length=8,
    )
    value, _ = loss.policy_loss(logps, inputs["advantages"], mask, fixed, config, global_tokens)
    return value if aggregation == "dapo" else value / ACCUMULATION


def loss_and_grads(trainer, compute):
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    value = compute()
    return value.detach(), torch.autograd.grad(value, params)


# Not a rounding bound: TRL's loss and sage.py's are two implementations (their own masking,
# normalisation and reduction orders) compared in CPU float32; 1e-6 is kept as found.
def assert_close(first, second, tolerance=1e-6):
    (value_a, grads_a), (value_b, grads_b) = first, second
    assert abs(value_a.item() - value_b.item()) <= tolerance, (value_a.item(), value_b.item())
    worst = max((a - b).abs().max().item() for a, b in zip(grads_a, grads_b))
    scale = max(g.abs().max().item() for g in grads_b)
    assert scale > 1e-4, "the gradient is trivially zero: the test checks nothing"
    assert worst <= tolerance, f"gradients differ by {worst:.3g} (largest component {scale:.3g})"


# --------------------------------------------------------------------------------------------
# Differential tests
# --------------------------------------------------------------------------------------------


@pytest.mark.cpu_only("TRL's and sage.py's losses agree to 1e-7 in CPU float32")
def test_trl_path_matches_policy_loss_with_a_guide(tiny_model_dir, tmp_path):
    cases = [
        # branch: tau at the median entropy and a slope that spans [1, 1.4] over this batch
        ("branch", "grpo", "k3", False),
        ("branch", "dapo", "ratio_k3", False),
        ("token", "bnpo", "k3", True),
        ("token", "dr_grpo", "k2", False),
    ]
    for guide_name, loss_type, estimator, off_policy in cases:
        trainer = make_trainer(
            tiny_model_dir,
            tmp_path,
            loss_type=loss_type,
            kl_estimator=estimator,
            bias_correction=estimator == "ratio_k3",
        )
        inputs = make_inputs(trainer, off_policy=off_policy)
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            6,
            compute_entropy=True,
        )
        valid = entropies[inputs["completion_mask"].bool()]
        spread = (valid.max() - valid.median()).item()
        config = guides.GuideConfig(name=guide_name, tau=valid.median().item(), ratio=0.5 / spread)
        trainer.sage = trl_sage.SageSettings(guide=config, kl_estimator=estimator)
        ours = loss_and_grads(trainer, lambda: trainer.compute_loss(trainer.model, inputs))
        log_q = inputs["sage_log_q"][inputs["completion_mask"].bool()]
        assert log_q.std() > 0.01, f"{guide_name}: the guide is trivial in this batch"
        reference = loss_and_grads(
            trainer, lambda: reference_loss(trainer, inputs, config, estimator)
        )
        assert_close(ours, reference)
        # ... and the guide matters at that precision: without it, loss and gradient move by far
        # more.
        unguided = loss_and_grads(
            trainer, lambda: reference_loss(trainer, inputs, guides.GuideConfig("none"), estimator)
        )
        moved = max((a - b).abs().max().item() for a, b in zip(ours[1], unguided[1]))
        assert moved > 1e-4, f"{guide_name}: the guide changes the gradient by only {moved:.2g}"


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.cpu_only("TRL's and sage.py's losses agree to 1e-7 in CPU float32")
def test_at_q_equal_1_the_loss_is_trls_own(tiny_model_dir, tmp_path, loss_type):
    # (estimator, TRL's use_bias_correction_kl, old log-probs, vLLM IS ratio shape)
    cases = [
        ("k3", False, False, None),
        ("k3", False, True, (4, 6)),
        ("ratio_k3", True, False, (4, 1)),
    ]
    for estimator, bias_correction, off_policy, ratio_shape in cases:
        trainer = make_trainer(
            tiny_model_dir,
            tmp_path,
            loss_type=loss_type,
            kl_estimator=estimator,
            bias_correction=bias_correction,
        )
        importance = None
        if ratio_shape is not None:  # as TRL's generation step leaves it, vLLM's IS correction on
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
            importance = torch.rand(ratio_shape, generator=torch.Generator().manual_seed(2)) + 0.5
        inputs = make_inputs(trainer, off_policy=off_policy, importance=importance)
        ours = loss_and_grads(trainer, lambda: trainer.compute_loss(trainer.model, inputs))
        theirs = loss_and_grads(
            trainer, lambda: GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        )
        assert_close(ours, theirs)


@pytest.mark.cpu_only("exact CPU float32 comparison")
def test_kl_return_reward_is_the_sequence_k1_of_the_anchor(tiny_model_dir, tmp_path):
    """k1_return: TRL's reward hook gets -beta * sum_t (log pi - log pi_ref - log q_t) per
    completion."""
    config = guides.GuideConfig(name="branch", tau=5.0, ratio=2.0)
    trainer = make_trainer(tiny_model_dir, tmp_path, guide=config, kl_estimator="k1_return")
    assert trainer.beta == 0.0 and trainer.sage_beta == 0.05  # TRL's own reference pass is skipped
    assert trainer.reward_func_names == ["math_reward", "kl_return"]
    tokenizer = trainer.processing_class
    problems = ["What is 3 + 4?", "Add 1 and 2."]
    prompts = [trl_sage.prompt_messages(p) for p in problems]
    completions = [
        tokenizer("<SOLUTION>7</SOLUTION>", add_special_tokens=False)["input_ids"],
        [5, 6, 7],
    ]
    logged = {}
    rewards = trainer.kl_return(prompts, None, completions, log_metric=logged.__setitem__)

    expected = []
    for problem, completion in zip(problems, completions):
        prompt = trl_sage.build_prompt_ids(tokenizer, problem)
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
            with trainer.model.disable_adapter():
                ref_logits = trainer.model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
        target = torch.tensor([completion])
        logps, entropies = loss.token_logps_and_entropies(logits, target)
        ref, _ = loss.token_logps_and_entropies(ref_logits, target)
        mask = torch.ones_like(logps)
        log_q = guides.compute_log_q(config, logps, entropies, mask, 0, 10)
        expected.append(
            loss.kl_shaped_rewards(torch.zeros(1), logps, ref, log_q, mask, 0.05).item()
        )
    # Kept as found, not yet bounded: batched float32 against one unpadded sequence;
    # an honest float32 forward bound is far looser, a float64 rerun is the fix.
    assert rewards == pytest.approx(expected, abs=1e-5)
    assert set(logged) == {"kl/ref_k1", "kl/anchor_k1", "q/mean"}


def test_trls_prompt_tokens_are_the_projects(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    problem = "What is the sum of 4 and 5?"
    prompt_ids, _, _ = trainer._tokenize_prompts([trl_sage.prompt_messages(problem)])
    assert list(prompt_ids[0]) == trl_sage.build_prompt_ids(trainer.processing_class, problem)


def test_unsupported_settings_are_refused_in_one_line(tmp_path, capsys):
    args = GRPOConfig(
        output_dir=str(tmp_path), loss_type="cispo", bf16=False, use_cpu=True, report_to="none"
    )
    assert trl_sage.unsupported(args, trl_sage.SageSettings())[0].startswith(
        "loss_type='cispo' is not supported"
    )
    out = ["--out", str(tmp_path)]
    for argv, message in [
        (["--model", "m", "--advantage", "rloo", *out], "--advantage rloo is not available on TRL"),
        (
            ["--model", "m", "--guide", "branch", "--beta", "0", *out],
            "acts only through the KL anchor",
        ),
        (
            ["--model", "m", "--kl-estimator", "k1_return", "--kl", "forward", *out],
            "k1_return needs --kl reverse",
        ),
        (
            [
                "--model",
                "m",
                "--prompts-per-step",
                "3",
                "--rollouts",
                "3",
                "--micro-batch-size",
                "2",
                *out,
            ],
            "must be a multiple of --micro-batch-size x processes",
        ),
        (["--model", "m", "--resume", *out], "holds no checkpoint"),
        (out, "--model"),
        (["--model", "m", "--out", "/proc/runs"], "--out /proc/runs: cannot write in /proc"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            trl_sage.main(argv)
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert stopped.value.code == 2 and message in error, error
    assert not os.listdir(tmp_path), "a refused run left files behind"


def test_shared_flags_have_sage_py_names_and_defaults():
    import dataclasses

    import sage

    def flag_defaults(cls):
        """{flag: default} of a command-line dataclass and of its nested ones (loss, guide)."""
        found = {}
        for f in dataclasses.fields(cls):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            flag = f.metadata.get("flag", f.name)
            if dataclasses.is_dataclass(default):
                found.update(flag_defaults(type(default)))
            elif flag is not None and default is not None:
                found[flag.replace("-", "_")] = default
        return found

    # (sage.py's None defaults are resolved from its --algo preset; TRL has no presets)
    sage_fields = flag_defaults(sage.Config)
    # --model is required here (no demo); --report-to names TRL's trackers, metrics.jsonl is
    # always written
    own = {"model", "report_to"}
    own.add("gpu_memory_utilization")  # sage.py's 0 stands for its device's default, 0.3 on a GPU
    shared = [
        f
        for f in dataclasses.fields(trl_sage.TRLArgs)
        if f.name in sage_fields and f.name not in own
    ]
    assert {
        "dataset",
        "guide",
        "beta",
        "kl_estimator",
        "lr",
        "lora_rank",
        "temperature",
        "min_p",
        "rollouts",
        "prompts_per_step",
        "steps",
        "max_seq_len",
    } <= {f.name for f in shared}
    for f in shared:
        assert f.default == sage_fields[f.name], f.name


# --------------------------------------------------------------------------------------------
# Guard: the private TRL method that trl_sage calls
# --------------------------------------------------------------------------------------------


def test_private_trl_signature_is_the_pinned_one():
    pinned = [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ]
    found = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    assert found[: len(pinned)] == pinned, (
        f"TRL {trl.__version__} changed "
        f"GRPOTrainer._get_per_token_logps_and_entropies{tuple(found)}; trl_sage.py is "
        f"written against TRL {trl_sage.TRL_VERSION} (parameters {tuple(pinned)}, "
        f"returns (logps, entropies, aux_loss)): pin trl=={trl_sage.TRL_VERSION} "
        "or update SageGRPOTrainer.compute_loss and kl_return"
    )
    public = list(inspect.signature(GRPOTrainer.compute_loss).parameters)
    assert public == ["self", "model", "inputs", "return_outputs", "num_items_in_batch"], (
        f"TRL {trl.__version__}: GRPOTrainer.compute_loss{tuple(public)} is not the hook "
        f"trl_sage overrides (written against TRL {trl_sage.TRL_VERSION})"
    )


# --------------------------------------------------------------------------------------------
# End to end: the CLI as a subprocess (transformers generation on CPU)
# --------------------------------------------------------------------------------------------

TINY = [
    "--prompts-per-step",
    "2",
    "--rollouts",
    "2",
    "--max-seq-len",
    "96",
    "--max-prompt-len",
    "80",
    "--save-every",
    "1",
    "--lr",
    "1e-3",
    "--warmup-ratio",
    "0",
]


def subprocess_env():
    trl_root = os.path.dirname(os.path.dirname(os.path.abspath(trl.__file__)))
    path = os.pathsep.join(p for p in (REPO, trl_root, os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture
def train_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a} + {b}?", "solution": str(a + b)}) + "\n"
            for a in range(3)
            for b in range(3)
        )
    )
    return str(path)


# The guide's clamp as the metrics see it: q = exp(log q) of float32(clamp(q, 0.6, 1.4)). The
# clamp is exact (float32(0.6) = 0.6000000238..., float32(1.4) = 1.3999999761...); log then exp
# err by at most |log q| u + u < gamma_2 relatively (float32, the coarsest dtype the runs use).
Q_LOW = torch.tensor(0.6).item() * (1 - bounds.gamma(2, torch.float32))
Q_HIGH = torch.tensor(1.4).item() * (1 + bounds.gamma(2, torch.float32))


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def check_run(result, run_dir, steps, guide_in_loss=True):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = [m for m in read_metrics(run_dir) if "train_runtime" not in m]
    assert [m["step"] for m in records] == list(range(steps))
    for record in records:
        for key in ("loss", "reward", "entropy", "clip_ratio/region", "grad_norm", "q/mean"):
            assert key in record, key
        if guide_in_loss:
            # the mean's 1e-6 slack: float32 sum rounding of a few hundred q <= 1.4 (NOT YET a
            # bound: the record does not give the token count n for gamma_n * 1.4)
            assert Q_LOW <= record["q/min"] <= record["q/mean"] + 1e-6
            assert record["q/mean"] <= record["q/max"] + 1e-6 and record["q/max"] <= Q_HIGH
    assert os.path.isdir(os.path.join(run_dir, f"checkpoint-{steps}"))
    assert os.path.exists(os.path.join(run_dir, "final", "adapter_model.safetensors"))


@pytest.mark.slow
def test_two_step_cli_run(tiny_model_dir, train_file, tmp_path):
    """The branch guide in the loss, two steps as a process (the token guide in the return runs
    as one in the resume test below)."""
    argv = [
        *TINY,
        "--steps",
        "2",
        "--model",
        tiny_model_dir,
        "--dataset",
        train_file,
        "--guide",
        "branch",
        "--micro-batch-size",
        "2",
        "--out",
        str(tmp_path),
        "--name",
        "run",
    ]
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "extras.trl_sage", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=600,
    )
    check_run(result, tmp_path / "run", steps=2)


@pytest.mark.slow
def test_one_step_under_accelerate_launch_with_two_cpu_processes(
    tiny_model_dir, train_file, tmp_path
):
    # `accelerate launch --cpu --num_processes 2` starts ONE process (accelerate's --cpu launcher is
    # single-process unless mpirun is used); --multi_gpu starts two through torchrun, and on a
    # machine without CUDA, use_cpu=True makes them a MULTI_CPU group on gloo. On a GPU node the
    # GPUs are hidden from both processes, so they stay CPU processes on gloo there too (two NCCL
    # ranks on one GPU would fail).
    launch = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "29517",
    ]
    # 2 prompts x 2 rollouts = 4 completions: 1 per process per micro-batch, 2 accumulated
    argv = [
        *TINY,
        "--steps",
        "1",
        "--model",
        tiny_model_dir,
        "--dataset",
        train_file,
        "--guide",
        "branch",
        "--micro-batch-size",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "run",
    ]
    result = subprocess.run(
        [*launch, "-m", "extras.trl_sage", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""},
        timeout=600,
    )
    check_run(result, tmp_path / "run", steps=1)
    assert "trl_sage: 2 processes x micro-batch 1 x 2 accumulation steps" in result.stdout


@pytest.mark.slow
@pytest.mark.cpu_only("a resumed run repeats the CPU's float32 arithmetic exactly")
def test_a_resumed_run_continues_from_its_checkpoint(tiny_model_dir, train_file, tmp_path, capsys):
    """One step, then --resume to two, with the token guide in the return (k1_return, logged by
    the reward hook) and Dr. GRPO's advantages and aggregation."""
    argv = [
        *TINY,
        "--model",
        tiny_model_dir,
        "--dataset",
        train_file,
        "--guide",
        "token",
        "--kl-estimator",
        "k1_return",
        "--advantage",
        "dr_grpo",
        "--loss-agg",
        "dr_grpo",
        "--micro-batch-size",
        "2",
        "--out",
        str(tmp_path),
        "--name",
        "run",
    ]
    command = [sys.executable, "-W", "ignore", "-m", "extras.trl_sage"]
    first = subprocess.run(
        [*command, *argv, "--steps", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    with pytest.raises(SystemExit) as again:  # refused before anything loads: in-process
        trl_sage.main([*argv, "--steps", "2"])
    assert again.value.code == 2 and "pass --resume" in capsys.readouterr().err.splitlines()[-1]
    resumed = subprocess.run(
        [*command, *argv, "--steps", "2", "--resume"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=600,
    )
    check_run(resumed, tmp_path / "run", steps=2, guide_in_loss=False)
    first_step = read_metrics(tmp_path / "run")[0]
    assert "kl/ref_k1" in first_step and "rewards/kl_return/mean" in first_step
