"""The bench scripts run at their small shapes and print the keys their goals name, on whatever
device is present (on a GPU node too: --small keeps the 7B shape for the GPU section's run)."""

import importlib
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def last_json_line(script, *args, timeout=600):
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_script(name: str):
    """A bench/ script imported as a module (bench/ is not a package)."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(REPO, "bench"))


def test_gpu_step_prints_its_keys_at_the_small_shape():
    result = last_json_line("gpu_step.py", "--small", "--repeats", "1")
    assert {"peak_memory_gb", "step_s", "tokens_per_s", "mfu", "device"} <= result.keys()
    # the subprocess picks its own device: its answer ("cpu", or the GPU's name), not this
    # process's torch.cuda, says which
    assert result["device"] and result["shape"] == "small"
    assert (result["mfu"] is None) == (result["device"] == "cpu")  # MFU: a GPU figure
    assert result["step_s"] > 0 and result["peak_memory_gb"] > 0


def test_memory_table_prints_the_plan_per_card(capsys):
    """docs/gpu.md's table at one short length: a 24 GB card cannot hold the engine beside the
    trainer, a 48 GB card fits with every sequence at once. (Micro-batch 4, the default: the
    simulation runs two micro-batches, where micro-batch 1 would run a group's eight.)"""
    memory_table = bench_script("memory_table")
    argv = ["--lengths", "1024", "--micro-batches", "4", "--cards", "24,48"]
    result = memory_table.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    small, large = result["rows"]
    assert small["engine_problem"] and small["largest_micro_batch"] is None
    assert large["largest_micro_batch"] == 4 and large["rollout_waves"] == 1
    assert large["engine_sequences_at_once"] == 64
    peak = result["update_peak_gb"]["1024"]["4"]
    assert 15.3 < peak <= large["run_peak_gb"] < 48 * 0.95


def test_memory_table_refuses_bad_lists_in_one_line(capsys):
    memory_table = bench_script("memory_table")
    for argv, message in (
        (["--lengths", "abc"], "'abc' is not a comma-separated list"),
        (["--cards", "0,48"], "every value must be above zero"),
        (["--lengths", "256"], "--lengths must exceed the prompts' 512 tokens"),
    ):
        with pytest.raises(SystemExit) as stop:
            memory_table.main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
