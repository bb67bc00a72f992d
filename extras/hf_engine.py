"""The hf rollout backend: ``rollout.VLLMEngine``'s interface over transformers ``generate``.

For machines without vLLM (``--backend hf``), and the reference the tests compare vLLM with.
Same sampling semantics: the processors run in vLLM's order (temperature, min-p, top-k, top-p;
transformers' own order puts min-p last, and top-p after min-p is not top-p before it), and each
token's log-prob is that of the distribution it was sampled from. Same seed, same samples, but
not vLLM's samples: the two backends draw from different RNGs.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from loss import attend_somewhere_under_sdpa
from machinery.vllm_backend import check_prompts, context_length, load_model_config
from rollout import Completion, RolloutError, SamplingConfig, engine_weights, group_completions


def sampling_processors(sampling: SamplingConfig) -> list:
    """transformers logits processors in vLLM's order: temperature, min-p, top-k, top-p."""
    if sampling.temperature == 0:
        return []  # greedy: argmax of the raw logits
    processors = []
    if sampling.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(float(sampling.temperature)))  # (it takes no int)
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
        self.model_path = path = os.fspath(model_path)
        config = load_model_config(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        attend_somewhere_under_sdpa()  # its batches are left-padded
        if model is None:
            torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
            model.eval()
        self.model = model
        self.max_model_len = context_length(max_model_len, config)
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
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """[num_prompts][n] completions; prompts are left-padded into one batch."""
        check_prompts(prompts, self.max_model_len)
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
                f"out of memory generating {len(prompts)} prompts x n={sampling.n} with "
                "transformers: pass fewer prompts per call, or lower n or max_tokens"
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
        cut = budget.clamp(max=completion_ids.shape[1])
        lengths = torch.where(stopped, first_eos + 1, cut).tolist()
        rows, row_logprobs = completion_ids.tolist(), logprobs.tolist()
        token_ids = [row[:length] for row, length in zip(rows, lengths)]
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        completions = [
            Completion(ids, text, "stop" if stop else "length", lps[:length])
            for ids, text, stop, lps, length in zip(
                token_ids, texts, stopped.tolist(), row_logprobs, lengths
            )
        ]
        return group_completions(completions, sampling)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy the trainer's weights into this engine's model (a no-op if it is that model)."""
        if model is self.model:
            return
        if isinstance(self.model, PeftModel):
            raise RolloutError(
                "this hf engine generates through a peft model, it cannot take other weights: "
                "pass the trainer's model itself as make_engine(model=...)"
            )
        targets = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in engine_weights(model):
                if name not in targets or targets[name].shape != tensor.shape:
                    raise RolloutError(
                        f"weight {name} {tuple(tensor.shape)} does not fit the engine's model: "
                        f"sync a model of the same architecture as {self.model_path!r}"
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


# What only vLLM's engine takes: its share of the memory, sleep mode, the trainer's bytes beside it.
VLLM_ONLY = ("gpu_memory_utilization", "enable_sleep_mode", "trainer_bytes")


def make_engine(
    model_path: str | os.PathLike,
    *,
    max_model_len: int = 2048,
    dtype: str = "auto",
    seed: int = 0,
    model: torch.nn.Module | None = None,
    **engine_kwargs,
) -> HFEngine:
    """The hf rollout engine, with ``rollout.make_engine``'s arguments (``--backend hf``): it
    generates through ``model``, the trainer's in-memory model, if given, and ignores the vLLM
    engine's ``gpu_memory_utilization``, ``enable_sleep_mode`` and ``trainer_bytes``."""
    kwargs = {name: value for name, value in engine_kwargs.items() if name not in VLLM_ONLY}
    return HFEngine(
        model_path, max_model_len=max_model_len, dtype=dtype, seed=seed, model=model, **kwargs
    )
