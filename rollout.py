"""vLLM rollouts with weight syncing: G completions per prompt from the current policy.

The RL step (section 5, App. E) samples G = 8 completions per prompt at temperature 1.0, min_p
0.01, top_p 1.0, top_k off. The trainer keeps one ``VLLMEngine`` colocated in its own process:
each step it pushes the policy's weights into the engine in place (``sync_weights``; no checkpoint
on disk), generates, and on CUDA puts the engine to sleep while it updates. Each token's log-prob
is that of the distribution it was sampled from, softmax(logits / T) after the min-p, top-k and
top-p masks (TRL keeps the raw model's); loss.py replays them, so on-policy the two agree.

Beside it: machinery/vllm_backend.py (one-line errors, vLLM's fixes, its CPU backend:
docs/vllm-cpu.md), machinery/memory_plan.py (the engine's share of the GPU) and
extras/hf_engine.py (the same interface over transformers ``generate``, backend "hf"; it
imports this file, so this file never imports it: the callers choose the backend).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from machinery import cli, memory_plan, vllm_backend
from machinery.vllm_backend import check_prompts, one_line

# vLLM and transformers are imported where an engine starts: flags are refused before either
# loads, and the hf backend runs where vLLM is not installed.

BACKENDS = ("vllm", "hf")
# On CUDA the engine shares the GPU with the trainer (TRL's colocate default is 0.3) ...
CUDA_DEFAULT_MEMORY_FRACTION = 0.3
# ... and takes most of it when it runs alone (evaluate.py: n = 256 over a benchmark).
CUDA_STANDALONE_MEMORY_FRACTION = 0.9
# A rollout engine cannot do what was asked: one line naming the problem and the fix.
RolloutError = vllm_backend.CheckError


@dataclass(frozen=True)
class SamplingConfig:
    """The sampler's settings; the defaults are the paper's rollouts (App. E, Table 8): n=8,
    temperature=1.0, min_p=0.01, top_p=1.0, top_k off; its evaluation: temperature=0.3,
    top_p=0.95. vLLM's order: temperature, min-p, top-k, top-p."""

    n: int = field(default=8, metadata={"range": ">= 1"})
    """Completions per prompt (the group size G)."""
    temperature: float = field(default=1.0, metadata={"range": ">= 0"})
    """Softmax temperature T; 0 samples greedily."""
    top_p: float = field(default=1.0, metadata={"range": "in (0, 1]"})
    """Nucleus mass kept (1.0: off)."""
    top_k: int = field(default=-1, metadata={"range": ">= -1"})
    """Most likely tokens kept (-1 or 0: off)."""
    min_p: float = field(default=0.01, metadata={"range": "in [0, 1)"})
    """Keep v with pi_T(v) >= min_p * max pi_T (0: off)."""
    max_tokens: int = field(default=256, metadata={"range": ">= 1"})
    """Completion length limit; a completion cut there has finish_reason "length"."""
    seed: int | None = None
    """Same seed, same samples (per backend); None draws from the engine's RNG."""

    def __post_init__(self):
        if (problem := cli.field_problem(self)) is not None:  # the fields' ranges
            raise RolloutError(problem)


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
    """Flat completions, grouped by prompt, into [num_prompts][n]. Engines sample greedy (T = 0)
    prompts once: that completion is repeated n times here (as copies: callers may edit them)."""
    if sampling.temperature == 0:
        return [[copy.deepcopy(c) for _ in range(sampling.n)] for c in completions]
    return [completions[i : i + sampling.n] for i in range(0, len(completions), sampling.n)]


# ---- The engine --------------------------------------------------------------------------------


