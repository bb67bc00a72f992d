"""Does the guide widen support? GRPO against SAGE on the CPU demo, with training seeds as the unit
of evidence (the paper's Figure 3 question, on a laptop), measured exactly by the support probe.

    python -m extras.compare                                 # the study (docs/compare.md)
    python -m extras.compare --seeds 1 --out runs/compare    # make compare: one seed, quick
    python -m extras.compare --seeds 2 --steps 20 --eval-samples 8 --demo-sft-examples 400 \
        --jobs 2 --out runs/tiny                             # a tiny study, ~7 minutes

For each training seed s, the demo's SFT start is made afresh from s (its random init and its SFT
examples), on one task split shared by every seed, so the held-out problems are the same for all.
Each start is its own seed's: RL's outcome depends on where it starts (the demo's SFT is sensitive
to the CPU's float32 rounding), and an interval over seeds should cover that too; the arms of one
seed share its start, so their paired differences do not. Then every arm trains from that start
with seed s, and evaluate.py measures each policy (the start's and every arm's) on the held-out
sums twice: the support probe (evaluate.support_probe: log pi(y*|x) of each sum's solution,
teacher-forced at the training temperature and min-p, exact) per group, easy and hard, and pass@k
from ``--eval-samples`` completions per problem (the same sampling seed for every arm). The arms
(``ARMS``; any subset by ``--arms``, more by ``--arm NAME='flags'``; ``--flags`` adds sage.py
flags to every arm, the regime; ``--backend hf`` samples with HF's generate, where vLLM is not
installed):

    grpo                  GRPO with its reverse-KL anchor (no guide)
    grpo_no_kl            GRPO without KL: the support-narrowing baseline
    k1_return             k1 in the return with RLOO, no guide: the k1_return arms' own baseline
    branch_k3             GRPO + Branch with k3, the paper's estimator
    branch_k1_return      GRPO + Branch with k1 in the return, the estimator that realizes Eq. 4
    branch_k1_return_ref  the same with q from pi_ref's entropies (--guide-entropy reference):
                          Theorem 4.3's q: toy/ predicts it lifts y2 and the policy's q does not

The k1_return arms use RLOO's advantage (GRPO's std would rescale the KL term they carry).
<out>/summary.json holds per arm the per-seed measures (pass@k and "<group>/<probe measure>"),
their mean with a 95% Student t interval over seeds, and each arm's difference from GRPO and from
the SFT start, paired by seed, with its interval; passk.png draws the means with bands and the
paired differences, for pass@k and for the hard sums' supp_delta. ``--jobs`` trains that many
seeds at once, the cores split between them (the tiny model gains little from a second thread).
On CUDA each job runs on a GPU of its own (CUDA_VISIBLE_DEVICES): a vLLM engine sizes itself from
the GPU's free memory at start-up, so another job's engine sleeping and waking on the same GPU
would break its sizing. ``--jobs`` above the number of visible GPUs is refused.
Every stage is a subprocess of the repository's own CLIs, and each writes its result atomically:
a killed study run again continues where it stopped (a half-trained arm resumes from its
checkpoint; finished arms are not redone).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import time

import rollout
from machinery import cli
from machinery.runs import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment of a stage run as a subprocess (this study's, bench/'s): vLLM in-process,
# no hub, quiet tokenizers, OpenMP threads that sleep after ~1 ms of spinning (docs/history.md).
SUBPROCESS_ENV = {
    **os.environ,
    "GOMP_SPINCOUNT": "100000",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
ARMS = {
    "grpo": ["--guide", "none"],
    "grpo_no_kl": ["--guide", "none", "--kl", "none"],
    "k1_return": ["--guide", "none", "--kl-estimator", "k1_return", "--advantage", "rloo"],
    "branch_k3": ["--guide", "branch", "--kl-estimator", "k3"],
    "branch_k1_return": ["--guide", "branch", "--kl-estimator", "k1_return", "--advantage", "rloo"],
    "branch_k1_return_ref": [
        *["--guide", "branch", "--kl-estimator", "k1_return", "--advantage", "rloo"],
        *["--guide-entropy", "reference"],
    ],
}
BASELINE = "grpo"
# the support probe's measures per group (evaluate.support_summary), in the order tables show them
PROBE = ("mean_logp_full", "mean_logp", "supp@0.1", "supp@0.01", "supp@0.001", "supp@0.0001")
PROBE += ("outside",)
TASK_SEED = 3407  # the held-out split every seed shares (the demo's own)


def run(command: list[str], threads: int, gpu: str | None = None) -> None:
    """A stage as a subprocess on ``threads`` cores (and on CUDA, on its job's ``gpu`` alone); its
    failure ends the study with its last lines."""
    env = {**SUBPROCESS_ENV, "OMP_NUM_THREADS": str(threads)}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    result = subprocess.run(
        [sys.executable, *command], cwd=REPO, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        stage = " ".join(command[:4])
        raise SystemExit(f"compare: `{stage} ...` failed:\n{result.stderr[-2000:]}")


# ---- 1. The stages of one seed: its SFT start, each arm's training, each evaluation ------------


def sft_start(seed_dir: str, seed: int, args) -> dict[str, str]:
    """The demo's SFT start for this seed (kept if made already), and its task files."""
    run_dir = os.path.join(seed_dir, "sft")
    files = {
        "model": os.path.join(run_dir, "sft_model"),
        "train": os.path.join(run_dir, "train.jsonl"),
        "held_out": os.path.join(run_dir, "demo.jsonl"),
    }
    if not os.path.exists(os.path.join(files["model"], "config.json")):
        run(
            ["-m", "extras.demo", "--out", seed_dir, "--name", "sft", "--seed", str(seed)]
            + ["--demo-task-seed", str(TASK_SEED), "--sft-only", *sft_settings(args)],
            threads=args.threads,
            gpu=args.gpu,
        )
    return files


def sft_settings(args) -> list[str]:
    """The demo's flags that make each seed's SFT start (its size, its noise, its epochs)."""
    return [
        *["--demo-eval-problems", str(args.demo_eval_problems)],
        *["--demo-sft-examples", str(args.demo_sft_examples)],
        *["--demo-sft-noise", str(args.demo_sft_noise)],
        *["--demo-hard-noise", str(args.demo_hard_noise)],
        *["--sft-epochs", str(args.sft_epochs)],
    ]


def train_arm(seed_dir: str, seed: int, arm: str, flags: list[str], files: dict, args) -> str:
    """Train one arm from the seed's start; a half-trained arm resumes from its checkpoint."""
    from extras import demo

    run_dir = os.path.join(seed_dir, arm)
    checkpoint = os.path.join(run_dir, "checkpoint", "trainer_state.json")
    resume = os.path.exists(checkpoint)
    adapter = os.path.join(run_dir, "checkpoint", "model")
    if resume and json.load(open(checkpoint))["step"] >= args.steps:
        return adapter  # trained already, killed before its evaluation
    if os.path.exists(run_dir) and not resume:
        shutil.rmtree(run_dir)  # started, killed before its first checkpoint: start again
    run(
        ["sage.py", *demo.sage_flags(files), "--out", seed_dir, "--name", arm, "--seed", str(seed)]
        + ["--steps", str(args.steps), "--eval-every", "0", "--save-every", str(args.save_every)]
        + ["--backend", args.backend]
        + shlex.split(args.flags)
        + flags
        + (["--resume"] if resume else []),
        threads=args.threads,
        gpu=args.gpu,
    )
    return adapter


def evaluate(files: dict, adapter: str | None, out: str, args) -> None:
    """The support probe of every held-out sum's solution (exact, no samples), and pass@k with n
    samples per held-out problem, both as in training (temperature 1, min-p 0.01, no top-p)."""
    command = [
        *["evaluate.py", "--model", files["model"], "--benchmarks", files["held_out"]],
        *["--solution-key", "working", "--group-key", "difficulty"],
        *["--n", str(args.eval_samples), "--seeds", "0", "--temperature", "1.0", "--top-p", "1.0"],
        *["--min-p", "0.01", "--max-tokens", "64", "--max-model-len", "640"],
        *["--gpu-memory-utilization", "0.2", "--out", out, "--no-progress"],
        *["--backend", args.backend],
    ]
    run(command + (["--adapter", adapter] if adapter else []), threads=args.threads, gpu=args.gpu)


def measures_of(path: str, groups: list[str]) -> dict[str, float]:
    """An evaluate.py results file (its one benchmark, its one seed) as {"pass@k": value}, the
    same per group of problems ({"<group>/pass@k": value}, ``groups`` giving each problem's, in
    the benchmark's order) and {"<group>/<probe measure>": value} for the support probe's groups
    (all, easy, hard)."""
    from evaluate import pass_at_k

    with open(path) as handle:
        results = json.load(handle)
    entry = next(iter(results["benchmarks"].values()))
    passes = entry["pass_at_k"]
    measures = {f"pass@{k}": passes[k]["mean"] for k in sorted(passes, key=int)}
    (seed_entry,) = entry["seeds"].values()
    counts, n = seed_entry["correct"], results["sampling"]["n"]
    for group in dict.fromkeys(groups):
        members = [c for c, g in zip(counts, groups) if g == group]
        for k in sorted(passes, key=int):
            value = sum(pass_at_k(n, c, int(k)) for c in members) / len(members)
            measures[f"{group}/pass@{k}"] = value
    for group, values in entry.get("support", {}).items():
        if isinstance(values, dict):
            measures |= {f"{group}/{key}": value for key, value in values.items() if key in PROBE}
    return measures


# ---- 2. The statistics: means and intervals over seeds, differences paired by seed -------------


def interval(values: list[float | None], confidence: float = 0.95) -> dict[str, float]:
    """Mean and its Student t interval over seeds (none from one seed); None values (a measure
    a seed does not have, such as a mean log-prob with every y* outside the support) are left
    out, and ``seeds`` says how many counted.

    >>> interval([0.5, 0.6, 0.7])["mean"], round(interval([0.5, 0.6, 0.7])["half_width"], 4)
    (0.6, 0.2484)
    """
    import numpy as np
    from scipy import stats

    values = np.asarray([v for v in values if v is not None], dtype=float)
    if len(values) == 0:
        return {"mean": None, "low": None, "high": None, "half_width": None, "seeds": 0}
    mean = float(values.mean())
    if len(values) < 2:
        return {"mean": mean, "low": None, "high": None, "half_width": None, "seeds": 1}
    half = float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * stats.sem(values))
    return {
        "mean": mean,
        "low": mean - half,
        "high": mean + half,
        "half_width": half,
        "seeds": len(values),
    }


