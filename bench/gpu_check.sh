#!/usr/bin/env bash
# The GPU check: what a CPU cannot test, run on one GPU node in at most 9 minutes.
#
#   bash bench/gpu_check.sh            # from the project root, on the GPU node
#
# The node: one H100 or H200, Python 3.12 with PyTorch, transformers, peft, accelerate, pandas,
# pyarrow and pytest, but no vLLM, no package index and no hub. The other wheels it needs travel
# in .whl/ (ignored by git; bench/gpu_wheels.sh downloads them where an index answers).
# In order, each part under a `timeout`, its log in $OUT (default runs/gpu_check):
#   0. the wheels of .whl/ into /tmp/site (PYTHONPATH), and what torch sees (gpu.json);
#   1. one update step of a random Qwen2.5-Math-7B-shaped model at micro-batch 4, gradient
#      checkpointing, chunked log-probs, LoRA rank 8 (bench/gpu_check_update.py): its measured
#      peak (max_memory_allocated) against the plan's (20.27 GB at 256 + 1,536 tokens, 20.96 at
#      sage.py's default 512 + 1,536);
#   2. the step's speed at the paper's shape (bench/gpu_step.py: peak, step time, tokens/s, MFU)
#      and the chunked log-prob kernel against the naive path (bench/logprobs.py: memory and
#      time ratios), reported against their goals, not failed on them;
#   3. a tiny `--backend hf` run of sage.py on CUDA (the demo's model, 4 updates, four prompts
#      in each micro-batch, left-padded): the peaks it logs (memory/*_peak_gb in metrics.jsonl)
#      and its "[memory]" lines against the plan's forecast, the loss and gradient norm finite,
#      the LoRA weights moved;
#   4. pytest -m "cuda_kernels or not slow" on the GPU with what is left of the budget, the
#      tests marked cuda_kernels first; a test that needs a module this node lacks (vLLM,
#      matplotlib, scipy, tensorboard, wandb) is skipped and counted with that reason.
# The last line printed is one JSON object with every figure; the exit status is 1 when a part
# failed. GPU_CHECK_CPU=1 runs the same parts on a CPU (the update at --tiny shape), to test this
# script without a GPU; GPU_CHECK_BUDGET_S (default 540) is the whole run's budget in seconds;
# GPU_CHECK_PYTEST_MARK and GPU_CHECK_PYTEST_ARGS narrow the tests (a rerun of some files).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
CPU=${GPU_CHECK_CPU:-0}
PY=${PYTHON:-python3}
WHEELS=${WHEEL_DIR:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
LOGS=${OUT:-runs/gpu_check}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
declare -A WALL RC

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# part NAME SECONDS COMMAND...: run it under a timeout (SIGINT first, so pytest still reports),
# its output in $LOGS/NAME.log; its exit status and wall time kept for the summary.
part() {
    local name=$1 seconds=$2 began rc=0
    shift 2
    if (( seconds < 10 )); then
        echo "[gpu_check] $name: skipped, the budget is spent" | tee "$LOGS/$name.log"
        RC[$name]=124 WALL[$name]=0
        return 0
    fi
    echo "[gpu_check] $name (at most ${seconds}s): $(echo "$*" | tr '\n' ' ' | head -c 160)"
    began=$(date +%s)
    timeout -s INT -k 20 "$seconds" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
    WALL[$name]=$(( $(date +%s) - began ))
    RC[$name]=$rc
    echo "[gpu_check] $name: exit $rc in ${WALL[$name]}s"
    tail -n 3 "$LOGS/$name.log" | cut -c1-300
}

# ---- 0. wheels and device ----------------------------------------------------------------------
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    if "$PY" -m pip --version > /dev/null 2>&1; then
        part wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$WHEELS"/*.whl
    else  # no pip on the node: a wheel is a zip of the files to put on the path
        part wheels 90 "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$SITE" "$WHEELS"/*.whl
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
else
    echo "[gpu_check] no $WHEELS/*.whl: using the packages installed"
fi
part device 60 "$PY" - "$LOGS/gpu.json" "$CPU" <<'EOF'
import json, subprocess, sys
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info |= {"device": props.name, "memory_gb": round(props.total_memory / 1e9, 2)}
    info["driver"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip() or None
from importlib import metadata
for name in ("transformers", "peft", "accelerate", "datasets", "math-verify", "pytest", "vllm"):
    try:
        info[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        info[name] = None
print(json.dumps(info))
json.dump(info, open(sys.argv[1], "w"))
if sys.argv[2] != "1" and not torch.cuda.is_available():
    sys.exit("error: torch sees no GPU (GPU_CHECK_CPU=1 runs this check on a CPU)")
EOF
if [[ ${RC[device]} -ne 0 ]]; then
    echo "[gpu_check] no usable device: stopping" >&2
    cat "$LOGS/device.log" >&2
fi

# ---- 1. one update step of the 7B shape against the plan -------------------------------------
UPDATE_ARGS=()
[[ $CPU == 1 ]] && UPDATE_ARGS=(--tiny)
if [[ ${RC[device]} -eq 0 ]]; then
    part update 200 "$PY" bench/gpu_check_update.py "${UPDATE_ARGS[@]}"
fi

# ---- 2. the step's speed and the log-prob kernel -----------------------------------------------
STEP_ARGS=() LOGPROB_ARGS=()
[[ $CPU == 1 ]] && LOGPROB_ARGS=(--batch 2 --length 64 --vocab 1024)  # gpu_step: --small on CPU
if [[ ${RC[device]} -eq 0 ]]; then
    part gpu_step 150 "$PY" bench/gpu_step.py "${STEP_ARGS[@]}"
    part logprobs 60 "$PY" bench/logprobs.py "${LOGPROB_ARGS[@]}"
fi

# ---- 3. a tiny --backend hf run on CUDA --------------------------------------------------------
HF_DEMO=(--demo-sft-examples 16 --sft-batch-size 8 --demo-eval-problems 2)
# Four prompts in one micro-batch of 8 rows, left-padded to the longest prompt, as in every run
# whose micro-batch holds more than one group (the demo's 64 rows, a study's arms): finite
# gradients here show loss.attend_somewhere_under_sdpa's fix (docs/gpu.md's NaN gradient).
HF_RUN=(--backend hf --steps 4 --prompts-per-step 4 --rollouts 2 --micro-batch-size 8
    --gradient-checkpointing --max-seq-len 144 --max-prompt-len 100 --eval-every 0
    --save-every 4 --guide branch)
hf_run() {
    rm -rf "$LOGS/hf-data" "$LOGS/hf"
    "$PY" -m extras.demo --sft-only --out "$LOGS" --name hf-data "${HF_DEMO[@]}"
    local flags
    mapfile -t flags < <("$PY" -c 'import sys; from extras import demo; print("\n".join(demo.sage_flags({"model": sys.argv[1] + "/sft_model", "train": sys.argv[1] + "/train.jsonl", "held_out": sys.argv[1] + "/demo.jsonl"})))' "$LOGS/hf-data")
    "$PY" sage.py "${flags[@]}" "${HF_RUN[@]}" --out "$LOGS" --name hf --plan-memory \
        > "$LOGS/hf-plan.log" 2>&1
    "$PY" sage.py "${flags[@]}" "${HF_RUN[@]}" --out "$LOGS" --name hf
}
if [[ ${RC[device]} -eq 0 ]]; then  # (timeout runs programs: the function goes to bash -c)
    part hf_run 150 bash -c "$(declare -p HF_DEMO HF_RUN LOGS PY); $(declare -f hf_run); hf_run"
fi

# ---- 4. the tests that need no vLLM, on the GPU -----------------------------------------------
mkdir -p "$LOGS/plugin"
cat > "$LOGS/plugin/gpu_check_plugin.py" <<'EOF'
"""bench/gpu_check.sh's pytest plugin. A test that fails only because this node lacks an
optional module (vLLM, matplotlib, scipy, tensorboard, wandb: ModuleNotFoundError, rollout.py's
"vllm is not installed" or runs.py's "needs the wandb package", in the test or in the output of
a run it started) is reported skipped
with that reason; so is a module whose import fails for that reason at collection. The tests
marked cuda_kernels run first. At the end it writes the counts to $GPU_CHECK_PYTEST_JSON."""

import importlib.util
import json
import os
import re

import pytest

OPTIONAL = ("vllm", "matplotlib", "scipy", "tensorboard", "wandb")
MISSING = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
PATTERNS = {
    name: re.compile(
        rf"No module named '{name}(\.[\w.]+)?'|\b{name}\b is not installed|needs the {name} package",
        re.I,
    )
    for name in MISSING
}
SKIPPED_FOR = {}  # module -> nodeids skipped because it is missing
CUDA_KERNELS = {}  # nodeid -> outcome, for the tests marked cuda_kernels


def missing_module(text: str):
    return next((name for name, pattern in PATTERNS.items() if pattern.search(text)), None)


def as_skip(report, path: str, lineno: int, name: str) -> None:
    reason = f"needs {name}, which this node lacks (bench/gpu_check.sh)"
    report.outcome, report.longrepr = "skipped", (path, lineno, f"Skipped: {reason}")
    SKIPPED_FOR.setdefault(name, []).append(report.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.failed and (name := missing_module(str(report.longrepr))):
        as_skip(report, str(collector.path), 0, name)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None:
        error, texts = call.excinfo.value, []
        while error is not None and len(texts) < 5:  # the exception and what caused it
            texts.append(f"{type(error).__name__}: {error}")
            error = error.__cause__ or error.__context__
        if name := missing_module("\n".join(texts)):
            as_skip(report, str(item.path), item.location[1] or 0, name)
    if item.get_closest_marker("cuda_kernels") is not None:
        if report.when == "call" or report.outcome != "passed":
            CUDA_KERNELS[item.nodeid] = report.outcome
    return report


def pytest_collection_modifyitems(config, items):
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("cuda_kernels") is None)


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    # "passed" and "failed" hold the tests' calls; "error" setup and teardown failures and
    # collection errors; "skipped" the skipped tests and modules
    keys = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    counts = {key: len(stats.get(key, [])) for key in keys}
    result = {
        **counts,
        "deselected": len(stats.get("deselected", [])),
        "exitstatus": int(exitstatus),
        "interrupted": int(exitstatus) == 2,
        "missing_modules": MISSING,
        "skipped_for_missing": {name: len(ids) for name, ids in SKIPPED_FOR.items()},
        "cuda_kernels": {
            outcome: sum(o == outcome for o in CUDA_KERNELS.values())
            for outcome in sorted(set(CUDA_KERNELS.values()))
        },
        "failed_tests": [r.nodeid for r in stats.get("failed", [])][:40],
        "error_tests": [r.nodeid for r in stats.get("error", [])][:40],
    }
    with open(os.environ["GPU_CHECK_PYTEST_JSON"], "w") as handle:
        json.dump(result, handle)
EOF
MARK=${GPU_CHECK_PYTEST_MARK:-cuda_kernels or not slow}
PYTEST_S=$(( $(left) - 10 ))
(( PYTEST_S > ${GPU_CHECK_PYTEST_MAX_S:-330} )) && PYTEST_S=${GPU_CHECK_PYTEST_MAX_S:-330}
PYTEST=(env "PYTHONPATH=$LOGS/plugin${PYTHONPATH:+:$PYTHONPATH}" "GPU_CHECK_PYTEST_JSON=$LOGS/pytest.json"
    "$PY" -m pytest -q -p gpu_check_plugin -p no:cacheprovider -m "$MARK" --junitxml "$LOGS/pytest.xml")
# GPU_CHECK_PYTEST_ARGS: more arguments for pytest (files or -k to narrow a rerun), split on spaces
read -r -a EXTRA <<< "${GPU_CHECK_PYTEST_ARGS:-}"
PYTEST+=("${EXTRA[@]}")
rm -f "$LOGS/pytest.json"
if [[ ${RC[device]} -eq 0 ]]; then
    part pytest "$PYTEST_S" "${PYTEST[@]}"
fi

# ---- the summary: one JSON object, last ------------------------------------------------------
summary_rc=0
"$PY" - "$LOGS" "$CPU" "$(( $(date +%s) - START ))" \
    "${RC[wheels]:-}" "${RC[device]:-}" "${RC[update]:-}" "${RC[gpu_step]:-}" \
    "${RC[logprobs]:-}" "${RC[hf_run]:-}" "${RC[pytest]:-}" \
    "${WALL[wheels]:-}" "${WALL[device]:-}" "${WALL[update]:-}" "${WALL[gpu_step]:-}" \
    "${WALL[logprobs]:-}" "${WALL[hf_run]:-}" "${WALL[pytest]:-}" <<'EOF' || summary_rc=$?
import glob, json, math, os, re, sys

logs, cpu, total_s = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
names = ["wheels", "device", "update", "gpu_step", "logprobs", "hf_run", "pytest"]
rcs = dict(zip(names, (int(v) if v else None for v in sys.argv[4:11])))
walls = dict(zip(names, (int(v) if v else None for v in sys.argv[11:18])))
failures = []


def last_json(path):
    """The last line of a log that reads as a JSON object, or None."""
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None


def finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


for name in ("wheels", "device"):
    if rcs[name] not in (None, 0):
        failures.append(f"{name}: exit {rcs[name]} (see {name}.log)")
device = json.load(open(f"{logs}/gpu.json")) if os.path.exists(f"{logs}/gpu.json") else None

# 1. the 7B update step
update = last_json(f"{logs}/update.log")
if rcs["update"] is None:
    failures.append("update: not run")
elif rcs["update"] != 0 or not update or not update.get("ok"):
    failures.append(f"update: exit {rcs['update']}: " + "; ".join((update or {}).get("failures") or ["see update.log"]))
steps = (update or {}).get("steps", [])

# the step's speed and the kernel, against their goals (docs/gpu.md, docs/benchmarks.md)
benches = {}
for name in ("gpu_step", "logprobs"):
    if rcs[name] is None:
        failures.append(f"{name}: not run")
    elif rcs[name] != 0:
        failures.append(f"{name}: exit {rcs[name]} (see {name}.log)")
    benches[name] = last_json(f"{logs}/{name}.log") or {}
step = benches["gpu_step"]
step_7b = {k: step.get(k) for k in ("shape", "peak_memory_gb", "peak_reserved_gb", "step_s",
                                    "tokens_per_s", "mfu", "attention")}
step_7b["goals"] = {  # one H100's: a peak of at most 55 GB, an MFU of at least 0.35
    "peak_at_most_55_gb": None if step.get("peak_memory_gb") is None else step["peak_memory_gb"] <= 55,
    "mfu_at_least_0.35": None if step.get("mfu") is None else step["mfu"] >= 0.35,
}
kernel = benches["logprobs"]
logprobs = {k: kernel.get(k) for k in ("shape", "dtype", "peak_memory_ratio", "time_ratio",
                                       "ours_seconds", "naive_seconds", "max_abs_diff")}
logprobs["goals"] = {
    "memory_ratio_at_most_0.25": None if kernel.get("peak_memory_ratio") is None else kernel["peak_memory_ratio"] <= 0.25,
    "time_ratio_at_most_1.5": None if kernel.get("time_ratio") is None else kernel["time_ratio"] <= 1.5,
}

# 2. the hf run: its logged peaks against the forecast
hf = {"exit": rcs["hf_run"]}
metrics_path = f"{logs}/hf/metrics.jsonl"
rows = []
if os.path.exists(metrics_path):
    for line in open(metrics_path):
        try:
            rows.append(json.loads(line))
        except ValueError:
            failures.append("hf_run: a line of metrics.jsonl does not read")
plan = last_json(f"{logs}/hf-plan.log") or {}
log = open(f"{logs}/hf_run.log", errors="replace").read() if os.path.exists(f"{logs}/hf_run.log") else ""
memory_lines = [line.strip() for line in log.splitlines() if line.strip().startswith("[memory]")]
forecasts = [float(x) for line in memory_lines for x in re.findall(r"plan's ([\d.]+) GB", line)]
peaks = {}
for row in rows:
    for key, value in row.items():
        if key.startswith("memory/") and key.endswith("_peak_gb") and finite(value):
            peaks[key] = max(peaks.get(key, 0.0), value)
hf |= {
    "steps_logged": len(rows),
    "logged_peak_gb": max(peaks.values()) if peaks else None,
    "logged_peaks_gb": peaks,
    # the forecast the run compares its logged peaks with: the plan's trainer peak (its run
    # peak before the plan had one), as --plan-memory prints it for the same flags on this GPU
    "forecast_gb": plan.get("trainer_peak_gb", plan.get("run_peak_gb")),
    "printed_forecast_gb": forecasts[-1] if forecasts else None,  # "[memory]", to 0.1 GB
    "memory_lines": memory_lines,
    "plan_trainer_peak_gb": plan.get("trainer_peak_gb"),
    "plan_run_peak_gb": plan.get("run_peak_gb"),
    "plan_update_peak_gb": plan.get("update_peak_gb"),
    "loss": [row.get("loss") for row in rows],
    "grad_norm": [row.get("grad_norm") for row in rows],
    "kl_ref_k3_last": rows[-1].get("kl/ref_k3") if rows else None,
}
adapter = f"{logs}/hf/checkpoint/model/adapter_model.safetensors"
hf["lora_b_max_abs"] = None
try:
    from safetensors.torch import load_file
    tensors = load_file(adapter) if os.path.exists(adapter) else {}
    hf["lora_b_max_abs"] = max(
        (t.float().abs().max().item() for k, t in tensors.items() if "lora_B" in k), default=None)
except Exception as error:  # noqa: BLE001 - a failure of the check, reported
    failures.append(f"hf_run: the adapter does not read ({type(error).__name__}: {error})")
forecast = hf["forecast_gb"]
if hf["logged_peak_gb"] is not None and forecast:
    hf["ratio"] = round(hf["logged_peak_gb"] / forecast, 3)
if rcs["hf_run"] is None:
    failures.append("hf_run: not run")
else:
    if rcs["hf_run"] != 0:
        failures.append(f"hf_run: exit {rcs['hf_run']} (see hf_run.log)")
    if not rows:
        failures.append("hf_run: no metrics.jsonl rows")
    if not all(finite(v) for v in hf["loss"] + hf["grad_norm"]):
        failures.append("hf_run: a loss or gradient norm is not finite")
    if not (hf["lora_b_max_abs"] or 0) > 0:
        failures.append("hf_run: the LoRA weights did not move (lora_B all zero)")
    if not cpu:
        if not peaks:
            failures.append("hf_run: no memory/*_peak_gb logged on CUDA")
        if not memory_lines:
            failures.append("hf_run: no [memory] line printed on CUDA")
        headroom = 0.05 * (device or {}).get("memory_gb", 80)  # the 5% the plan keeps free
        if peaks and forecast and hf["logged_peak_gb"] > forecast + headroom:
            failures.append(f"hf_run: logged peak {hf['logged_peak_gb']} GB above the forecast {forecast} GB + {headroom:.1f}")

# 3. the tests
tests = json.load(open(f"{logs}/pytest.json")) if os.path.exists(f"{logs}/pytest.json") else None
if rcs["pytest"] is None:
    failures.append("pytest: not run")
elif tests is None:
    failures.append(f"pytest: exit {rcs['pytest']}, no counts (see pytest.log)")
else:
    if tests["failed"] or tests["error"]:
        failures.append(f"pytest: {tests['failed']} failed, {tests['error']} errors")
    if tests["interrupted"] or rcs["pytest"] in (124, 137):
        failures.append("pytest: stopped by its time limit")
    if rcs["pytest"] not in (0, 1, 2, 124, 137) or not tests["passed"]:  # 1: failures, 2: stopped
        failures.append(f"pytest: exit {rcs['pytest']}, {tests['passed']} passed (see pytest.log)")
    if not cpu and tests["cuda_kernels"].get("passed", 0) == 0:
        failures.append("pytest: no test marked cuda_kernels passed")

first = next((row for row in steps if row.get("prompt_len") == 256), steps[0] if steps else {})
summary = {
    "gpu_check": "cpu dry run" if cpu else "gpu",
    "ok": not failures,
    "failures": failures,
    "device": device,
    "tests": tests and {k: tests[k] for k in ("passed", "failed", "error", "skipped", "xfailed",
                                               "deselected", "skipped_for_missing", "cuda_kernels",
                                               "failed_tests", "error_tests", "interrupted")},
    "hf_run": {k: hf.get(k) for k in ("exit", "steps_logged", "logged_peak_gb", "forecast_gb",
                                      "ratio", "printed_forecast_gb", "plan_trainer_peak_gb",
                                      "plan_run_peak_gb", "plan_update_peak_gb",
                                      "logged_peaks_gb", "memory_lines", "kl_ref_k3_last",
                                      "lora_b_max_abs", "loss", "grad_norm")},
    "update_7b": update and {
        "device": update.get("device"), "shape": update.get("shape"),
        "attention": update.get("attention"), "build_s": update.get("build_s"),
        "steps": [{k: row.get(k) for k in (
            "prompt_len", "completion_len", "measured_peak_gb", "measured_reserved_gb",
            "counted_peak_gb", "plan_gb", "formula_gb", "documented_plan_gb", "ratio", "over_plan_gb",
            "loss", "grad_norm", "weights_moved_max_abs", "step_s", "plan_s")} for row in steps],
    },
    # at 256 + 1,536 tokens, the plan's 20.27 GB (the first step measured on a CPU dry run)
    "step_7b": step_7b,
    "logprobs": logprobs,
    "update_7b_measured_peak_gb": first.get("measured_peak_gb"),
    "update_7b_plan_gb": first.get("plan_gb"),
    "update_7b_ratio": first.get("ratio"),
    "wall_s": {**{k: v for k, v in walls.items() if v is not None}, "total": total_s},
    "logs": logs,
}
print(json.dumps(summary))
sys.exit(0 if summary["ok"] else 1)
EOF
exit $summary_rc
