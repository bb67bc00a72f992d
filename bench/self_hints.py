"""Self-hints on the demo's hardest problems: the prompt usage rate with and without them.

The demo's SFT start forgets the carry on most sums of 10 and more, so on those problems whole
groups come back wrong and teach nothing. This trains on exactly those problems, from the demo's
SFT model, twice with the same seed: plain (GRPO + Branch, the demo's settings) and with
``--self-hints`` (the policy writes a hint from the problem's reference working, hints.py). It
reports the prompt usage rate (the fraction of sampled prompts whose group carried signal), how
many groups were hinted and solved by their hint, the mean reward, and the step time.

Prints one JSON object as its last line: for "plain" and "self_hints", ``prompt_usage_rate``,
``groups_hinted``, ``groups_solved_by_hint``, ``leaked``, ``reward``, ``step_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from extras import demo  # noqa: E402
from extras.compare import SUBPROCESS_ENV  # noqa: E402


def run(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, *command], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(
            f"bench/self_hints.py: {' '.join(command[:3])} failed:\n{result.stderr[-3000:]}"
        )


def summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return {
        "prompt_usage_rate": round(
            1 - statistics.fmean(row["frac_zero_signal_groups"] for row in rows), 4
        ),
        "groups_hinted": sum(row.get("hints/groups_hinted", 0) for row in rows),
        "groups_solved_by_hint": sum(row.get("hints/groups_solved_by_hint", 0) for row in rows),
        "leaked": sum(row.get("hints/leaked", 0) for row in rows),
        "reward": round(statistics.fmean(row["reward"] for row in rows), 4),
        "step_s": round(statistics.fmean(row["time/step_s"] for row in rows[2:]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        run(["-m", "extras.demo", "--out", workdir, "--name", "sft", "--sft-only"])
        train, _ = demo.demo_problems(3407, 100)
        hard = os.path.join(workdir, "hard.jsonl")
        with open(hard, "w") as handle:
            handle.writelines(json.dumps(p) + "\n" for p in train if int(p["answer"]) >= 10)
        model = os.path.join(workdir, "sft", "sft_model")
        result = {}
        for name, extra in (("plain", []), ("self_hints", ["--self-hints"])):
            run(
                [
                    "sage.py",
                    *demo.DEMO_FLAGS,  # the demo's settings; the flags below win
                    "--eval-every",
                    "0",
                    "--model",
                    model,
                    "--dataset",
                    hard,
                    "--problem-key",
                    "problem",
                    "--answer-key",
                    "answer",
                    "--solution-key",
                    "working",
                    "--steps",
                    str(args.steps),
                    "--out",
                    workdir,
                    "--name",
                    name,
                    *extra,
                ]
            )
            result[name] = summary(os.path.join(workdir, name))
            print(f"{name}: {result[name]}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
