"""Input checks of the rollout engines: the usual failures as one-line errors.

A sampler setting out of range, a missing or corrupt model directory, a prompt that is not token
ids or does not fit the context, an engine that runs out of memory (naming the knob to turn), a
weight push that does not fit the engine's model, and an environment that would move the engine
into another process. The checks raise ``CheckError``; rollout.py, which calls them, raises it
on as ``rollout.RolloutError`` (this module does not import rollout.py: no import cycle).
"""

from __future__ import annotations

import glob
import logging
import numbers
import os
import re
import warnings

import torch


class CheckError(ValueError):
    """A one-line problem with what a rollout engine was given, and the fix."""


def check_sampling(sampling) -> None:
    """Each knob of a ``rollout.SamplingConfig`` in its range (called as it is built, which raises
    the error on as ``RolloutError``).

    >>> import rollout
    >>> rollout.SamplingConfig(top_p=0.0)
    Traceback (most recent call last):
    ...
    rollout.RolloutError: top_p must be in (0, 1] (1 turns it off), got 0.0
    """
    if not isinstance(sampling.n, numbers.Integral) or sampling.n < 1:
        raise CheckError(f"n must be an integer >= 1 (completions per prompt), got {sampling.n!r}")
    if sampling.temperature < 0:
        raise CheckError(f"temperature must be >= 0 (0 is greedy), got {sampling.temperature}")
    if not 0.0 < sampling.top_p <= 1.0:
        raise CheckError(f"top_p must be in (0, 1] (1 turns it off), got {sampling.top_p}")
    if not isinstance(sampling.top_k, numbers.Integral) or sampling.top_k < -1:
        raise CheckError(f"top_k must be -1 (off) or a positive integer, got {sampling.top_k!r}")
    if not 0.0 <= sampling.min_p < 1.0:
        raise CheckError(f"min_p must be in [0, 1) (0 turns it off), got {sampling.min_p}")
    if not isinstance(sampling.max_tokens, numbers.Integral) or sampling.max_tokens < 1:
        raise CheckError(f"max_tokens must be an integer >= 1, got {sampling.max_tokens!r}")
    seed = sampling.seed
    if seed is not None and (not isinstance(seed, numbers.Integral) or seed < 0):
        raise CheckError(f"seed must be None or an integer >= 0, got {seed!r}")


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


