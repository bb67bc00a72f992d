"""Checks of sage.py's flags before anything loads: one line naming the flag and the fix.

Every number is checked for being finite and in its range, every local path for existing, the
reward for being importable, and the combinations that cannot run are refused, all before a
model, a dataset or an engine is touched (argparse's ``error``: usage, one line, exit 2).
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Sequence

from machinery.task import LOCAL_FORMATS, SOLUTION_FORMATS

# (flag, lowest, highest, what it must be): None is unbounded; the bounds are inclusive unless
# the text says otherwise (checked by ``in_range``).
POSITIVE, AT_LEAST_ONE, NON_NEGATIVE = "> 0", ">= 1", ">= 0"


def numeric_rules(config) -> list[tuple[str, float, str]]:
    """(flag, value, rule) for every number of a sage.py run; rule is one of the texts above or
    an interval such as "in [0, 1)"."""
    extras = config.extras or {}
    sft, refill = extras.get("sft"), extras.get("dynamic_sampling")
    memory = extras.get("memory")
    rules = [
        ("--max-train-samples", config.max_train_samples, NON_NEGATIVE),
        ("--steps", config.steps, AT_LEAST_ONE),
        ("--prompts-per-step", config.prompts_per_step, AT_LEAST_ONE),
        ("--rollouts", config.rollouts, ">= 2"),
        ("--micro-batch-size", config.micro_batch_size, AT_LEAST_ONE),
        ("--ppo-epochs", config.ppo_epochs, AT_LEAST_ONE),
        ("--lr", config.lr, POSITIVE),
        ("--weight-decay", config.weight_decay, NON_NEGATIVE),
        ("--warmup-ratio", config.warmup_ratio, "in [0, 1)"),
        ("--max-grad-norm", config.max_grad_norm, POSITIVE),
        ("--lora-rank", config.lora_rank, AT_LEAST_ONE),
        ("--lora-alpha", config.lora_alpha, POSITIVE),
        ("--max-seq-len", config.max_seq_len, ">= 2"),
        ("--max-prompt-len", config.max_prompt_len, AT_LEAST_ONE),
        ("--temperature", config.temperature, POSITIVE),
        ("--min-p", config.min_p, "in [0, 1)"),
        ("--top-p", config.top_p, "in (0, 1]"),
        ("--top-k", config.top_k, ">= -1"),
        ("--seed", config.seed, NON_NEGATIVE),
        ("--stop-after", config.stop_after, NON_NEGATIVE),
        ("--gpu-memory-utilization", config.gpu_memory_utilization, "in [0, 1)"),
        ("--save-every", config.save_every, AT_LEAST_ONE),
        ("--zero-reward-warning", config.zero_reward_warning, AT_LEAST_ONE),
        ("--beta", config.loss.beta, NON_NEGATIVE),
        ("--eps-low", config.loss.eps_low, "in [0, 1)"),
        ("--eps-high", config.loss.eps_high, NON_NEGATIVE),
        ("--tis-cap", config.loss.tis_cap, NON_NEGATIVE),
        ("--tau", config.guide.tau, NON_NEGATIVE),
        ("--ratio", config.guide.ratio, NON_NEGATIVE),
        ("--q-min", config.guide.q_min, "in (0, 1]"),
        ("--q-max", config.guide.q_max, ">= 1"),
        ("--eval-every", config.eval.eval_every, NON_NEGATIVE),
        ("--eval-n", config.eval.eval_n, AT_LEAST_ONE),
        ("--eval-temperature", config.eval.eval_temperature, POSITIVE),
        ("--eval-top-p", config.eval.eval_top_p, "in (0, 1]"),
    ]
    if sft is not None:
        rules += [
            ("--sft-max-samples", sft.sft_max_samples, NON_NEGATIVE),
            ("--sft-max-tokens", sft.sft_max_tokens, NON_NEGATIVE),
            ("--sft-epochs", sft.sft_epochs, AT_LEAST_ONE),
            ("--sft-lr", sft.sft_lr, POSITIVE),
            ("--sft-batch-size", sft.sft_batch_size, AT_LEAST_ONE),
            ("--sft-warmup-steps", sft.sft_warmup_steps, NON_NEGATIVE),
        ]
    if refill is not None:
        rules += [
            ("--max-refill-rounds", refill.max_refill_rounds, NON_NEGATIVE),
            ("--overlong-buffer", refill.overlong_buffer, NON_NEGATIVE),
        ]
    if memory is not None:
        rules += [("--gpu-gb", memory.gpu_gb, NON_NEGATIVE)]
    return rules


def in_range(value: float, rule: str) -> bool:
    """Whether a finite ``value`` satisfies ``rule``.

    >>> in_range(0.0, "in [0, 1)"), in_range(1.0, "in [0, 1)"), in_range(-1, ">= -1")
    (True, False, True)
    """
    if rule.startswith("in "):
        low, high = (float(bound) for bound in rule[4:-1].split(","))
        above = value >= low if rule[3] == "[" else value > low
        below = value <= high if rule[-1] == "]" else value < high
        return above and below
    operator, bound = rule.split()
    return value > float(bound) if operator == ">" else value >= float(bound)


def number_problem(flag: str, value: float, rule: str) -> str | None:
    """The one-line complaint about ``flag``'s value, or None.

    >>> number_problem("--lr", float("nan"), "> 0")
    '--lr nan: must be a finite number > 0'
    """
    if not math.isfinite(value) or not in_range(value, rule):
        return f"{flag} {value}: must be a finite number {rule}"
    return None


def looks_local(path: str) -> bool:
    """A path meant for this machine rather than a hub name ("org/name").

    >>> looks_local("Qwen/Qwen2.5-Math-7B"), looks_local("./runs/sft_model"), looks_local("x.jsonl")
    (False, True, True)
    """
    local_start = path.startswith(("/", ".", "~")) or path.count("/") > 1
    return local_start or os.path.splitext(path)[1].lower() in LOCAL_FORMATS or path.endswith(".py")


def path_problems(config) -> list[str]:
    """Local paths given to sage.py that do not exist (a hub name is checked when it loads)."""
    sft = (config.extras or {}).get("sft")
    paths = [("--model", config.model, "a local model directory or a hub name")]
    paths.append(("--dataset", config.dataset, "a local data file or a hub dataset"))
    if sft is not None and sft.sft_dataset:
        paths.append(("--sft-dataset", sft.sft_dataset, "a local data file or a hub dataset"))
    for entry in filter(None, (p.strip() for p in config.eval.eval_benchmarks.split(","))):
        if os.path.splitext(entry)[1].lower() in LOCAL_FORMATS:
            paths.append(("--eval-benchmarks", entry, "benchmark names or local files"))
    return [
        f"{flag} {path}: no such file or directory; pass {what}"
        for flag, path, what in paths
        if path and looks_local(path) and not os.path.exists(os.path.expanduser(path))
    ]


def check_config(config, presets: dict, backends: Sequence[str], error) -> None:
    """Call ``error(message)`` for the first setting of ``config`` (a ``sage.Config``) that
    cannot run; ``presets`` are the --algo names, ``backends`` the --backend ones."""
    if config.algo not in presets:
        error(f"unknown --algo {config.algo!r}: choose one of {', '.join(presets)}")
    for flag, value, rule in numeric_rules(config):
        if (problem := number_problem(flag, value, rule)) is not None:
            error(problem)
    guide, kl, beta = config.guide.name, config.loss.kl, config.loss.beta
    extras = config.extras or {}
    sft, refill = extras.get("sft"), extras.get("dynamic_sampling")
    budget = config.max_seq_len - config.max_prompt_len
    checks = [
        (
            bool(config.model),
            "--model is required: a hub name or a local model directory "
            "(for the CPU demo run `make demo`)",
        ),
        (
            config.backend in backends,
            f"unknown --backend {config.backend!r}: choose one of {', '.join(backends)}",
        ),
        (
            config.max_prompt_len < config.max_seq_len,
            "--max-prompt-len must be below --max-seq-len",
        ),
        (
            not (guide != "none" and (kl == "none" or beta == 0)),
            f"--guide {guide} acts only through the KL anchor: use --kl reverse with --beta > 0",
        ),
        (
            config.loss.kl_estimator != "k1_return" or kl == "reverse",
            "--kl-estimator k1_return needs --kl reverse",
        ),
        (sft is None or not sft.sft_only or sft.sft_dataset, "--sft-only needs --sft-dataset"),
        (
            config.eval.eval_every <= 0 or bool(config.eval.eval_benchmarks),
            "--eval-every needs --eval-benchmarks (names such as aime, or local .jsonl files with "
            "problem and answer fields)",
        ),
        (
            config.eval.eval_solution_format in SOLUTION_FORMATS,
            f"unknown --eval-solution-format {config.eval.eval_solution_format!r}: choose one of "
            f"{', '.join(SOLUTION_FORMATS)}",
        ),
        (
            not config.eval.eval_solution_key or (config.top_p == 1.0 and config.top_k <= 0),
            "--eval-solution-key: the support probe replays the sampler's temperature and min-p, "
            "not top-p or top-k; train with --top-p 1.0 --top-k -1 (the paper's) to probe it",
        ),
        (
            refill is None or refill.overlong_buffer < budget,
            f"--overlong-buffer must be below the completion budget (--max-seq-len minus "
            f"--max-prompt-len = {budget})",
        ),
    ]
    for ok, message in checks:
        if not ok:
            error(message)
    for problem in path_problems(config):
        error(problem)
    check_reward(config.reward, error)
    check_device(error)
    if (problem := torch_build_problem()) is not None:
        error(problem)


def nvidia_gpu_visible() -> bool:
    """An NVIDIA GPU's device file is there (its driver is loaded), unless CUDA_VISIBLE_DEVICES
    hides every GPU on purpose."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def torch_build_problem() -> str | None:
    """A CPU build of torch on a machine with an NVIDIA GPU (a .venv made on a CPU login node)
    would train or sample a 7B on the CPU in float32 without a word: the one line that refuses
    it, else None. sage.py, evaluate.py, extras/trl_sage.py and bench/gpu_step.py all ask here."""
    import torch

    if torch.version.cuda is None and nvidia_gpu_visible():
        return (
            f"torch {torch.__version__} is a CPU build but this machine has an NVIDIA GPU (the "
            "work would run on the CPU in float32): run `make clean install` on this node"
        )
    return None


