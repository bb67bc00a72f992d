"""The bench scripts run (on CPU, at their small shapes) and print the keys their goals name."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def last_json_line(script, *args, timeout=600):
    result = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args], capture_output=True,
                            text=True, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_gpu_step_prints_its_keys_on_cpu():
    result = last_json_line("gpu_step.py", "--repeats", "1")
    assert {"peak_memory_gb", "step_s", "tokens_per_s", "mfu", "device"} <= result.keys()
    assert result["device"] == "cpu" and result["mfu"] is None and result["shape"] == "small"
    assert result["step_s"] > 0 and result["peak_memory_gb"] > 0
