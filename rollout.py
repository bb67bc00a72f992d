"""Rollouts: G completions per prompt from the current policy, and the engine kept in sync with it.

The RL step (section 5, App. E) samples G = 8 completions per prompt at temperature 1.0, min_p
0.01, top_p 1.0, top_k off. The trainer keeps one ``VLLMEngine`` colocated in its own process:
each step it pushes the policy's weights into the engine in place (``sync_weights``; no checkpoint
on disk), generates, and on CUDA puts the engine to sleep while it updates. Each token's log-prob
is that of the distribution it was sampled from, softmax(logits / T) after the min-p, top-k and
top-p masks (TRL keeps the raw model's); loss.py replays them, so on-policy the two agree.

The weight push (``engine_weights``) merges a LoRA adapter out of place, one layer at a time.
Beside it: machinery/vllm_backend.py (one-line errors, vLLM's fixes, its CPU backend:
docs/vllm-cpu.md), machinery/memory_plan.py (the engine's share of the GPU) and
extras/hf_engine.py (the same interface over transformers ``generate``, backend "hf"; it
imports this file, so this file never imports it: the callers choose the backend).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from machinery import UsageError, memory_plan, vllm_backend
from machinery.vllm_backend import CheckError, check_prompts, check_sampling, push_error_message

# vLLM is imported where an engine starts: the hf backend runs where vLLM is not installed.

BACKENDS = ("vllm", "hf")
# On CUDA the engine shares the GPU with the trainer (TRL's colocate default is 0.3) ...
CUDA_DEFAULT_MEMORY_FRACTION = 0.3
# ... and takes most of it when it runs alone (evaluate.py: n = 256 over a benchmark).
CUDA_STANDALONE_MEMORY_FRACTION = 0.9


class RolloutError(UsageError):
    """A rollout engine cannot do what was asked; the message names the problem and the fix."""


@contextlib.contextmanager
def rollout_errors():
    """Raise the input checks' one-line errors (machinery.vllm_backend) as ``RolloutError``."""
    try:
        yield
    except CheckError as error:
        raise RolloutError(str(error)) from error.__cause__


@dataclass(frozen=True)
class SamplingConfig:
    """The sampler's settings; the defaults are the paper's rollouts (App. E, Table 8): n=8,
    temperature=1.0, min_p=0.01, top_p=1.0, top_k off; its evaluation: temperature=0.3,
    top_p=0.95. vLLM's order: temperature, min-p, top-k, top-p."""

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
        with rollout_errors():
            check_sampling(self)


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
    """log pi(y_t) of each sampled token under the distribution it was sampled from (greedy: the
    raw model's)."""


def request_seeds(seed: int, num_prompts: int) -> list[int]:
    """Per-prompt seeds s_i drawn from ``seed``; completion j of prompt i then uses s_i + j (as
    vLLM seeds child j of a request), so equal prompts in one call still differ.

    >>> request_seeds(3407, 3) == request_seeds(3407, 5)[:3]
    True
    """
    # Leave 2**16 above each seed for the + j of the children.
    high = 2**31 - 2**16
    return [int(s) for s in np.random.default_rng(seed).integers(0, high, size=num_prompts)]


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


def group_completions(
    completions: list[Completion], sampling: SamplingConfig
) -> list[list[Completion]]:
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


# ---- The weight push: the policy's weights under the base model's names ------------------------


