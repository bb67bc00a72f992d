#!/usr/bin/env bash
# Download, here (where the package index answers), the small wheels that bench/gpu_check.sh
# installs on the GPU node. Its image holds PyTorch, transformers, peft and accelerate, and also
# pandas, pyarrow, pytest, matplotlib, scipy and tensorboard (seen there on 2026-11-27: pyarrow
# 24.0.0, pandas 3.0.6, pytest 9.1.1), but no vLLM and no package index. The wheels go to .whl/
# (ignored by git); beside the working tree they must stay under 64 MiB.
#
#   bash bench/gpu_wheels.sh          # then carry .whl/ to the node with the working tree
#   WHEEL_DIR=/tmp/w PY_VERSION=3.11 bash bench/gpu_wheels.sh   # the same set for another Python
#
# What the image lacks and the checked code imports:
#   - the grader: math-verify, latex2sympy2_extended, the antlr4 runtime (task/grading.py);
#   - datasets (task/problems.py's load_rows reads every run's problems with it), with dill and
#     multiprocess (the rest of what it imports is on the image);
#   - docstring-parser (machinery/cli.py reads each flag's help with it), pure Python;
#   - trl (extras/trl_sage.py, tests/test_trl_sage.py), pure Python.
# wandb is left out: the check skips, with their reason, the tests that need it (or vLLM).
# Versions are those .venv tests with (pip list there), for CPython 3.12 on x86-64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEEL_DIR:-.whl}
WHEELS=(
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    docstring-parser==0.18.0
    trl==1.16.0
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