# each arm's difference, paired by seed, from these (the key it is stored under)
PAIRED_WITH = {BASELINE: "minus_grpo", "SFT start": "minus_sft_start"}
# and the contrasts among the k1_return arms: the toy's prediction (docs/fixed-points.md) that q
# held at pi_ref's entropies lifts the rare y* and the policy's own q does not, and each guide
# against k1_return without one
CONTRASTS = (
    ("branch_k1_return_ref", "branch_k1_return"),
    ("branch_k1_return", "k1_return"),
    ("branch_k1_return_ref", "k1_return"),
)


def paired_difference(seeds: dict, reference: dict, measure: str) -> dict:
    """The interval of ``measure``'s per-seed difference from ``reference``, over the seeds both
    have (and where both have the measure)."""
    shared = [s for s in seeds if s in reference]
    differences = [
        None
        if seeds[s].get(measure) is None or reference[s].get(measure) is None
        else seeds[s][measure] - reference[s][measure]
        for s in shared
    ]
    return interval(differences)


def summarize(per_seed: dict[str, dict[str, dict[str, float]]]) -> dict:
    """From {arm: {seed: {measure: value}}} (measures: "pass@k" and the probe's
    "<group>/<measure>"): per arm, the per-seed values; the mean and interval of each pass@k
    ("pass_at_k") and of each probe measure ("support"); and the difference from GRPO
    ("minus_grpo") and from the SFT start ("minus_sft_start"), paired by seed."""
    summary = {}
    for arm, seeds in per_seed.items():
        measures = list(dict.fromkeys(m for values in seeds.values() for m in values))
        entry = {"per_seed": seeds, "pass_at_k": {}, "support": {}}
        for measure in measures:
            part = "pass_at_k" if "pass@" in measure else "support"
            entry[part][measure] = interval([values.get(measure) for values in seeds.values()])
        for reference, key in PAIRED_WITH.items():
            if reference in per_seed and arm not in (reference, "SFT start"):
                entry[key] = {
                    measure: paired_difference(seeds, per_seed[reference], measure)
                    for measure in measures
                }
        summary[arm] = entry
    for first, second in CONTRASTS:
        if first in per_seed and second in per_seed:
            measures = list(dict.fromkeys(m for v in per_seed[first].values() for m in v))
            summary.setdefault("contrasts", {})[f"{first} - {second}"] = {
                measure: paired_difference(per_seed[first], per_seed[second], measure)
                for measure in measures
            }
    return summary


