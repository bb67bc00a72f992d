"""A training step of sage.py against TRL's GRPOTrainer, side by side, same machine, one run.

Both train the same model on the same prompts with the same group size, completion budget, LoRA
rank, beta, learning rate and branch guide (TRL through trl_sage.py, so both compute the same
loss); sage.py generates with its colocated vLLM engine, TRL with transformers' generate (its
default without vLLM). Each runs as a subprocess for a few steps; the first steps (warm-up:
kernel choices, the engine's first batches) are left out of the means.

Two shapes:
* ``demo``: the demo's SFT model (built once by ``python -m extras.demo --sft-only``), which
  answers in ~12 tokens, 8 prompts x 8 completions;
* ``long``: the same tiny architecture untrained, which rarely stops, so completions run to a
  128-token budget.

Prints, per shape, sage.py's mean step time with its breakdown (metrics.jsonl's ``time/*``:
rollout, reward grading, reference pass, update, weight sync, other) and TRL's (its logged
``step_time``), and as the last line one JSON object: for each shape ``sage_step_s``,
``trl_step_s``, ``trl_over_sage``, both mean completion lengths and sage.py's breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from extras import demo  # noqa: E402
from extras.compare import SUBPROCESS_ENV  # noqa: E402

# The knobs both trainers get, with sage.py's flag names (trl_sage.py uses the same).
SHARED = shlex.split("""
    --prompts-per-step 8
    --rollouts 8
    --micro-batch-size 64
    --lora-rank 16
    --lora-alpha 32
    --lr 5e-4
    --beta 0.05
    --guide branch
    --max-prompt-len 96
    --no-gradient-checkpointing
    --seed 3407
""")
PHASES = ("rollout", "reward", "reference", "sleep", "update", "sync", "other")


def run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(
            f"bench/vs_trl.py: {' '.join(command[:3])} failed:\n{result.stderr[-3000:]}"
        )


def prepare(workdir: str) -> dict[str, str]:
    """The two models and the demo's training problems as a local dataset file."""
    run([sys.executable, "-m", "extras.demo", "--out", workdir, "--name", "sft", "--sft-only"])
    train, _ = demo.demo_problems(3407, 100)
    dataset = os.path.join(workdir, "train.jsonl")
    with open(dataset, "w") as handle:
        handle.writelines(
            json.dumps({"prompt": p["problem"], "solution": p["answer"]}) + "\n" for p in train
        )
    untrained = demo.save_tiny_model(
        os.path.join(workdir, "untrained"), seed=1, max_position_embeddings=256
    )
    return {
        "dataset": dataset,
        "demo": os.path.join(workdir, "sft", "sft_model"),
        "long": untrained,
    }


def run_flags(model: str, dataset: str, max_seq_len: int, steps: int, out: str) -> list[str]:
    """One shape's flags, the same for both trainers (beside ``SHARED``)."""
    return shlex.split(f"""
        --model {model}
        --dataset {dataset}
        --max-seq-len {max_seq_len}
        --steps {steps}
        --out {out}
    """)


def sage_steps(flags: list[str], warmup: int, out: str) -> dict:
    """sage.py's mean step time, completion length and phase breakdown after ``warmup`` steps."""
    own = ["--name", "sage", "--gpu-memory-utilization", "0.2"]
    run([sys.executable, "sage.py", *flags, *own, *SHARED])
    with open(os.path.join(out, "sage", "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle][warmup:]
    breakdown = {
        phase: statistics.fmean(row.get(f"time/{phase}_s", 0.0) for row in rows) for phase in PHASES
    }
    return {
        "step_s": statistics.fmean(row["time/step_s"] for row in rows),
        "completion_tokens": statistics.fmean(row["response_length"] for row in rows),
        "breakdown": breakdown,
    }


def trl_steps(flags: list[str], steps: int, warmup: int, out: str) -> dict:
    """TRL's (through trl_sage.py) mean step time and completion length after ``warmup`` steps."""
    own = ["--name", "trl", "--no-use-vllm", "--save-every", str(10 * steps)]  # no checkpoints
    run([sys.executable, "-m", "extras.trl_sage", *flags, *own, *SHARED])
    with open(os.path.join(out, "trl", "metrics.jsonl")) as handle:
        rows = [row for row in map(json.loads, handle) if "step_time" in row][warmup:]
    return {
        "step_s": statistics.fmean(row["step_time"] for row in rows),
        "completion_tokens": statistics.fmean(row["completions/mean_length"] for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of each trainer per shape")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as workdir:
        paths = prepare(workdir)
        for shape, max_seq_len in (("demo", 160), ("long", 96 + 128)):
            out = os.path.join(workdir, shape)
            flags = run_flags(
                paths[shape],
                dataset=paths["dataset"],
                max_seq_len=max_seq_len,
                steps=args.steps,
                out=out,
            )
            ours = sage_steps(flags, warmup=args.warmup, out=out)
            theirs = trl_steps(flags, steps=args.steps, warmup=args.warmup, out=out)
            result[shape] = {
                "sage_step_s": round(ours["step_s"], 4),
                "trl_step_s": round(theirs["step_s"], 4),
                "trl_over_sage": round(theirs["step_s"] / ours["step_s"], 3),
                "sage_completion_tokens": round(ours["completion_tokens"], 1),
                "trl_completion_tokens": round(theirs["completion_tokens"], 1),
                "sage_breakdown_s": {
                    phase: round(seconds, 4) for phase, seconds in ours["breakdown"].items()
                },
            }
            print(
                f"{shape}: sage.py {ours['step_s']:.3f} s/step "
                f"({ours['completion_tokens']:.0f} tokens), "
                f"TRL {theirs['step_s']:.3f} s/step ({theirs['completion_tokens']:.0f} tokens)",
                file=sys.stderr,
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