def base_weight_name(name: str) -> str | None:
    """The base model's name of a (possibly peft-wrapped) parameter; None for adapter tensors.

    >>> base_weight_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> base_weight_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight")
    >>> base_weight_name("model.norm.weight")
    'model.norm.weight'
    """
    if ".lora_" in name or ".original_module." in name:
        # adapter tensors (merged into the base weight) / the copy modules_to_save replaced
        return None
    name = name.replace("_orig_mod.", "")  # a torch.compile'd model
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def is_peft_model(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def engine_weights(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """The weights to push, an iterator of (base name, tensor), valid inside the ``with`` block,
    each in the engine's ``dtype`` (None: the parameter's own; float32 weights of a
    --full-finetune are cast one tensor at a time into a bf16 engine).

    For a peft model each LoRA layer's merged weight W + scale * B A is computed out of place in
    float32, one layer at a time as the engine consumes them, and cast to the engine's dtype: the
    trainer's base weights are never touched. (peft's merge_adapter / unmerge_adapter, TRL's
    route, adds and subtracts the delta in place; in bf16 W + d - d != W, so the base -- which is
    also the reference policy -- drifts by a rounding error per sync, and a delta below half an
    ulp never reaches the engine.) A full model gives its parameters as they are (cast, if the
    engine's dtype differs). No copy is kept: the engine copies each tensor into its own storage.
    Tied weights appear once.
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
                    yield base, parameter.detach().to(dtype or parameter.dtype)
                    continue
                merged = parameter.detach().float()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        merged = merged + module.get_delta_weight(adapter).float()
                yield base, merged.to(dtype or parameter.dtype)

    yield weights()


# ---- The engine --------------------------------------------------------------------------------


class VLLMEngine:
    """Rollouts from an in-process ``vllm.LLM`` holding the policy's weights. One live engine per
    process: vLLM's distributed state is global, so ``close()`` one before starting the next."""

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
        trainer_bytes: int | None = None,
        **llm_kwargs,
    ):
        vllm_backend.quiet_vllm()  # its warnings only (VLLM_LOGGING_LEVEL=INFO for the rest)
        self.model_path = path = os.fspath(model_path)
        with rollout_errors():
            config = vllm_backend.load_model_config(path)
        self.on_cuda = on_cuda = torch.cuda.is_available()
        self.max_model_len = vllm_backend.context_length(max_model_len, config)
        # Sleep mode needs CUDA (vLLM's CPU worker ignores it); on CPU sleep/wake_up are no-ops.
        self.sleep_mode = on_cuda and (enable_sleep_mode is None or bool(enable_sleep_mode))
        self._asleep: set[str] = set()
        self._weights_discarded = False  # sleep(level=2) dropped them: sync_weights must come first
        # What a weight push casts to (a --full-finetune's float32 weights into a bf16 engine).
        self.weight_dtype = None if dtype == "auto" else getattr(torch, dtype)
        kwargs = dict(
            model=path,
            dtype=dtype,
            max_model_len=self.max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",  # the sampled-from distribution's log-probs
            enforce_eager=(not on_cuda) if enforce_eager is None else enforce_eager,
        )
        starting = contextlib.nullcontext()
        if on_cuda:
            with rollout_errors():  # the trainer's engine holds as much of a step as fits
                fraction, llm_kwargs = memory_plan.gpu_share_and_limits(
                    config,
                    max_model_len=self.max_model_len,
                    llm_kwargs=llm_kwargs,
                    requested=gpu_memory_utilization,
                    default=CUDA_DEFAULT_MEMORY_FRACTION,
                    trainer_bytes=trainer_bytes,
                )
            kwargs.update(gpu_memory_utilization=fraction, enable_sleep_mode=self.sleep_mode)
        else:  # vLLM's CPU backend needs arguments and fixes of its own (docs/vllm-cpu.md)
            with rollout_errors():  # a head size without kernels, or too little RAM
                cpu = vllm_backend.cpu_engine_kwargs(
                    config, gpu_memory_utilization, self.max_model_len, dtype, llm_kwargs
                )
            kwargs.update(cpu)
            starting = vllm_backend.keep_torch_threads()
        vllm_backend.force_in_process_engine()  # the weight push is a function call
        self.llm = self._start({**kwargs, **llm_kwargs}, starting)
        # transformers' tokenizer of the same files (vLLM's get_tokenizer() is a pool wrapper).
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def _start(self, kwargs: dict, starting):
        """``vllm.LLM(**kwargs)`` inside ``starting`` (vLLM names its own start-up failures)."""
        try:
            import vllm
        except ImportError as error:
            message = "vllm is not installed: run `make install`, or use backend='hf'"
            raise RolloutError(message) from error
        with starting:
            return vllm.LLM(**kwargs)

    def sampling_params(self, sampling: SamplingConfig, prompts: list[list[int]]) -> list:
        """One vllm.SamplingParams per prompt: its own seed, and max_tokens within the context."""
        from vllm import SamplingParams

        greedy = sampling.temperature == 0  # vLLM samples greedy requests once (n = 1)
        seeds = [None] * len(prompts)
        if sampling.seed is not None:
            seeds = request_seeds(sampling.seed, len(prompts))
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

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """[num_prompts][n] completions of the given token-id prompts, all in one vLLM call."""
        with rollout_errors():
            check_prompts(prompts, self.max_model_len)
        if self._weights_discarded:
            raise RolloutError(
                "the engine's weights were discarded by sleep(level=2): call sync_weights(model) "
                "before generate"
            )
        self.wake_up()
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": prompt} for prompt in prompts],
                self.sampling_params(sampling, prompts),
                use_tqdm=False,
            )
        except torch.OutOfMemoryError as error:
            raise RolloutError(
                f"out of memory generating {len(prompts)} prompts x n={sampling.n}: pass fewer "
                "prompts per call, lower n or max_tokens, or lower gpu_memory_utilization to "
                "leave room for activations"
            ) from error
        samples = [sample for output in outputs for sample in output.outputs]
        token_ids = [sample.token_ids for sample in samples]
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        completions = []
        for sample, text in zip(samples, texts):
            reason = sample.finish_reason
            if reason not in ("stop", "length"):
                raise RolloutError(f"vLLM ended a completion with finish_reason={reason!r}")
            logprobs = list(sample.logprobs.logprobs)
            completions.append(Completion(list(sample.token_ids), text, reason, logprobs))
        return group_completions(completions, sampling)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the trainer's current weights into the engine in place; reset the prefix cache.

        TRL's order: wake the weights, push, reset the prefix cache (cached KV blocks were computed
        with the old weights). The KV cache wakes at the next ``generate``.
        """
        self.wake_up(["weights"])
        with engine_weights(model, dtype=self.weight_dtype) as weights:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            except (KeyError, AttributeError, ValueError, RuntimeError) as error:
                raise RolloutError(push_error_message(error, self.model_path)) from error
        if not self.on_cuda:
            self.llm.collective_rpc(vllm_backend.repack_cpu_embedding_gemms)
        self.llm.reset_prefix_cache()
        self._weights_discarded = False

    def sleep(self, level: int = 2) -> None:
        """Free the engine's GPU memory while the trainer updates (CUDA only; no-op on CPU).

        Level 2 (the trainer's) drops the weights and the KV cache: ``sync_weights`` pushes every
        weight again before the next ``generate`` (which refuses to run until then). Level 1
        would copy the weights to host memory and back only for the push to overwrite them.
        """
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = level >= 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed, or the ``tags`` of it (no-op when awake or on CPU)."""
        tags = sorted(self._asleep) if tags is None else [t for t in tags if t in self._asleep]
        if tags:
            # Hand PyTorch's cached blocks back to the driver: the engine allocates outside that
            # cache and wakes up into them (TRL does the same).
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)

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

    >>> engine_limits(prompts_per_call=8, n=8, max_prompt_len=512, max_model_len=2048)
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
    old_logps, engine_logps, mask: [B, C]."""
    diff = (old_logps.detach() - engine_logps) * mask
    count = mask.sum().clamp_min(1)
    ratio = torch.exp(diff) * mask
    return {
        "engine/abs_logp_diff": (diff.abs().sum() / count).item(),
        "engine/ratio_mean": (ratio.sum() / count).item(),
        "engine/ratio_max": ratio.max().item(),
    }


def make_engine(
    model_path: str | os.PathLike,
    *,
    max_model_len: int = 2048,
    dtype: str = "auto",
    seed: int = 0,
    model: torch.nn.Module | None = None,
    **engine_kwargs,
) -> VLLMEngine:
    """The vLLM rollout engine for ``model_path`` (backend "vllm"). The "hf" backend's engine
    comes from ``make_engine`` of extras/hf_engine.py, with the same arguments: the callers
    (``sage.start_engine``, ``evaluate.run_evaluation``) pick one by --backend.

    ``model``: the trainer's in-memory model, if any: the engine loads ``model_path`` and then
    syncs ``model`` into it, so it starts from the trainer's current weights. ``engine_kwargs``
    go to the engine: ``gpu_memory_utilization`` (on CUDA its share of the GPU, default 0.3; on
    CPU the share of RAM for the KV cache, default 0.05), ``enable_sleep_mode``,
    ``trainer_bytes`` (on CUDA, what the trainer keeps beside the engine; its sequences at once
    are sized to the rest), ``max_num_seqs``, ...
    """
    engine = VLLMEngine(
        model_path, max_model_len=max_model_len, dtype=dtype, seed=seed, **engine_kwargs
    )
    if model is not None:
        engine.sync_weights(model)
    return engine