def distinguishable(summary: dict) -> list[str]:
    """'arm measure: +d [low, high]' for each difference from GRPO, paired by seed, whose interval
    excludes zero."""
    found = []
    for arm, entry in summary.items():
        for measure, diff in entry.get("minus_grpo", {}).items():
            if diff["low"] is not None and (diff["low"] > 0 or diff["high"] < 0):
                bounds = f"[{diff['low']:+.3f}, {diff['high']:+.3f}]"
                found.append(f"{arm} {measure}: {diff['mean']:+.3f} {bounds}")
    return found


def format_interval(value: dict, sign: str = "") -> str:
    """'mean [low, high]' of an ``interval`` ('-' without a mean; no bounds from one seed).

    >>> format_interval({"mean": 0.25, "low": -0.01, "high": 0.51}, sign="+")
    '+0.250 [-0.01,+0.51]'
    """
    if value.get("mean") is None:
        return "-"
    bounds = (
        "" if value["low"] is None else f" [{value['low']:{sign}.2f},{value['high']:{sign}.2f}]"
    )
    return f"{value['mean']:{sign}.3f}{bounds}"


def format_table(summary: dict, measures: list[str], part: str = "pass_at_k") -> str:
    """One row per arm: mean [95% interval] of each of ``measures`` in ``part`` of its entry
    ("pass_at_k", "support", "minus_grpo" or "minus_sft_start"); arms without it are left out."""
    lines = [f"{'':22}" + "".join(f"{measure:>24}" for measure in measures)]
    for arm, entry in summary.items():
        if part not in entry:
            continue
        sign = "+" if part.startswith("minus_") else ""
        cells = [format_interval(entry[part].get(measure, {}), sign=sign) for measure in measures]
        lines.append(f"{arm:22}" + "".join(f"{cell:>24}" for cell in cells))
    return "\n".join(lines)


