"""Does the guide widen support? GRPO against SAGE on the CPU demo, with training seeds as the unit
of evidence (the paper's Figure 3 question, on a laptop).

    python -m extras.compare                          # the study: 5 seeds x 5 arms, ~1 hour
    python -m extras.compare --seeds 1 --out runs/compare    # make compare: one seed, quick
    python -m extras.compare --seeds 2 --steps 20 --eval-samples 8    # a smoke test

For each training seed s, the demo's SFT start is made afresh from s (its random init and its SFT
examples), on one task split shared by every seed, so the held-out problems are the same for all.
Each start is its own seed's: RL's outcome depends on where it starts (the demo's SFT is sensitive
to the CPU's float32 rounding), and an interval over seeds should cover that too; the arms of one
seed share its start, so their paired differences do not. Then every arm trains from that start
with seed s, and evaluate.py samples ``--eval-samples`` completions per held-out problem (the same
sampling seed for every arm) for pass@k, k = 1, 2, 4, ... The arms (``ARMS``; any subset by
``--arms``, more by ``--arm NAME='flags'``):

    grpo                  GRPO with its reverse-KL anchor (no guide)
    grpo_no_kl            GRPO without KL: the support-narrowing baseline
    branch_k3             GRPO + Branch with k3, the paper's estimator
    branch_k1_return      GRPO + Branch with k1 in the return, the estimator that realizes Eq. 4
    branch_k1_return_ref  the same with q from pi_ref's entropies (--guide-entropy reference):
                          Theorem 4.3's q: toy/ predicts it lifts y2 and the policy's q does not

The k1_return arms use RLOO's advantage (GRPO's std would rescale the KL term they carry).
<out>/summary.json holds per arm the per-seed pass@k, their mean with a 95% Student t interval
over seeds, and each arm's difference from GRPO paired by seed with its interval; passk.png draws
the means with bands and the paired differences. Every stage is a subprocess of the repository's
own CLIs, and each writes its result atomically: a killed study run again continues where it
stopped (a half-trained arm resumes from its checkpoint; finished arms are not redone).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from machinery.runs import SUBPROCESS_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {
    "grpo": ["--guide", "none"],
    "grpo_no_kl": ["--guide", "none", "--kl", "none"],
    "branch_k3": ["--guide", "branch", "--kl-estimator", "k3"],
    "branch_k1_return": ["--guide", "branch", "--kl-estimator", "k1_return", "--advantage", "rloo"],
    "branch_k1_return_ref": [
        *["--guide", "branch", "--kl-estimator", "k1_return", "--advantage", "rloo"],
        *["--guide-entropy", "reference"],
    ],
}
BASELINE = "grpo"
TASK_SEED = 3407  # the held-out split every seed shares (the demo's own)


def run(command: list[str]) -> None:
    """A stage as a subprocess; its failure ends the study with its last lines."""
    result = subprocess.run(
        [sys.executable, *command], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True
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
        sizes = ["--demo-eval-problems", str(args.demo_eval_problems)]
        sizes += ["--demo-sft-examples", str(args.demo_sft_examples)]
        run(
            ["-m", "extras.demo", "--out", seed_dir, "--name", "sft", "--seed", str(seed), *sizes]
            + ["--demo-task-seed", str(TASK_SEED), "--sft-only"]
        )
    return files


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
        + flags
        + (["--resume"] if resume else [])
    )
    return adapter


def evaluate(files: dict, adapter: str | None, n: int, out: str) -> None:
    """pass@k with n samples per held-out problem, sampled as in training (temperature 1)."""
    command = ["evaluate.py", "--model", files["model"], "--benchmarks", files["held_out"]]
    command += ["--n", str(n), "--seeds", "0", "--temperature", "1.0", "--top-p", "1.0"]
    command += ["--max-tokens", "64", "--max-model-len", "640", "--gpu-memory-utilization", "0.2"]
    run(command + ["--out", out, "--no-progress"] + (["--adapter", adapter] if adapter else []))


def pass_at_k_of(path: str) -> dict[str, float]:
    """{"pass@k": value} of an evaluate.py results file (its one benchmark, its one seed)."""
    with open(path) as handle:
        entry = next(iter(json.load(handle)["benchmarks"].values()))["pass_at_k"]
    return {f"pass@{k}": entry[k]["mean"] for k in sorted(entry, key=int)}


# ---- 2. The statistics: means and intervals over seeds, differences paired by seed -------------


def interval(values: list[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean and its Student t interval over seeds (none from one seed).

    >>> interval([0.5, 0.6, 0.7])["mean"], round(interval([0.5, 0.6, 0.7])["half_width"], 4)
    (0.6, 0.2484)
    """
    import numpy as np
    from scipy import stats

    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    if len(values) < 2:
        return {"mean": mean, "low": None, "high": None, "half_width": None}
    half = float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * stats.sem(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "half_width": half}


def summarize(per_seed: dict[str, dict[str, dict[str, float]]], baseline: str) -> dict:
    """From {arm: {seed: {"pass@k": value}}}: per arm, the per-seed values, the mean and interval
    per k, and the difference from ``baseline`` paired by seed (the seeds both finished)."""
    summary = {}
    for arm, seeds in per_seed.items():
        ks = list(next(iter(seeds.values())))
        entry = {"per_seed": seeds, "pass_at_k": {}}
        for k in ks:
            entry["pass_at_k"][k] = interval([values[k] for values in seeds.values()])
        if arm != baseline and baseline in per_seed:
            shared = [s for s in seeds if s in per_seed[baseline]]
            entry["minus_" + baseline] = {
                k: {
                    **interval([seeds[s][k] - per_seed[baseline][s][k] for s in shared]),
                    "seeds": len(shared),
                }
                for k in ks
            }
        summary[arm] = entry
    return summary


