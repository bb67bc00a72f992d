"""compare.py: the comparison's summary and table from evaluate.py's results files, and (slow) a
tiny end-to-end comparison."""

import json
import os

import pytest

import compare


def write_results(path, means):
    entry = {"pass_at_k": {str(k): {"mean": m, "std": 0.0, "stderr": 0.01 * k} for k, m in means.items()}}
    path.write_text(json.dumps({"benchmarks": {"held_out": entry}, "model": {}}))
    return str(path)


def test_summary_and_table_carry_every_k_of_every_variant(tmp_path):
    files = {"SFT start": write_results(tmp_path / "a.json", {1: 0.1, 2: 0.2, 64: 0.6}),
             "grpo": write_results(tmp_path / "b.json", {1: 0.3, 2: 0.4, 64: 0.55})}
    summary = compare.summary_of(files)
    assert summary["grpo"]["pass@64"] == 0.55 and summary["SFT start"]["stderr"]["pass@64"] == 0.64
    table = compare.format_table(summary).splitlines()
    assert table[0].split() == ["pass@1", "pass@2", "pass@64"]
    assert table[2].split() == ["grpo", "0.300", "0.400", "0.550"]


@pytest.mark.slow
def test_a_tiny_comparison_writes_its_summary_and_plot(tmp_path):
    out = tmp_path / "compare"
    summary = compare.main(["--out", str(out), "--steps", "2", "--n", "4", "--demo-eval-problems", "4",
                             "--demo-sft-examples", "32"])
    assert set(summary) == {"SFT start", "grpo", "branch_k3", "branch_k1_return"}
    written = json.loads((out / "summary.json").read_text())
    assert all({"pass@1", "pass@4"} <= written[label].keys() for label in summary)
    assert os.path.getsize(out / "passk.png") > 0