def check_device(error) -> None:
    """A CUDA build of torch that sees no GPU (a driver too old for it, say) would train a 7B on
    the CPU without a word: stop instead (CUDA_VISIBLE_DEVICES="" hides the GPUs on purpose)."""
    import torch

    if torch.version.cuda and not torch.cuda.is_available():
        if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
            error(
                f"torch {torch.__version__} is a CUDA build but sees no GPU: vLLM 0.32's CUDA 13 "
                "build needs NVIDIA driver >= 580 (see nvidia-smi); to run on the CPU, set "
                'CUDA_VISIBLE_DEVICES=""'
            )


def check_reward(spec: str, error) -> None:
    """Import --reward now (its module, its signature), so a typo costs no model load."""
    from machinery.task import RewardError, load_reward_function

    try:
        load_reward_function(spec)
    except RewardError as problem:
        error(str(problem))


def check_run_dir(run_dir: str, config) -> None:
    """Before anything loads, and before the memory plan (these are cheaper and say more): a
    checkpoint is continued only with --resume, --resume needs one, and the weights of a
    --full-finetune model must fit the device."""
    from machinery import models, runs

    if not config.resume and os.path.exists(runs.checkpoint_dir(run_dir)):
        raise SystemExit(
            f"error: {run_dir} already holds a checkpoint; pass --resume to continue it or "
            "--name for a new run"
        )
    if config.resume and not runs.has_checkpoint(run_dir):
        raise SystemExit(
            f"error: --resume but no checkpoint in {runs.checkpoint_dir(run_dir)}; drop --resume "
            "to start fresh"
        )
    if config.full_finetune:
        anchored = config.loss.kl != "none" and config.loss.beta > 0
        models.check_full_finetune_fits(
            config.model, with_reference=anchored, with_engine=config.backend == "vllm"
        )


