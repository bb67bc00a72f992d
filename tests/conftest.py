"""Shared test set-up: vLLM in-process on CPU, and a tiny Qwen2 model built by code (no hub)."""

import os

# vLLM's CPU backend runs in-process (no engine subprocess) and must not look for a hub.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import random

import pytest

collect_ignore = ["plugins"]  # pytest plugins (make test-gpu-sim), imported only when named


def worker_cores(worker: str, workers: int, cores: list[int]) -> list[int]:
    """The cores that pytest-xdist's worker ``gw<i>`` of ``workers`` keeps: i, i + n, ... of
    ``cores`` (with more workers than cores, workers share them).

    >>> worker_cores("gw1", workers=2, cores=[0, 1, 2, 3])
    [1, 3]
    >>> worker_cores("gw2", workers=3, cores=[0, 1])
    [0]
    """
    return cores[int(worker.removeprefix("gw")) % len(cores) :: workers]


def pytest_configure(config):
    """Under pytest-xdist (``make test`` on a CPU machine: a worker per core), each worker keeps
    its cores to itself: the process and the runs its tests start are pinned to them, and
    torch's and vLLM's OpenMP threads number and bind to them. Unpinned, two workers' threads
    spin on the same cores, and each slow test takes two to three times as long side by side
    (docs/history.md, the test loop)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...; unset in one process
    if worker is None:
        return
    import torch

    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    mine = worker_cores(worker, workers=workers, cores=sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, mine)  # inherited by the processes a test starts
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))  # vLLM's CPU engine
    torch.set_num_threads(len(mine))


SEED = 0  # every test starts from the same global RNG state, whatever ran before it


def global_state() -> dict:
    """What a test could change for the tests after it: torch's threads, default dtype and grad
    mode, the environment and the working directory."""
    import torch

    return {
        "torch threads": torch.get_num_threads(),
        "torch default dtype": torch.get_default_dtype(),
        "torch grad mode": torch.is_grad_enabled(),
        "environment": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "working directory": os.getcwd(),
    }


def changed_environment(before: dict, after: dict) -> set:
    """The variables set before that a test changed or removed. Variables it added are not
    counted: vLLM, torch's compiler and Triton add their own once, as they first import or
    compile, and keep them for the process (what the next test sees is the same either way)."""
    return {key for key, value in before.items() if after.get(key) != value}


@pytest.fixture(autouse=True)
def isolated_test():
    """Each test starts from seeded global RNGs (Python's, NumPy's, torch's) and must leave the
    process as it found it: the RNG states are restored afterwards, and a test that changed
    torch's threads, default dtype or grad mode, an environment variable or the working
    directory fails, naming what it left behind (monkeypatch and tmp_path undo their own changes
    first)."""
    import numpy
    import torch

    before = global_state()
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(SEED)
        numpy.random.seed(SEED)
        torch.manual_seed(SEED)
        yield
    random.setstate(python_state)
    numpy.random.set_state(numpy_state)
    after = global_state()
    environment = changed_environment(before["environment"], after["environment"])
    leaked = [name for name in before if name != "environment" and before[name] != after[name]]
    leaked += ["environment"] if environment else []
    if leaked:
        torch.set_num_threads(before["torch threads"])
        torch.set_default_dtype(before["torch default dtype"])
        torch.set_grad_enabled(before["torch grad mode"])
        os.environ.update({key: before["environment"][key] for key in environment})
        os.chdir(before["working directory"])
        pytest.fail(f"the test left global state changed: {leaked} (environment: {environment})")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny random Qwen2 model + byte-level tokenizer (hidden 128, 2 layers, head 64)."""
    from extras import demo

    return demo.save_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny():
    """The tiny random Qwen2 model (eval mode) and its tokenizer, in memory."""
    from extras import demo

    tokenizer = demo.build_tiny_tokenizer()
    return demo.build_tiny_model(tokenizer, max_position_embeddings=160).eval(), tokenizer


@pytest.fixture
def float64_qwen2(monkeypatch):
    """transformers' Qwen2 computes its RMSNorm and rotary angles in float32 whatever the weights'
    dtype; here they follow the weights, so that a float64 model is float64 throughout and two
    summation orders differ by float64's rounding alone."""
    import torch
    from transformers.models.qwen2 import modeling_qwen2

    def rms_norm(self, hidden_states):  # [..., H]
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):  # cos, sin: [B, L, head_dim]
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_qwen2.Qwen2RotaryEmbedding, "forward", rotary)


def pytest_collection_modifyitems(config, items):
    """On a CUDA node, skip the tests marked ``cpu_only(reason)`` with their reason: they check
    bit-exact or last-bit equality of two CPU float32 paths, which CUDA kernels (bf16 weights,
    other reduction orders, nondeterministic atomics) do not promise. Where torch answers as a
    GPU node but has no CUDA kernels (the simulated node of ``make test-gpu-sim``), skip the
    tests marked ``cuda_kernels`` too: they run the model on the GPU torch offers.

    Under pytest-xdist the slow tests go first, so that no long one is left to run alone at the
    end while the other workers wait."""
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (a stable sort)
    if not torch.cuda.is_available():
        return
    if not torch.backends.cuda.is_built():
        for item in items:
            if item.get_closest_marker("cuda_kernels") is not None:
                item.add_marker(pytest.mark.skip(reason="needs CUDA kernels: a simulated GPU"))
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else "holds on the CPU only"
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason}"))