class VLLMEngine:
    """Rollouts from an in-process ``vllm.LLM`` holding the policy's weights. One live engine per
    process: vLLM's distributed state is global, so ``close()`` one before starting the next.

    It loads ``model_path``, then takes ``model``'s weights if given (the trainer's in-memory
    model). ``gpu_memory_utilization``: on CUDA its share of the GPU (default 0.3; the trainer's
    engine, given its step's limits, enough for the step's sequences, at least 0.3), on CPU the
    share of RAM for its KV cache (default 0.05); ``trainer_bytes``: on CUDA what the trainer
    keeps beside it, whose sequences at once are sized to the rest (memory_plan.py);
    ``llm_kwargs`` go to ``vllm.LLM`` over the defaults below (``max_num_seqs``,
    ``enable_sleep_mode``, ``enforce_eager``, ...).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        max_model_len: int = 2048,
        dtype: str = "auto",
        gpu_memory_utilization: float | None = None,
        seed: int = 0,
        model: torch.nn.Module | None = None,
        trainer_bytes: int | None = None,
        **llm_kwargs,
    ):
        vllm_backend.quiet_vllm()  # its warnings only (VLLM_LOGGING_LEVEL=INFO for the rest)
        vllm_backend.force_in_process_engine()  # the weight push is a function call
        self.model_path = os.fspath(model_path)
        config = vllm_backend.load_model_config(self.model_path)
        self.max_model_len = vllm_backend.context_length(max_model_len, config)
        try:
            import vllm
        except ImportError as error:
            message = "vllm is not installed: run `make install`, or use backend='hf'"
            raise RolloutError(message) from error
        self.on_cuda = torch.cuda.is_available()
        if self.on_cuda:  # the trainer's engine holds as much of a step as fits
            share, llm_kwargs = memory_plan.gpu_share_and_limits(
                config,
                max_model_len=self.max_model_len,
                llm_kwargs=llm_kwargs,
                requested=gpu_memory_utilization,
                default=CUDA_DEFAULT_MEMORY_FRACTION,
                trainer_bytes=trainer_bytes,
            )
            device_kwargs = {"gpu_memory_utilization": share}
        else:  # vLLM's CPU backend needs arguments of its own (docs/vllm-cpu.md)
            device_kwargs = vllm_backend.cpu_engine_kwargs(
                config, gpu_memory_utilization, self.max_model_len, dtype, llm_kwargs
            )
        kwargs = {
            "model": self.model_path,
            "dtype": dtype,
            "max_model_len": self.max_model_len,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",  # the sampled-from distribution's log-probs
            "enforce_eager": not self.on_cuda,  # CPU: no compile at each start (vllm-cpu.md)
            "enable_sleep_mode": self.on_cuda,  # vLLM's CPU worker has none
            **device_kwargs,
            **llm_kwargs,
        }
        self.sleep_mode = kwargs["enable_sleep_mode"]
        self._asleep: set[str] = set()
        self._weights_discarded = False  # sleep(level=2) dropped them: sync_weights must come first
        # What a weight push casts to (a --full-finetune's float32 weights into a bf16 engine).
        self.weight_dtype = None if dtype == "auto" else getattr(torch, dtype)
        with vllm_backend.keep_torch_threads():
            self.llm = vllm.LLM(**kwargs)  # vLLM names its own start-up failures
        # transformers' tokenizer of the same files (vLLM's get_tokenizer() is a pool wrapper).
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if model is not None:
            self.sync_weights(model)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """[num_prompts][n] completions of the given token-id prompts, all in one vLLM call.

        With a seed, prompt i gets its own seed s_i drawn from it (2**16 left above each), and
        vLLM seeds completion j of the prompt with s_i + j: equal prompts in one call still
        differ. A completion that reaches the end of the context ends there, finish_reason
        "length" (vLLM's own check).
        """
        from vllm import SamplingParams

        check_prompts(prompts, self.max_model_len)
        if self._weights_discarded:
            raise RolloutError(
                "the engine's weights were discarded by sleep(level=2): call sync_weights(model) "
                "before generate"
            )
        self.wake_up()
        seeds = np.random.default_rng(sampling.seed).integers(2**31 - 2**16, size=len(prompts))
        params = [
            SamplingParams(
                n=1 if sampling.temperature == 0 else sampling.n,  # greedy: once, then copies
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),
                min_p=sampling.min_p,
                max_tokens=sampling.max_tokens,
                seed=None if sampling.seed is None else int(seed),
                logprobs=0,  # the sampled token's log-prob only
                flat_logprobs=True,  # plain lists, no per-token dict
                detokenize=False,  # decoded once, in one batch, below
            )
            for seed in seeds
        ]
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False
            )
        except torch.OutOfMemoryError as error:
            raise RolloutError(
                f"out of memory generating {len(prompts)} prompts x n={sampling.n}: pass fewer "
                "prompts per call, lower n or max_tokens, or lower gpu_memory_utilization to "
                "leave room for activations"
            ) from error
        samples = [sample for output in outputs for sample in output.outputs]
        texts = self.tokenizer.batch_decode(
            [s.token_ids for s in samples], skip_special_tokens=True
        )
        completions = [
            Completion(list(s.token_ids), text, s.finish_reason, list(s.logprobs.logprobs))
            for s, text in zip(samples, texts)
        ]
        return group_completions(completions, sampling)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the trainer's current weights (``engine_weights``) into the engine in place.

        TRL's order: wake the weights, push, reset the prefix cache (cached KV blocks were computed
        with the old weights). The KV cache wakes at the next ``generate``.
        """
        self.wake_up(["weights"])
        weights = engine_weights(model, dtype=self.weight_dtype)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except torch.OutOfMemoryError as error:
            raise RolloutError(
                f"out of memory pushing the weights into the engine ({one_line(error)}): lower "
                "gpu_memory_utilization or the trainer's micro-batch to leave room for the merged "
                "weights"
            ) from error
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


# ---- The weight push: the policy's weights under the base model's names ------------------------


@torch.no_grad()
def engine_weights(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """The weights to push, (the base model's name, tensor) one at a time, each in the engine's
    ``dtype`` (None: the parameter's own; a --full-finetune's float32 weights go into a bf16
    engine one tensor at a time). Tied weights appear once; no copy is kept: the engine copies
    each tensor into its own storage.

    A LoRA layer's weight is merged out of place, W + scale * B A in float32 (peft's
    ``get_delta_weight``): the trainer's base weights, also the reference policy, are never
    touched. (peft's merge_adapter / unmerge_adapter adds and subtracts the delta in place, and
    in bf16 W + d - d != W: docs/implementation.md, item 18.)
    """
    for name, parameter in model.named_parameters():
        if ".lora_" in name:  # the adapter's A and B, merged into their base weight below
            continue
        weight = parameter.detach()
        if name.endswith(".base_layer.weight"):  # a LoRA layer's W
            layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
            weight = weight.float() + layer.get_delta_weight("default").float()
        base_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        yield base_name, weight.to(dtype or parameter.dtype)


# ---- Starting one ------------------------------------------------------------------------------


# The trainer's and evaluate.py's engine for backend "vllm": extras/hf_engine.py has the "hf"
# backend's ``make_engine``, with the same arguments (the callers pick one by --backend).
make_engine = VLLMEngine


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


# ---- The engine's log-probs in the trainer -----------------------------------------------------


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