def first_problem(rules: list[tuple[str, float | None, str]], paths: list[tuple[str, str]]):
    """The first complaint about numbers (flag, value or None for unset, rule) or local paths
    (flag, path), else None."""
    for flag, value, rule in rules:
        if value is not None and (problem := number_problem(flag, value, rule)) is not None:
            return problem
    for flag, path in paths:
        if path and looks_local(path) and not os.path.exists(os.path.expanduser(path)):
            return f"{flag} {path}: no such file or directory"
    return None


def check_eval_args(args) -> str | None:
    """evaluate.py's flags (an ``EvalArgs``), then the torch build, before any model or
    benchmark loads."""
    try:
        seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        return f"--seeds {args.seeds}: write comma-separated integers such as 0,1,2"
    rules = [
        ("--n", args.n, AT_LEAST_ONE),
        ("--temperature", args.temperature, NON_NEGATIVE),
        ("--top-p", args.top_p, "in (0, 1]"),
        ("--top-k", args.top_k, ">= -1"),
        ("--min-p", args.min_p, "in [0, 1)"),
        ("--max-tokens", args.max_tokens, AT_LEAST_ONE),
        ("--max-model-len", args.max_model_len, ">= 2"),
        ("--limit", args.limit, AT_LEAST_ONE),
        ("--gpu-memory-utilization", args.gpu_memory_utilization, "in (0, 1]"),
        ("--grade-timeout", args.grade_timeout, POSITIVE),
        ("--grading-workers", args.grading_workers, AT_LEAST_ONE),
        *(("--seeds", seed, NON_NEGATIVE) for seed in seeds),
    ]
    if args.solution_format not in SOLUTION_FORMATS:
        choices = ", ".join(SOLUTION_FORMATS)
        return f"unknown --solution-format {args.solution_format!r}: choose one of {choices}"
    if args.solution_key and not (args.top_p == 1.0 and args.top_k <= 0):
        return (
            f"--solution-key with --top-p {args.top_p} --top-k {args.top_k}: the support probe "
            "replays temperature and min-p, not top-p or top-k; pass --top-p 1.0 --top-k -1 so "
            "that it measures the distribution the sampler draws from"
        )
    files = [p.strip() for p in args.benchmarks.split(",") if p.strip()]
    local = [("--benchmarks", p) for p in files if os.path.splitext(p)[1].lower() in LOCAL_FORMATS]
    paths = [("--model", args.model), ("--adapter", args.adapter or ""), *local]
    return first_problem(rules, paths) or torch_build_problem()


def check_trl_args(args, sage_rules: dict[str, str]) -> str | None:
    """trl_sage's flags (a ``TRLArgs``): the flags it shares with sage.py take sage.py's ranges
    (``sage_rules``: flag -> rule), its own take theirs; then paths, then the torch build."""
    own = {
        "--num-iterations": AT_LEAST_ONE,
        "--vllm-server-port": "in [1, 65535]",
        "--vllm-tensor-parallel-size": AT_LEAST_ONE,
        "--gpu-memory-utilization": "in (0, 1]",
    }
    rules = []
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        rule = own.get(flag) or sage_rules.get(flag)
        if rule is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            rules.append((flag, value, rule))
    paths = [("--model", args.model), ("--dataset", args.dataset)]
    if (problem := first_problem(rules, paths)) is not None:
        return problem
    if args.max_prompt_len >= args.max_seq_len:
        return "--max-prompt-len must be below --max-seq-len"
    return torch_build_problem()
