"""GRPO against SAGE on the CPU demo: the paper's pass@k picture (Figure 3), on a laptop.

From one shared SFT start of the demo (``python sage.py --sft-only``: a tiny model that forgets
the carry on most hard sums, so their right answer is rare, the paper's y2), three variants train
with the same seed, steps and settings:

    grpo              --guide none                 plain GRPO with its reverse-KL anchor
    branch_k3         --guide branch               GRPO + Branch with k3, the paper's estimator
    branch_k1_return  --guide branch --kl-estimator k1_return --advantage rloo
                                                   GRPO + Branch with the estimator that realizes
                                                   Eq. 4 (docs/fixed-points.md), with RLOO's
                                                   advantage (GRPO's std would rescale the KL term)

Then evaluate.py samples n = 64 completions per held-out problem from each (and from the SFT
start), at the training temperature, and computes pass@k for k = 1, 2, 4, ..., 64 with standard
errors. Writes ``runs/compare/summary.json`` ({variant: {"pass@1": ..., "pass@64": ..., ...}}),
``runs/compare/passk.png`` (the curves with error bars) and prints the table. Every stage is a
subprocess of the repository's own CLIs (one vLLM engine per process); nothing is re-implemented.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import analysis
import demo
import runs

REPO = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {
    "grpo": ["--guide", "none"],
    "branch_k3": ["--guide", "branch", "--kl-estimator", "k3"],
    "branch_k1_return": ["--guide", "branch", "--kl-estimator", "k1_return", "--advantage", "rloo"],
}
ENV = {**os.environ, "GOMP_SPINCOUNT": "100000", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def run(command: list[str]) -> None:
    """A stage as a subprocess; its failure ends the comparison with its last lines."""
    result = subprocess.run([sys.executable, *command], cwd=REPO, env=ENV, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"compare.py: `{' '.join(command[:4])} ...` failed:\n{result.stderr[-2000:]}")


def held_out_file(out: str, seed: int, num_held_out: int) -> str:
    """The demo's held-out problems as a benchmark file for evaluate.py."""
    _, held_out = demo.demo_problems(seed, num_held_out)
    path = os.path.join(out, "held_out.jsonl")
    runs.write_jsonl_atomic(path, [{"problem": p["problem"], "answer": p["answer"]} for p in held_out])
    return path


def evaluate(sft_model: str, adapter: str | None, benchmark: str, n: int, out: str) -> None:
    """pass@k with n samples per problem, sampled as in training (temperature 1, top-p 1)."""
    command = ["evaluate.py", "--model", sft_model, "--benchmarks", benchmark, "--n", str(n), "--seeds", "0",
               "--temperature", "1.0", "--top-p", "1.0", "--max-tokens", "64", "--max-model-len", "640",
               "--gpu-memory-utilization", "0.2", "--out", out, "--no-progress"]
    run(command + (["--adapter", adapter] if adapter else []))


def summary_of(results_files: dict[str, str]) -> dict:
    """{label: {"pass@k": mean, ..., "stderr": {k: se}}} from evaluate.py's results files.

    >>> import tempfile; path = os.path.join(tempfile.mkdtemp(), "r.json")
    >>> _ = open(path, "w").write(json.dumps({"benchmarks": {"held_out": {"pass_at_k": {
    ...     "1": {"mean": 0.25, "stderr": 0.01}, "2": {"mean": 0.4, "stderr": 0.02}}}}}))
    >>> summary_of({"grpo": path})
    {'grpo': {'pass@1': 0.25, 'pass@2': 0.4, 'stderr': {'pass@1': 0.01, 'pass@2': 0.02}}}
    """
    summary = {}
    for label, path in results_files.items():
        with open(path) as handle:
            entry = next(iter(json.load(handle)["benchmarks"].values()))["pass_at_k"]
        ks = sorted(entry, key=int)
        summary[label] = {**{f"pass@{k}": entry[k]["mean"] for k in ks},
                          "stderr": {f"pass@{k}": entry[k]["stderr"] for k in ks}}
    return summary


def format_table(summary: dict) -> str:
    """One row per model, one column per k."""
    columns = [key for key in next(iter(summary.values())) if key.startswith("pass@")]
    lines = [f"{'':18}" + "".join(f"{column:>10}" for column in columns)]
    for label, values in summary.items():
        lines.append(f"{label:18}" + "".join(f"{values[column]:>10.3f}" for column in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/compare", help="directory of the comparison")
    parser.add_argument("--steps", type=int, default=demo.DEMO_SIZES["steps"], help="RL steps of each variant")
    parser.add_argument("--n", type=int, default=64, help="samples per held-out problem")
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--demo-eval-problems", type=int, default=100, help="held-out problems")
    parser.add_argument("--demo-sft-examples", type=int, default=2400, help="SFT examples of the shared start")
    args = parser.parse_args(argv)
    started = time.time()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    common = ["--out", out, "--seed", str(args.seed), "--demo-eval-problems", str(args.demo_eval_problems),
              "--demo-sft-examples", str(args.demo_sft_examples)]
    # 1. one SFT start for all
    run(["sage.py", *common, "--name", "sft", "--sft-only"])
    sft_model = os.path.join(out, "sft", "sft_model")
    benchmark = held_out_file(out, args.seed, args.demo_eval_problems)
    results = {"SFT start": os.path.join(out, "sft_start.json")}
    evaluate(sft_model, None, benchmark, args.n, results["SFT start"])
    # 2. each variant from that start (the demo skips SFT where <run>/sft_model exists), then pass@k
    for name, flags in VARIANTS.items():
        shutil.copytree(sft_model, os.path.join(out, name, "sft_model"))
        run(["sage.py", *common, "--name", name, "--steps", str(args.steps), "--eval-every", "0", *flags])
        results[name] = os.path.join(out, f"{name}.json")
        evaluate(sft_model, os.path.join(out, name, "checkpoint", "model"), benchmark, args.n, results[name])
        print(f"[compare] {name} trained and evaluated ({time.time() - started:.0f} s)", file=sys.stderr)
    # 3. the table, summary.json and the plot
    summary = summary_of(results)
    runs.write_json_atomic(os.path.join(out, "summary.json"), {**summary, "steps": args.steps, "n": args.n,
                                                               "seconds": round(time.time() - started)})
    analysis.plot_results([f"{label}={path}" for label, path in results.items()], os.path.join(out, "passk.png"))
    print(format_table(summary))
    print(f"[compare] wrote {out}/summary.json and passk.png in {time.time() - started:.0f} s", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
