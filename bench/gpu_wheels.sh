#!/usr/bin/env bash
# Download, here (where the package index answers), the small wheels that bench/gpu_check.sh
# installs on a bare GPU node: one with Python 3.12, PyTorch, transformers, peft and accelerate and
# nothing else (no vLLM, no package index). They go to .whl/ (ignored by git), at most 64 MiB.
#
#   bash bench/gpu_wheels.sh          # then carry .whl/ to the node with the working tree
#   WHEEL_DIR=/tmp/w PY_VERSION=3.11 bash bench/gpu_wheels.sh   # the same set for another Python
#
# What the node lacks and the checked code imports (torch brings sympy, jinja2, fsspec, filelock;
# transformers brings huggingface_hub, numpy, packaging, pyyaml, tqdm, tokenizers, safetensors;
# peft and accelerate bring psutil):
#   - the grader: math-verify, latex2sympy2_extended, the antlr4 runtime (task/grading.py);
#   - datasets and what it imports (task/problems.py's load_rows reads every run's problems with
#     it, so sage.py and most tests need it): pyarrow, pandas, python-dateutil, tzdata, dill, multiprocess, xxhash;
#   - docstring-parser (machinery/cli.py reads each flag's help with it), pure Python;
#   - trl (extras/trl_sage.py, tests/test_trl_sage.py), pure Python;
#   - pytest and its dependencies.
# Left out, as too large for 64 MiB beside pyarrow: matplotlib (extras/analysis.py and the
# plots), scipy (extras/compare.py's intervals), tensorboard and wandb (--report-to); the check
# skips, with their reason, the tests that need one of them (or vLLM).
# Versions are those .venv tests with (pip list there), for CPython 3.12 on x86-64 Linux, except
# pyarrow 24.0.0 (the oldest datasets 5.2 takes: 49 MB, against 26.0.1's 55) and pandas 3.0.0
# (11 MB, against 3.1.1's 12), which keep the whole under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEEL_DIR:-.whl}
WHEELS=(
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
    datasets==5.2.0
    pyarrow==24.0.0
    pandas==3.0.0
    python-dateutil==4.0.0
    tzdata==2026.6
    dill==0.4.1
    multiprocess==0.70.19
    xxhash==4.1.0
    trl==1.16.0
    pytest==9.2.0
    pluggy==1.7.0
    iniconfig==2.3.1
    docstring-parser==0.18.0
    pygments==2.21.0
)
mkdir -p "$DEST"
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}"
ls -1 "$DEST"
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "total $(( bytes / 1048576 )) MiB ($bytes bytes) in $DEST"
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)  # the working tree travels too
if (( bytes + tree > 64 * 1048576 )); then
    echo "error: the wheels and the working tree come to more than 64 MiB: drop a wheel" >&2
    exit 1
fi
