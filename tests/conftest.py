"""Shared test set-up: vLLM in-process on CPU, and a tiny Qwen2 model built by code (no hub)."""

import os

# vLLM's CPU backend runs in-process (no engine subprocess) and must not look for a hub.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


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


def pytest_collection_modifyitems(config, items):
    """On a CUDA node, skip the tests marked ``cpu_only(reason)`` with their reason: they check
    bit-exact or last-bit equality of two CPU float32 paths, which CUDA kernels (bf16 weights,
    other reduction orders, nondeterministic atomics) do not promise."""
    import torch

    if not torch.cuda.is_available():
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else "holds on the CPU only"
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason}"))