# ---- 3. The figure: means with bands, and the paired differences -------------------------------


def plot(summary: dict, out: str) -> None:
    """Top: pass@k against k, each arm's mean with its 95% band over seeds (left) and each arm
    minus GRPO, paired by seed (right). Bottom: the support probe's mean log pi(y*) on the hard
    and the easy problems, the same two ways, one point per arm with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((left, right), (low_left, low_right)) = plt.subplots(2, 2, figsize=(11, 7.5))
    passes = [f"pass@{k}" for k in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    for index, (arm, entry) in enumerate(summary.items()):
        for axis, source in ((left, entry["pass_at_k"]), (right, entry.get("minus_grpo", {}))):
            shown = [m for m in passes if source.get(m, {}).get("mean") is not None]
            if not shown:
                continue
            ks = [int(m.split("@")[1]) for m in shown]
            axis.plot(
                ks,
                [source[m]["mean"] for m in shown],
                marker="o",
                markersize=3,
                label=arm,
                color=f"C{index}",
            )
            if all(source[m]["low"] is not None for m in shown):
                lows, highs = [source[m]["low"] for m in shown], [source[m]["high"] for m in shown]
                axis.fill_between(ks, lows, highs, alpha=0.15, color=f"C{index}")
        for axis, source in ((low_left, entry["support"]), (low_right, entry.get("minus_grpo"))):
            for offset, group in ((-0.12, "hard"), (0.12, "easy")):
                value = (source or {}).get(f"{group}/mean_logp_full", {})
                if value.get("mean") is None:
                    continue
                error = None  # asymmetric error bar: [[below], [above]]
                if value["low"] is not None:
                    error = [[value["mean"] - value["low"]], [value["high"] - value["mean"]]]
                axis.errorbar(
                    index + offset,
                    value["mean"],
                    yerr=error,
                    capsize=3,
                    marker="o" if group == "hard" else "s",
                    color=f"C{index}",
                )
    arms = list(summary)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("k")
    for axis in (low_left, low_right):
        axis.set_xticks(range(len(arms)), arms, rotation=20, fontsize=8)
    for axis in (right, low_right):
        axis.axhline(0.0, color="black", linewidth=0.8)
    left.set_title("pass@k, mean over seeds (95% band)", fontsize=10)
    right.set_title(f"pass@k: paired difference from {BASELINE}", fontsize=10)
    low_left.set_title(
        "mean log pi(y*), hard (o) and easy (s) problems (95% interval)", fontsize=10
    )
    low_right.set_title(f"mean log pi(y*): paired difference from {BASELINE}", fontsize=10)
    left.legend(fontsize=8)
    fig.tight_layout()
    temporary = out + ".tmp.png"
    fig.savefig(temporary, dpi=120)
    plt.close(fig)
    os.replace(temporary, out)


# ---- 4. The study ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--out", default="runs/study", help="directory of the study (resumable)")
    add("--seeds", type=int, default=6, help="training seeds (the unit of evidence)")
    add("--seed", type=int, default=1000, help="the first seed; then +1, +2, ...")
    add("--steps", type=int, default=200, help="RL steps of each arm")
    add("--save-every", type=int, default=50, help="checkpoints (for resuming)")
    add("--eval-samples", type=int, default=32, help="samples per held-out problem (pass@k)")
    add("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)}")
    add("--arm", action="append", default=[], metavar="NAME='FLAGS'", help="an arm of your own")
    add("--flags", default="", help="sage.py flags for every arm (the regime), e.g. '--lr 1e-3'")
    add("--jobs", type=int, default=2, help="seeds trained at once, the CPU's threads split")
    add(
        "--backend",
        default="vllm",
        choices=rollout.BACKENDS,
        help="the sampler of every arm's training and of every evaluation (hf: where vLLM is not "
        "installed)",
    )
    add("--demo-eval-problems", type=int, default=100, help="held-out problems")
    add("--demo-sft-examples", type=int, default=2400, help="SFT examples of each seed's start")
    add("--demo-sft-noise", type=float, default=0.2, help="SFT: wrong easy sums (fraction)")
    add("--demo-hard-noise", type=float, default=0.97, help="SFT: hard sums without the carry")
    add("--sft-epochs", type=int, default=2, help="SFT epochs of each seed's start")
    args = parser.parse_args(argv)
    arms = {}
    for name in filter(None, args.arms.split(",")):
        if name not in ARMS:
            parser.error(f"unknown arm {name!r} in --arms: choose from {', '.join(ARMS)}")
        arms[name] = ARMS[name]
    for spec in args.arm:
        name, _, flags = spec.partition("=")
        if not name or not flags:
            parser.error(f"--arm {spec!r}: write NAME='sage.py flags'")
        arms[name] = shlex.split(flags)
    numbers = (args.seeds, args.steps, args.eval_samples, args.save_every, args.jobs)
    if not arms or min(numbers + (args.demo_eval_problems, args.sft_epochs)) < 1:
        parser.error(
            "--arms, --seeds, --steps, --eval-samples, --save-every, --jobs, "
            "--demo-eval-problems and --sft-epochs must be at least one"
        )
    if not (0.0 <= args.demo_sft_noise <= 1.0 and 0.0 <= args.demo_hard_noise <= 1.0):
        parser.error("--demo-sft-noise and --demo-hard-noise are fractions in [0, 1]")
    if problem := cli.unwritable("--out", args.out):
        parser.error(problem)
    # each stage's threads: the cores split between the seeds trained at once
    args.threads = max(1, (os.cpu_count() or 1) // min(args.jobs, args.seeds))
    args.gpus, args.gpu = visible_gpus(), None  # (each job's GPU is chosen as it starts)
    if args.gpus and min(args.jobs, args.seeds) > len(args.gpus):
        raise SystemExit(
            f"error: --jobs {args.jobs} would put two vLLM engines on one GPU (each sizes itself "
            f"from the free memory the other's sleep and wake change): pass --jobs "
            f"{len(args.gpus)} or fewer, one per visible GPU"
        )
    return args, arms


def visible_gpus() -> list[str]:
    """The CUDA devices a job may be pinned to, as CUDA_VISIBLE_DEVICES names them (none without
    CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = named.split(",") if named else [str(index) for index in range(torch.cuda.device_count())]
    return gpus[: torch.cuda.device_count()]


def run_seed(seed: int, arms: dict, args, out: str, progress) -> dict[str, dict]:
    """One seed's units in order: its SFT start's evaluation, then each arm trained and
    evaluated; finished units (their results files) are not redone. {unit: measures}."""
    seed_dir, measures = os.path.join(out, f"seed-{seed}"), {}
    groups = None  # each held-out problem's group (difficulty), in the benchmark's order
    for arm in ["SFT start", *arms]:
        result = os.path.join(seed_dir, "sft_start.json" if arm == "SFT start" else f"{arm}.json")
        if not os.path.exists(result):  # (each results file is written atomically)
            files = sft_start(seed_dir, seed, args)
            adapter = None
            if arm != "SFT start":
                adapter = train_arm(seed_dir, seed, arm, arms[arm], files, args)
            evaluate(files, adapter, out=result, args=args)
        if groups is None:
            held_out = sft_start(seed_dir, seed, args)["held_out"]  # kept, made already
            groups = [row["difficulty"] for row in read_jsonl(held_out)]
        measures[arm] = measures_of(result, groups)
        progress.update(1)
    return measures


def main(argv: list[str] | None = None) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from machinery import runs

    args, arms = parse_args(argv)
    out, started = os.path.abspath(args.out), time.time()
    seeds = [args.seed + i for i in range(args.seeds)]
    jobs = min(args.jobs, len(seeds))
    free_gpus = queue.Queue()  # on CUDA, a job takes a GPU no running job holds
    for gpu in args.gpus[:jobs] or [None] * jobs:
        free_gpus.put(gpu)

    def run_seed_on_a_free_gpu(seed: int, progress) -> dict[str, dict]:
        gpu = free_gpus.get()
        try:
            pinned = argparse.Namespace(**{**vars(args), "gpu": gpu})
            return run_seed(seed, arms, pinned, out, progress)
        finally:
            free_gpus.put(gpu)

    per_seed: dict[str, dict[str, dict]] = {}
    with tqdm(total=len(seeds) * (1 + len(arms)), desc="study", unit="arm") as progress:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {seed: pool.submit(run_seed_on_a_free_gpu, seed, progress) for seed in seeds}
            for seed, future in futures.items():
                for arm, measures in future.result().items():
                    per_seed.setdefault(arm, {})[str(seed)] = measures
    summary = summarize(per_seed)
    contrasts = summary.pop("contrasts", {})
    seconds = round(time.time() - started)
    study = {"arms": arms, "seeds": seeds, "steps": args.steps, "seconds": seconds}
    study.update(flags=args.flags, jobs=args.jobs, eval_samples=args.eval_samples)
    study.update(backend=args.backend)
    study.update(task_seed=TASK_SEED, sft=sft_settings(args))
    runs.write_json_atomic(
        os.path.join(out, "summary.json"), {"study": study, **summary, "contrasts": contrasts}
    )
    plot(summary, os.path.join(out, "passk.png"))
    shown = headline_passes(summary)
    print(format_table(summary, shown))
    per_group = [f"{group}/{k}" for group in ("hard", "easy") for k in shown]
    print(format_table(summary, per_group))
    probe = ["hard/mean_logp_full", "hard/supp@0.01", "hard/supp@0.001", "hard/outside"]
    print(format_table(summary, probe, part="support"))
    print(format_table(summary, probe, part="minus_sft_start"))
    print(format_table(summary, probe, part="minus_grpo"))
    for line in distinguishable(summary) or ["no difference from grpo excludes zero at 95%"]:
        print(line)
    for name, differences in contrasts.items():
        print(f"{name}, paired by seed:")
        for measure in probe:
            print(f"  {measure}: {format_interval(differences[measure], sign='+')}")
    print(f"[compare] wrote {out}/summary.json and passk.png ({seconds} s)", file=sys.stderr)
    return summary


def headline_passes(summary: dict) -> list[str]:
    """The pass@k columns of the printed tables: pass@1, pass@8 and the largest k, over every
    problem (a group's, such as hard/pass@32, has its own table).

    >>> arm = {"pass_at_k": dict.fromkeys(["pass@1", "pass@32", "easy/pass@32", "hard/pass@32"])}
    >>> headline_passes({"grpo": arm})
    ['pass@1', 'pass@32']
    """
    passes = [k for k in next(iter(summary.values()))["pass_at_k"] if "/" not in k]
    return [k for k in dict.fromkeys(["pass@1", "pass@8", passes[-1]]) if k in passes]


if __name__ == "__main__":
    main()