def distinguishable(summary: dict, baseline: str) -> list[str]:
    """'arm pass@k: +d [low, high]' for each paired difference whose interval excludes zero."""
    found = []
    for arm, entry in summary.items():
        for k, diff in entry.get("minus_" + baseline, {}).items():
            if diff["low"] is not None and (diff["low"] > 0 or diff["high"] < 0):
                found.append(
                    f"{arm} {k}: {diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]"
                )
    return found


def format_table(summary: dict, ks: list[str]) -> str:
    """One row per arm: mean [95% interval] at each k in ``ks``."""
    lines = [f"{'':22}" + "".join(f"{k:>22}" for k in ks)]
    for arm, entry in summary.items():
        cells = []
        for k in ks:
            value = entry["pass_at_k"][k]
            bounds = "" if value["low"] is None else f" [{value['low']:.2f},{value['high']:.2f}]"
            cells.append(f"{value['mean']:.3f}{bounds}")
        lines.append(f"{arm:22}" + "".join(f"{cell:>22}" for cell in cells))
    return "\n".join(lines)


# ---- 3. The figure: means with bands, and the paired differences -------------------------------


def plot(summary: dict, baseline: str, out: str) -> None:
    """Left: mean pass@k against k with its 95% band, per arm. Right: each arm minus the baseline,
    paired by seed, with its band; zero is no difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for index, (arm, entry) in enumerate(summary.items()):
        ks, color = [int(k.split("@")[1]) for k in entry["pass_at_k"]], f"C{index}"  # one per arm
        for axis, values in ((left, entry["pass_at_k"]), (right, entry.get("minus_" + baseline))):
            if not values:
                continue
            means = [v["mean"] for v in values.values()]
            axis.plot(ks, means, marker="o", markersize=3, label=arm, color=color)
            if all(v["low"] is not None for v in values.values()):
                lows, highs = (
                    [v["low"] for v in values.values()],
                    [v["high"] for v in values.values()],
                )
                axis.fill_between(ks, lows, highs, alpha=0.15, color=color)
    right.axhline(0.0, color="black", linewidth=0.8)
    titles = {
        left: "pass@k, mean over seeds (95% band)",
        right: f"paired difference from {baseline}",
    }
    for axis, title in titles.items():
        axis.set_xscale("log", base=2)
        axis.set_xlabel("k")
        axis.set_title(title, fontsize=10)
    left.legend(fontsize=8)
    fig.tight_layout()
    temporary = out + ".tmp.png"
    fig.savefig(temporary, dpi=120)
    plt.close(fig)
    os.replace(temporary, out)


# ---- 4. The study ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/study", help="directory of the study (resumable)")
    parser.add_argument(
        "--seeds", type=int, default=5, help="training seeds (the unit of evidence)"
    )
    parser.add_argument("--seed", type=int, default=3407, help="the first seed; then +1, +2, ...")
    parser.add_argument("--steps", type=int, default=200, help="RL steps of each arm")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoints (for resuming)")
    parser.add_argument("--eval-samples", type=int, default=64, help="samples per held-out problem")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)}")
    parser.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME='FLAGS'",
        help="an arm of your own: its name and its sage.py flags",
    )
    parser.add_argument("--demo-eval-problems", type=int, default=100, help="held-out problems")
    parser.add_argument("--demo-sft-examples", type=int, default=2400, help="SFT examples")
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
    numbers = (args.seeds, args.steps, args.eval_samples, args.save_every, args.demo_eval_problems)
    if not arms or min(numbers) < 1:
        parser.error("--arms, --seeds, --steps, --eval-samples, --save-every must be at least one")
    return args, arms


def main(argv: list[str] | None = None) -> dict:
    from tqdm import tqdm

    from machinery import runs

    args, arms = parse_args(argv)
    out, started = os.path.abspath(args.out), time.time()
    seeds = [args.seed + i for i in range(args.seeds)]
    units = [(seed, arm) for seed in seeds for arm in ["SFT start", *arms]]
    per_seed: dict[str, dict[str, dict]] = {}
    with tqdm(total=len(units), desc="study", unit="arm") as progress:
        for seed, arm in units:
            seed_dir = os.path.join(out, f"seed-{seed}")
            result = os.path.join(
                seed_dir, "sft_start.json" if arm == "SFT start" else f"{arm}.json"
            )
            progress.set_postfix(seed=seed, arm=arm)
            if not os.path.exists(result):  # (each results file is written atomically)
                files = sft_start(seed_dir, seed, args)
                adapter = (
                    None
                    if arm == "SFT start"
                    else train_arm(seed_dir, seed, arm, arms[arm], files, args)
                )
                evaluate(files, adapter, args.eval_samples, result)
            per_seed.setdefault(arm, {})[str(seed)] = pass_at_k_of(result)
            progress.update(1)
    summary = summarize(per_seed, BASELINE)
    seconds = round(time.time() - started)
    study = {"arms": arms, "seeds": seeds, "steps": args.steps, "seconds": seconds}
    study.update(eval_samples=args.eval_samples, task_seed=TASK_SEED)
    runs.write_json_atomic(os.path.join(out, "summary.json"), {"study": study, **summary})
    plot(summary, BASELINE, os.path.join(out, "passk.png"))
    ks = [k for k in next(iter(summary.values()))["pass_at_k"] if k in ("pass@1", "pass@8")]
    ks.append(list(next(iter(summary.values()))["pass_at_k"])[-1])
    print(format_table(summary, list(dict.fromkeys(ks))))
    for line in distinguishable(summary, BASELINE) or [
        "no difference from grpo excludes zero at 95%"
    ]:
        print(line)
    print(f"[compare] wrote {out}/summary.json and passk.png ({seconds} s)", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
