"""The bench scripts run at their small shapes and print the keys their goals name, on whatever
device is present (on a GPU node too: --small keeps the 7B shape for the GPU section's run)."""

import json
import os
import subprocess
import sys

import torch

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


def test_gpu_step_prints_its_keys_at_the_small_shape():
    result = last_json_line("gpu_step.py", "--small", "--repeats", "1")
    assert {"peak_memory_gb", "step_s", "tokens_per_s", "mfu", "device"} <= result.keys()
    on_cuda = torch.cuda.is_available()
    assert (result["device"] == "cpu") != on_cuda and result["shape"] == "small"
    assert on_cuda or result["mfu"] is None  # MFU is a GPU figure (its peak FLOP/s)
    assert result["step_s"] > 0 and result["peak_memory_gb"] > 0