def load_model_config(model_path: str | os.PathLike):
    """The model's transformers config, after checking the directory is complete and readable.

    Raises ``CheckError`` for a missing path, an unreadable config.json, no weight files, or a
    corrupt safetensors file (its header and size are checked; nothing is loaded).
    """
    from transformers import AutoConfig

    path = os.fspath(model_path)
    is_local = os.path.isdir(path)
    if not is_local:
        if os.path.exists(path):
            raise CheckError(
                f"model path {path!r} is a file: pass the directory written by save_pretrained"
            )
        if not looks_like_hub_id(path):
            raise CheckError(
                f"model path {path!r} does not exist: pass a directory written by save_pretrained "
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
    if is_local:
        check_weight_files(path)
    return config


def check_weight_files(path: str) -> None:
    """Weight files exist, and each safetensors header reads (a truncated download does not)."""
    from safetensors import safe_open

    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards and not glob.glob(os.path.join(path, "*.bin")):
        raise CheckError(
            f"no weights in {path!r}: expected *.safetensors files written by save_pretrained"
        )
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as weights:
                weights.keys()
        except Exception as error:
            raise CheckError(
                f"corrupt weights file {shard!r} ({one_line(error)}): save the model again"
            ) from error


def context_length(max_model_len: int, config) -> int:
    """max_model_len, capped at the model's max_position_embeddings (with a warning)."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        warnings.warn(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}; "
            f"using {limit}",
            stacklevel=3,
        )
        return int(limit)
    return int(max_model_len)


def check_prompts(prompts, max_model_len: int, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of token ids, each non-empty, in the vocabulary, shorter than the context.

    >>> check_prompts([[1, 2, 3]], max_model_len=4, vocab_size=10)
    [[1, 2, 3]]
    >>> check_prompts([[1, 2, 3, 4]], max_model_len=4, vocab_size=10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    machinery.engine_checks.CheckError: prompt 0 has 4 tokens but the context ...
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise CheckError(
            "prompts must be a non-empty list of token-id lists (apply the chat template and "
            "tokenize first)"
        )
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy":
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
            raise CheckError(
                f"prompt {index} is a {type(prompt).__name__}, not a list of token ids: tokenize "
                "it first (tokenizer.apply_chat_template(messages, add_generation_prompt=True, "
                "tokenize=True))"
            )
        if not prompt:
            raise CheckError(f"prompt {index} is empty: a prompt needs at least one token")
        if len(prompt) >= max_model_len:
            raise CheckError(
                f"prompt {index} has {len(prompt)} tokens but the context (max_model_len) is "
                f"{max_model_len}: shorten the prompt or raise max_model_len (a completion needs "
                "at least one free position)"
            )
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise CheckError(
                f"prompt {index} holds token id {bad}, outside the model's vocabulary "
                f"[0, {vocab_size}): tokenize with the engine's tokenizer"
            )
        checked.append([int(token) for token in prompt])
    return checked


def engine_error_message(error: BaseException, model_path: str) -> str | None:
    """The one-line message for an engine start-up failure we know, None for the others."""
    message = str(error)
    out_of_memory = ("out of memory", "less than desired", "less than requested memory")
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)) or any(
        sign in message for sign in out_of_memory
    ):
        return (
            f"out of memory starting the rollout engine ({one_line(error)}): lower "
            "gpu_memory_utilization (CPU: the share of RAM for the KV cache; GPU: the engine's "
            "share, the trainer needs the rest), or max_model_len"
        )
    no_cache = ("No available memory for the cache blocks", "KV cache is needed")
    if any(sign in message for sign in no_cache):
        return (
            f"the KV cache cannot hold one sequence of max_model_len tokens ({one_line(error)}): "
            "raise gpu_memory_utilization or lower max_model_len"
        )
    unreadable = isinstance(error, (OSError, UnicodeDecodeError))
    if type(error).__name__ == "SafetensorError" or unreadable:
        return (
            f"cannot load the model {model_path!r} ({one_line(error)}): is it a complete, "
            "uncorrupted save_pretrained directory?"
        )
    return None


def push_error_message(error: BaseException, model_path: str) -> str:
    """The one-line message for a failed weight push: out of memory (a RuntimeError too), else an
    architecture mismatch."""
    if isinstance(error, torch.OutOfMemoryError):
        return (
            f"out of memory pushing the weights into the engine ({one_line(error)}): lower "
            "gpu_memory_utilization or the trainer's micro-batch to leave room for the merged "
            "weights"
        )
    return (
        f"cannot push the weights into the engine ({one_line(error)}): sync a model of the "
        f"same architecture as {model_path!r}"
    )


def force_in_process_engine() -> None:
    """Run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), whatever the
    environment says: the weight push hands the trainer's tensors to the engine by a function
    call, which an engine in another process could not receive."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if value != "0":
        warnings.warn(
            f"VLLM_ENABLE_V1_MULTIPROCESSING is set to {value!r}; the colocated engine needs 0, "
            "using 0",
            stacklevel=3,
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


# Layers a weight push has nothing for: the rotary embedding's cos/sin cache is a buffer, and a
# tied lm_head is the embedding, which the push fills (vLLM puts their own tensors back).
NOTHING_TO_PUSH = ("RotaryEmbedding", "ParallelLMHead")


class _NothingToPush(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for the layers of ``NOTHING_TO_PUSH``."""

    def filter(self, record: logging.LogRecord) -> bool:
        layer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not ("Failed to load weights" in record.msg and layer in NOTHING_TO_PUSH)


def quiet_vllm() -> None:
    """vLLM logs INFO lines at every start, weight reload and cache reset: keep its warnings only
    (VLLM_LOGGING_LEVEL=INFO brings the rest back), and drop the two warnings every push raises
    for layers without weights to push (harmless: greedy output after a push equals HF's, a test
    checks it). Call before vLLM is imported: it reads the level once."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _NothingToPush) for f in reload_logger.filters):
        reload_logger.addFilter(_NothingToPush())
