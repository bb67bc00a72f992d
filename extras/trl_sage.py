"""SAGE on TRL's GRPOTrainer: the same guides and the same loss, on an engine that scales out.

    python -m extras.trl_sage --model Qwen/Qwen2.5-Math-7B --guide branch    # one process
    accelerate launch --multi_gpu --num_processes 8 -m extras.trl_sage --model ... --use-vllm

Launching on several GPUs and nodes: docs/scaling-out.md.

sage.py is the tutorial and the single-GPU run, one process. Past one GPU (8 GPUs on a node,
several nodes), this module runs SAGE on TRL's ``GRPOTrainer`` under ``accelerate`` (DDP,
DeepSpeed ZeRO, FSDP), with vLLM colocated or as a server. TRL does generation, rewards,
advantages, batching, distribution and checkpointing; SAGE adds only what makes it SAGE:

* ``SageGRPOTrainer.compute_loss`` (transformers' public hook) runs TRL's own log-prob pass, which
  also returns the full-vocabulary entropies of the update's forward pass (Eq. 12); the guide's
  ``log_q`` comes from ``guides.compute_log_q`` on those signals and is held fixed for the batch
  (Eq. 3); the loss is ``loss.policy_loss`` with TRL's loss type mapped to our aggregation. So every
  guide and every in-loss estimator (k3, k2, ratio_k3) runs here unchanged, none re-typed.
* ``--kl-estimator k1_return`` puts the sequence-level k1 into the return *before* the advantage
  (the estimator that realizes Eq. 4). TRL forms advantages inside its generation step, so the KL
  enters as one more reward function (TRL's public extension point), which TRL sums with the task
  reward before group normalization, as sage.py does.

The one private method used is ``GRPOTrainer._get_per_token_logps_and_entropies`` (called, never
overridden), so the loss sees the same log-probs TRL uses for its old and reference log-probs; a
test fails, naming the pinned ``TRL_VERSION``, when its signature changes. Metrics are gathered
over processes and merged into TRL's logs through the public ``log`` hook.

What differs from sage.py (docs/scaling-out.md): the sampler's min-p is not replayed in TRL's
log-probs (with min-p > 0 the update is slightly off-policy); advantages are TRL's (grpo and
dr_grpo: no RLOO, no Beta-normalized BNPO); DAPO's dynamic sampling is not available; the prompt
order is TRL's sampler's; the warmup is transformers' linear schedule (learning rate 0 at step 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import trl
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer

import guides
import loss
import sage
from machinery import cli, runs
from machinery.models import attention_implementation
from sage import LORA_TARGETS
from task.grading import RewardError, load_reward_function
from task.problems import SYSTEM_PROMPT, DataError, build_prompt_ids, load_rows, training_problems

TRL_VERSION = "1.16.0"
"""The TRL release this module is written and tested against (one private method, see above)."""
# Our aggregation names <-> TRL's loss_type (loss.aggregate; TRL's "bnpo" is a batch token mean).
LOSS_TYPES = {"grpo": "grpo", "batch_token_mean": "bnpo", "dr_grpo": "dr_grpo", "dapo": "dapo"}
AGGREGATIONS = {trl_name: ours for ours, trl_name in LOSS_TYPES.items()}
# Our advantages -> TRL's scale_rewards (group std = GRPO, none = Dr. GRPO).
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}
# Inputs of a vision-language batch: this integration is text-only.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)

# --------------------------------------------------------------------------------------------
# 1. The trainer: TRL's, with SAGE's anchor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SageSettings:
    """What SAGE adds to a GRPOConfig; beta, clip range, loss type and sampling stay TRL's."""

    guide: guides.GuideConfig = guides.GuideConfig()
    """The guide q (guides.py): none | random | token | branch, and their parameters."""
    kl: str = "reverse"
    """reverse | forward | none (loss.anchor_penalty)."""
    kl_estimator: str = "k3"
    """k3 (paper) | k2 | ratio_k3 (TRL's use_bias_correction_kl) | k1_return (in the return)."""


def unsupported(args: GRPOConfig, settings: SageSettings) -> list[str]:
    """One line per GRPOConfig / SageSettings combination this integration does not run."""
    problems = []
    if args.loss_type not in AGGREGATIONS:
        problems.append(
            f"loss_type={args.loss_type!r} is not supported: use one of {', '.join(AGGREGATIONS)}"
        )
    if args.importance_sampling_level != "token":
        problems.append(
            "importance_sampling_level='sequence' (GSPO) is not supported: "
            "loss.policy_loss is per token"
        )
    for name, default in (
        ("top_entropy_quantile", 1.0),
        ("off_policy_mask_threshold", None),
        ("delta", None),
        ("entropy_coef", 0.0),
        ("use_adaptive_entropy", False),
    ):
        if getattr(args, name, default) != default:
            problems.append(
                f"{name}={getattr(args, name)!r} is not supported by the SAGE loss; "
                f"leave it at {default!r}"
            )
    if settings.kl not in loss.KL_MODES:
        problems.append(f"unknown kl {settings.kl!r}: choose one of {', '.join(loss.KL_MODES)}")
    if settings.kl_estimator not in loss.KL_ESTIMATORS:
        problems.append(
            f"unknown kl estimator {settings.kl_estimator!r}: "
            f"choose one of {', '.join(loss.KL_ESTIMATORS)}"
        )
    if settings.guide.name != "none" and (settings.kl == "none" or args.beta == 0):
        problems.append(
            f"guide {settings.guide.name!r} acts only through the KL anchor: "
            "use kl='reverse' with beta > 0"
        )
    if settings.kl_estimator == "k1_return" and settings.kl == "forward":
        problems.append("kl_estimator='k1_return' is the reverse KL's: use kl='reverse'")
    return problems


def guide_generator(seed: int, step: int, rank: int, call: int) -> torch.Generator:
    """The random stream of the random and token guides for one (step, process, call): a pure
    function, so a resumed or re-sharded run draws the same q with no generator state to save.

    >>> a, b = guide_generator(0, 3, 1, 0), guide_generator(0, 3, 1, 0)
    >>> bool(torch.equal(torch.rand(2, generator=a), torch.rand(2, generator=b)))
    True
    """
    digest = hashlib.sha256(f"sage-guide/{seed}/{step}/{rank}/{call}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class SageGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is ``loss.policy_loss`` against the anchor p~ = pi_ref * q.

    Arguments are GRPOTrainer's, plus ``sage`` (SageSettings). From the GRPOConfig it reads beta,
    epsilon / epsilon_high, loss_type (-> aggregation) and the vLLM importance-sampling ratio
    (-> loss.HeldFixed's importance_weights); TRL's scale_rewards is the advantage.
    """

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        *,
        sage: SageSettings | None = None,
        **kwargs,
    ):
        self.sage = sage or SageSettings()
        args = args or GRPOConfig(output_dir="trl_sage_output")
        problems = unsupported(args, self.sage)
        if problems:
            raise ValueError(problems[0])
        self.sage_beta = args.beta if self.sage.kl != "none" else 0.0
        in_return = self.sage.kl_estimator == "k1_return" and self.sage_beta > 0
        reward_funcs = [] if reward_funcs is None else reward_funcs
        reward_funcs = (
            list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        )
        if in_return:  # KL in the return: a reward, summed with the task's before normalization
            reward_funcs.append(self.kl_return)
            if args.reward_weights is not None:
                args.reward_weights = [*args.reward_weights, 1.0]
        self._sage_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._guide_calls = (-1, 0)  # (optimizer step, guide draws on this process in that step)
        super().__init__(model, reward_funcs, args, **kwargs)
        if in_return or self.sage_beta == 0:
            # TRL's generation step computes reference log-probs iff self.beta != 0; with the KL
            # in the return the loss needs none, so that pass is skipped (kl_return scores the
            # reference itself).
            self.beta = 0.0

    # ---- the guide, held fixed for the batch ---------------------------------------------------

    def _total_steps(self) -> int:
        return max(1, self.state.max_steps or self.args.max_steps)

    def _next_generator(self) -> torch.Generator:
        step, calls = self._guide_calls
        calls = calls + 1 if step == self.state.global_step else 0
        self._guide_calls = (self.state.global_step, calls)
        return guide_generator(
            self.args.seed, self.state.global_step, self.accelerator.process_index, calls
        )

    def _log_q(
        self, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor
    ):
        """log q_t from the sampling policy's signals, computed once per batch and kept in
        ``inputs`` so that it stays fixed when TRL reuses the batch (num_iterations > 1)."""
        if (
            self.sage.guide.name == "none"
            or self.sage_beta == 0
            or self.sage.kl_estimator == "k1_return"
        ):
            return None
        if "sage_log_q" not in inputs:
            old_logps = inputs.get("old_per_token_logps")
            signal = (old_logps if old_logps is not None else logps).detach()
            inputs["sage_log_q"] = guides.compute_log_q(
                self.sage.guide,
                signal,
                entropies.detach(),
                mask,
                self.state.global_step,
                self._total_steps(),
                self._next_generator(),
            )
        return inputs["sage_log_q"]

    # ---- the loss (transformers' public hook) ------------------------------------------------

    def _loss_config(self, aggregation: str) -> loss.LossConfig:
        """loss.policy_loss's knobs from the GRPOConfig (beta, epsilon, epsilon_high, the loss type
        mapped to ``aggregation``, max_completion_length) and SageSettings (kl, kl_estimator); with
        k1_return the KL is in the return (``kl_return``), so the loss has none. TRL forms the
        advantages itself, so LossConfig.advantage is not read here."""
        in_loss = self.sage.kl_estimator != "k1_return"
        return loss.LossConfig(
            aggregation=aggregation,
            eps_low=self.epsilon_low,
            eps_high=self.epsilon_high,
            kl=self.sage.kl if in_loss else "none",
            kl_estimator=self.sage.kl_estimator,
            beta=self.sage_beta,
            max_completion_length=self.max_completion_length,
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("SageGRPOTrainer does not return outputs")
        if any(key in inputs for key in MULTIMODAL_KEYS):
            raise NotImplementedError(
                "trl_sage is text-only: multimodal inputs are not passed to the model"
            )
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]  # [B, C]
        completion_mask = inputs["completion_mask"]  # [B, C]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # [B, P + C]
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        # TRL's log-prob pass (temperature-scaled, fused LM head) is the update's forward pass, with
        # the full-vocabulary entropies the guide needs. The one private call.
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
        )
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        empty = not bool(mask.any())
        if empty:  # e.g. every completion masked: a zero, connected to the graph (same collectives)
            mask = torch.ones_like(mask)
        log_q = self._log_q(inputs, logps, entropies, mask)
        old_logps = inputs.get("old_per_token_logps")
        # present iff TRL's vLLM IS correction is on
        importance = inputs.get("importance_sampling_ratio")
        aggregation = AGGREGATIONS[self.loss_type]
        # Set by the Trainer's loop; before it (a direct call) it is the configured value.
        accumulation = getattr(
            self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps
        )
        accumulation = accumulation if mode == "train" else 1
        global_tokens = None
        if aggregation == "dapo":
            # TRL's normalizer: the generation batch's tokens over all processes, per process (DDP
            # averages gradients), rescaled to one accumulation window.
            global_tokens = (
                inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            )
            if mode == "train":
                global_tokens = global_tokens * accumulation / self.args.steps_per_generation
        in_loss = self.sage.kl_estimator != "k1_return"
        fixed = loss.HeldFixed(
            old_logps if old_logps is not None else logps.detach(),
            ref_logps=inputs.get("ref_per_token_logps") if in_loss else None,
            log_q=log_q,
            entropies=entropies,
            importance_weights=None if importance is None else importance.expand_as(mask),
        )
        value, metrics = loss.policy_loss(
            logps,
            inputs["advantages"],
            mask,
            fixed,
            self._loss_config(aggregation),
            global_tokens,
        )
        constant_q = self.sage.guide.name in ("branch", "random")  # q: one number per position
        metrics |= loss.anchor_offset(log_q, mask, q_constant=constant_q)
        if aggregation != "dapo":  # TRL scales its loss for accumulation (loss_is_scaled_for_ga)
            value = value / accumulation
        if self.aux_loss_enabled:
            value = value + self.router_aux_loss_coef * aux_loss / accumulation
        if empty:
            value = value * 0.0
            metrics = {key: math.nan for key in metrics}
        metrics.pop("loss")  # the Trainer logs the loss itself
        self._record(mode, metrics)
        return value

    # ---- the KL in the return (k1_return), as a reward function --------------------------------

    @torch.no_grad()
    def kl_return(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        """-beta * sum_t (log pi(y_t) - log pi_ref(y_t) - log q_t) per completion: the
        sequence-level k1 of the pseudo-KL counted in the return (loss.kl_shaped_rewards, realizes
        Eq. 4).

        TRL calls it with this process's completions before the advantage. It scores them under the
        current policy (with entropies, for the guide) and the reference (the adapter off, or TRL's
        frozen copy for a full fine-tune): the same two passes as sage.py's k1_return.
        """
        from trl.data_utils import is_conversational
        from trl.trainer.utils import pad, use_adapter

        device = self.accelerator.device
        # GRPOTrainer._tokenize_prompts' tokenization
        if is_conversational({"prompt": prompts[0]}):
            prompt_ids = self.processing_class.apply_chat_template(
                conversation=prompts,
                tools=self.tools or None,
                chat_template=self.chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **self.chat_template_kwargs,
            )["input_ids"]
        else:
            prompt_ids = self.processing_class(text=prompts)["input_ids"]
        pad_id = self.processing_class.pad_token_id
        prompt_rows = [torch.tensor(ids) for ids in prompt_ids]
        completion_rows = [torch.tensor(ids, dtype=torch.long) for ids in completion_ids]
        prompt_tensor = pad(  # [B, P]
            prompt_rows, padding_value=pad_id, padding_side="left"
        ).to(device)
        prompt_mask = pad(
            [torch.ones_like(t) for t in prompt_rows], padding_value=0, padding_side="left"
        ).to(device)
        completion_tensor = pad(  # [B, C]
            completion_rows, padding_value=pad_id, padding_side="right"
        ).to(device)
        mask = pad(
            [torch.ones_like(t) for t in completion_rows], padding_value=0, padding_side="right"
        ).to(device)
        input_ids = torch.cat([prompt_tensor, completion_tensor], dim=1)
        attention_mask = torch.cat([prompt_mask, mask], dim=1)
        length, batch = completion_tensor.size(1), self.args.per_device_train_batch_size
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            self.model, input_ids, attention_mask, length, batch_size=batch, compute_entropy=True
        )
        if self.ref_model is not None:
            ref_logps, _, _ = self._get_per_token_logps_and_entropies(
                self.ref_model, input_ids, attention_mask, length, batch_size=batch
            )
        else:
            unwrapped = self.accelerator.unwrap_model(self.model)
            with use_adapter(
                unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None
            ):
                ref_logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, length, batch_size=batch
                )
        log_q = guides.compute_log_q(
            self.sage.guide,
            logps,
            entropies,
            mask,
            self.state.global_step,
            self._total_steps(),
            self._next_generator(),
        )
        shaped = loss.kl_shaped_rewards(
            torch.zeros(len(prompts), device=device), logps, ref_logps, log_q, mask, self.sage_beta
        )
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:
            weights = mask.float()
            count = weights.sum().clamp_min(1.0)
            log_metric("kl/ref_k1", (((logps - ref_logps) * weights).sum() / count).item())
            log_metric(
                "kl/anchor_k1", (((logps - ref_logps - log_q) * weights).sum() / count).item()
            )
            if self.sage.guide.name != "none":
                log_metric("q/mean", ((log_q.exp() * weights).sum() / count).item())
        return shaped.tolist()

    # ---- metrics: gathered over processes, merged into TRL's logs -----------------------------

    def _record(self, mode: str, metrics: dict[str, float]) -> None:
        keys = sorted(metrics)
        values = torch.tensor(
            [[metrics[k] for k in keys]], dtype=torch.float32, device=self.accelerator.device
        )
        gathered = self.accelerator.gather(values).view(-1, len(keys))  # [processes, metrics]
        for column, key in enumerate(keys):
            column_values = gathered[:, column]
            if key.endswith("min"):
                value = column_values.nan_to_num(math.inf).min().item()
            elif key.endswith("max"):
                value = column_values.nan_to_num(-math.inf).max().item()
            else:
                value = column_values.nanmean().item()
            self._sage_metrics[mode][key].append(value if math.isfinite(value) else math.nan)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        for key, values in self._sage_metrics[mode].items():
            valid = [v for v in values if not math.isnan(v)]
            if not valid:
                logs[prefix + key] = None
            elif key.endswith("min"):
                logs[prefix + key] = min(valid)
            elif key.endswith("max"):
                logs[prefix + key] = max(valid)
            else:
                logs[prefix + key] = sum(valid) / len(valid)
        self._sage_metrics[mode].clear()
        super().log(logs, start_time)


# --------------------------------------------------------------------------------------------
# 2. The task on TRL: chat prompts, the project's reward with TRL's calling convention
# --------------------------------------------------------------------------------------------


def prompt_messages(problem: str) -> list[dict]:
    """The paper's system prompt and the problem (App. E.4); TRL applies the chat template, which
    gives the same token ids as task.build_prompt_ids (tested)."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]


def trl_reward(reward_function):
    """Our reward (task.load_reward_function: completions, problems, answers -> floats) with TRL's
    calling convention: completions as chat messages or text, the dataset's columns as keywords."""

    def reward(prompts, completions, problem, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward_function(texts, problem, answer)

    reward.__name__ = getattr(reward_function, "__name__", "reward")
    return reward


def training_dataset(args: TRLArgs, tokenizer):
    """sage.py's training problems as a TRL dataset (chat prompts, problem and answer columns);
    prompts longer than --max-prompt-len are dropped, as sage.py drops them."""
    import datasets

    rows = load_rows(args.dataset, args.dataset_config)
    problems = training_problems(
        rows, args.problem_key, args.answer_key, args.max_train_samples, args.dataset
    )
    kept = [
        p for p in problems if len(build_prompt_ids(tokenizer, p["problem"])) <= args.max_prompt_len
    ]
    if not kept:
        raise DataError(
            f"every training prompt is longer than --max-prompt-len {args.max_prompt_len}: raise it"
        )
    return datasets.Dataset.from_list(
        [
            {
                "prompt": prompt_messages(p["problem"]),
                "problem": p["problem"],
                "answer": p["answer"],
            }
            for p in kept
        ]
    )


# --------------------------------------------------------------------------------------------
# 3. The command line: sage.py's names and defaults for the shared knobs, plus TRL's own
# --------------------------------------------------------------------------------------------


@dataclass
class TRLArgs:
    """python -m extras.trl_sage --model PATH --guide branch ... (or under accelerate launch)."""

    model: str
    """Policy: a hub name or a local model directory."""
    dataset: str = sage.Config.dataset
    """Training problems: a hub dataset or a local .jsonl/.json/.parquet/.csv file."""
    dataset_config: str = sage.Config.dataset_config
    """Hub dataset configuration name."""
    problem_key: str = sage.Config.problem_key
    """Field holding the problem."""
    answer_key: str = sage.Config.answer_key
    """Field holding the reference answer."""
    max_train_samples: int = sage.Config.max_train_samples
    """Use the first N training problems (paper: 2,000)."""
    reward: str = sage.Config.reward
    """The reward: empty for Math-Verify, else module:function or file.py:function
    (as in sage.py)."""
    guide: str = guides.GuideConfig.name
    """none | random (Eq. 9) | token (Eq. 10) | branch (Eq. 11)."""
    tau: float = guides.GuideConfig.tau
    """Branch guide: entropy threshold in nats."""
    ratio: float = guides.GuideConfig.ratio
    """Branch guide: slope above the threshold."""
    q_min: float = guides.GuideConfig.q_min
    """Guide clamp, lower."""
    q_max: float = guides.GuideConfig.q_max
    """Guide clamp, upper."""
    token_normalization: str = guides.GuideConfig.token_normalization
    """Token guide: how entropies are normalized (as in sage.py)."""
    kl: str = "reverse"
    """reverse | forward | none."""
    kl_estimator: str = loss.LossConfig.kl_estimator
    """k3 (paper) | k2 | ratio_k3 | k1_return (the KL in the return, through a reward function)."""
    beta: float = loss.LossConfig.beta
    """KL coefficient."""
    advantage: str = "grpo"
    """grpo | dr_grpo (TRL computes the advantages: group std, or none)."""
    loss_agg: str = "grpo"
    """grpo | batch_token_mean | dr_grpo | dapo."""
    eps_low: float = loss.LossConfig.eps_low
    """Lower clip of the ratio."""
    eps_high: float = 0.2
    """Upper clip of the ratio."""
    tis_cap: float = loss.LossConfig.tis_cap
    """vLLM only: per-token truncated importance sampling min(pi_old / pi_engine, C); 0: off."""
    lr: float = sage.Config.lr
    """AdamW learning rate."""
    weight_decay: float = sage.Config.weight_decay
    """AdamW weight decay."""
    warmup_ratio: float = sage.Config.warmup_ratio
    """Linear warmup over this fraction of the steps, then linear decay."""
    max_grad_norm: float = sage.Config.max_grad_norm
    """Gradient clipping."""
    lora_rank: int = sage.Config.lora_rank
    """LoRA rank on attention and MLP projections."""
    lora_alpha: int = sage.Config.lora_alpha
    """LoRA alpha."""
    full_finetune: bool = sage.Config.full_finetune
    """Train every weight (the reference is then a frozen copy)."""
    steps: int = sage.Config.steps
    """Optimizer steps."""
    prompts_per_step: int = sage.Config.prompts_per_step
    """Prompts per optimizer step, over all processes."""
    rollouts: int = sage.Config.rollouts
    """Completions per prompt, the group size G."""
    micro_batch_size: int = sage.Config.micro_batch_size
    """Completions per forward/backward on each process."""
    num_iterations: int = field(default=1, metadata={"range": ">= 1"})
    """TRL's mu: optimizer steps per generated batch (1: on-policy; > 1 computes old log-probs)."""
    max_seq_len: int = sage.Config.max_seq_len
    """Prompt + completion tokens."""
    max_prompt_len: int = sage.Config.max_prompt_len
    """Longer prompts are dropped; completions get max_seq_len - max_prompt_len tokens."""
    temperature: float = sage.Config.temperature
    """Sampling temperature."""
    min_p: float = sage.Config.min_p
    """Sampling min-p (not replayed in TRL's log-probs)."""
    top_p: float = sage.Config.top_p
    """Sampling top-p."""
    top_k: int = sage.Config.top_k
    """Sampling top-k (-1: off)."""
    gradient_checkpointing: bool = sage.Config.gradient_checkpointing
    """Recompute activations in the backward."""
    use_vllm: bool = False
    """Generate with vLLM (else transformers' generate); TRL 1.16 wants vllm>=0.22,<=0.31."""
    vllm_mode: str = "colocate"
    """colocate (an engine in every training process) | server (trl vllm-serve on other GPUs)."""
    vllm_server_host: str = "0.0.0.0"
    """Server mode: host of the vLLM server."""
    vllm_server_port: int = field(default=8000, metadata={"range": "in [1, 65535]"})
    """Server mode: port of the vLLM server."""
    vllm_sleep: bool = True
    """Colocate mode: the engine sleeps during the update (as sage.py's does)."""
    vllm_tensor_parallel_size: int = field(default=1, metadata={"range": ">= 1"})
    """Colocate mode: GPUs per engine."""
    gpu_memory_utilization: float = field(default=0.3, metadata={"range": "in (0, 1]"})
    """Colocate mode: vLLM's share of each GPU."""
    seed: int = sage.Config.seed
    """Seed."""
    out: str = sage.Config.out
    """Directory of runs; this run writes to <out>/<name>."""
    name: str = ""
    """Run name (default: <model>-<guide>-trl)."""
    resume: bool = False
    """Continue the run's newest checkpoint."""
    save_every: int = sage.Config.save_every
    """Checkpoint every N steps."""
    report_to: str = "none"
    """TRL's trackers besides <run>/metrics.jsonl: none | tensorboard | wandb (comma-separated)."""


def validate(args: TRLArgs) -> None:
    """One-line errors for what TRL's GRPOTrainer cannot run as asked, and for bad values."""
    checks = [
        (
            args.guide in guides.GUIDES,
            f"unknown --guide {args.guide!r}: choose one of {', '.join(guides.GUIDES)}",
        ),
        (
            args.kl in loss.KL_MODES,
            f"unknown --kl {args.kl!r}: choose one of {', '.join(loss.KL_MODES)}",
        ),
        (
            args.kl_estimator in loss.KL_ESTIMATORS,
            f"unknown --kl-estimator {args.kl_estimator!r}: "
            f"choose one of {', '.join(loss.KL_ESTIMATORS)}",
        ),
        (
            args.kl_estimator != "k1_return" or args.kl != "forward",
            "--kl-estimator k1_return needs --kl reverse",
        ),
        (
            args.advantage in SCALE_REWARDS,
            f"--advantage {args.advantage} is not available on TRL (it forms the "
            f"advantages inside its generation step): use {' or '.join(SCALE_REWARDS)}, "
            "or sage.py",
        ),
        (
            args.loss_agg in LOSS_TYPES,
            f"unknown --loss-agg {args.loss_agg!r}: choose one of {', '.join(LOSS_TYPES)}",
        ),
        (
            args.guide == "none" or (args.kl != "none" and args.beta > 0),
            f"--guide {args.guide} acts only through the KL anchor: "
            "use --kl reverse with --beta > 0",
        ),
        (
            args.rollouts >= 2,
            "--rollouts must be >= 2 (group advantages compare completions of one prompt)",
        ),
        (args.max_prompt_len < args.max_seq_len, "--max-prompt-len must be below --max-seq-len"),
        (args.vllm_mode in ("colocate", "server"), "--vllm-mode must be colocate or server"),
        (args.beta >= 0, "--beta must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def run_name(args: TRLArgs) -> str:
    return args.name or f"{os.path.basename(args.model.rstrip('/'))}-{args.guide}-trl"


def grpo_config(args: TRLArgs, num_processes: int) -> GRPOConfig:
    """sage.py's step as a GRPOConfig: prompts_per_step x rollouts completions per optimizer step,
    micro_batch_size per process per forward/backward, accumulated over the rest (TRL counts its
    batches in completions, per process)."""
    completions = args.prompts_per_step * args.rollouts
    per_window = args.micro_batch_size * num_processes
    if completions % per_window:
        raise ValueError(
            f"--prompts-per-step x --rollouts = {completions} completions per step must be a "
            f"multiple of --micro-batch-size x processes = {per_window}"
        )
    cuda = torch.cuda.is_available()
    tis = args.tis_cap > 0
    return GRPOConfig(
        output_dir=os.path.join(args.out, run_name(args)),
        seed=args.seed,
        max_steps=args.steps,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        lr_scheduler_type="linear",
        warmup_steps=args.warmup_ratio,  # a float in [0, 1) is a fraction of max_steps
        max_grad_norm=args.max_grad_norm,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=completions // per_window,
        num_generations=args.rollouts,
        num_iterations=args.num_iterations,
        max_completion_length=args.max_seq_len - args.max_prompt_len,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=max(args.top_k, 0),
        min_p=args.min_p or None,
        beta=args.beta if args.kl != "none" else 0.0,
        use_bias_correction_kl=args.kl_estimator == "ratio_k3",
        epsilon=args.eps_low,
        epsilon_high=args.eps_high,
        loss_type=LOSS_TYPES[args.loss_agg],
        scale_rewards=SCALE_REWARDS[args.advantage],
        use_vllm=args.use_vllm,
        vllm_mode=args.vllm_mode,
        vllm_server_host=args.vllm_server_host,
        vllm_server_port=args.vllm_server_port,
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_tensor_parallel_size=args.vllm_tensor_parallel_size,
        vllm_enable_sleep_mode=args.vllm_sleep and args.vllm_mode == "colocate",
        vllm_max_model_length=args.max_seq_len,
        # sage.py's --tis-cap: TRL's per-token truncated IS; 0 turns TRL's default correction off.
        vllm_importance_sampling_correction=tis,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=args.tis_cap if tis else 3.0,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=cuda,  # GRPOConfig's default is True, which on CPU means bf16 autocast
        use_cpu=not cuda,  # also what makes a multi-process launch on CPU a gloo group
        # Trained weights stay float32 when every weight is trained (bf16 would round AdamW's steps
        # away; TRL's bf16 autocast still computes in bf16); LoRA's frozen base is bf16 on CUDA.
        model_init_kwargs={
            "dtype": "bfloat16" if cuda and not args.full_finetune else "float32",
            "attn_implementation": attention_implementation(
                torch.bfloat16 if cuda else torch.float32
            ),
        },
        disable_dropout=True,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_every,
        report_to=[name for name in args.report_to.split(",") if name and name != "none"] or "none",
    )


def build_trainer(args: TRLArgs, num_processes: int = 1) -> SageGRPOTrainer:
    """Tokenizer, data, reward, LoRA and TRL's config, as sage.py sets them; TRL loads the model."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    validate(args)
    loss.attend_somewhere_under_sdpa()  # TRL's batches are left-padded too
    config = grpo_config(args, num_processes)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = (
        None
        if args.full_finetune
        else LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    )
    settings = SageSettings(
        guide=guides.GuideConfig(
            name=args.guide,
            tau=args.tau,
            ratio=args.ratio,
            q_min=args.q_min,
            q_max=args.q_max,
            token_normalization=args.token_normalization,
        ),
        kl=args.kl,
        kl_estimator=args.kl_estimator,
    )
    return SageGRPOTrainer(
        args.model,
        trl_reward(load_reward_function(args.reward)),
        config,
        sage=settings,
        train_dataset=training_dataset(args, tokenizer),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[MetricsFile(os.path.join(config.output_dir, "metrics.jsonl"))],
    )


class MetricsFile(TrainerCallback):
    """Every log record with its 0-based step, appended to <run>/metrics.jsonl by the main process
    (the same file sage.py writes, so `evaluate.py plot` and jq read both)."""

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            runs.append_jsonl(self.path, {"step": state.global_step - 1, **(logs or {})})


def check_args(args: TRLArgs, parser) -> None:
    """Every flag before anything loads (one line, exit 2): sage.py's ranges for the flags they
    share, paths, the reward's import, and a --full-finetune whose weights alone cannot fit."""
    from machinery import memory_plan

    for problem in (
        cli.field_problem(args, rules=cli.ranges(sage.Config)),  # sage.py's, for the shared flags
        cli.missing_path("--model", args.model, cli.MODEL),
        cli.missing_path("--dataset", args.dataset, cli.DATA),
    ):
        if problem is not None:
            parser.error(problem)
    if args.max_prompt_len >= args.max_seq_len:
        parser.error("--max-prompt-len must be below --max-seq-len")
    if (problem := cli.torch_build_problem()) is not None:
        parser.error(problem)
    try:  # --reward's module and signature now, so that a typo costs no model load
        load_reward_function(args.reward)
    except RewardError as problem:
        parser.error(str(problem))
    if args.full_finetune:
        anchored = args.kl != "none" and args.beta > 0
        try:
            memory_plan.check_full_finetune_fits(args.model, anchored, with_engine=args.use_vllm)
        except SystemExit as refusal:
            parser.error(str(refusal).removeprefix("error: "))


def main(argv: list[str] | None = None) -> SageGRPOTrainer:
    args, _, parser = cli.parse_config(
        TRLArgs, argv, prog="python -m extras.trl_sage", description=__doc__.split("\n")[0]
    )
    check_args(args, parser)
    # The launcher (accelerate, torchrun, deepspeed) says how many processes share a step, and the
    # accumulation steps follow from it before any GRPOConfig exists. (A PartialState() made here
    # would be initialized without cpu=True, which on CPU counts one process.)
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = os.path.join(args.out, run_name(args))
    last_checkpoint = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    has_checkpoint = last_checkpoint is not None
    if has_checkpoint and not args.resume:
        parser.error(
            f"{run_dir} already holds a checkpoint: "
            "pass --resume to continue it, or --name for a new run"
        )
    if args.resume and not has_checkpoint:
        parser.error(f"--resume, but {run_dir} holds no checkpoint: drop --resume to start afresh")
    if problem := cli.unwritable("--out", run_dir, typed=args.out):
        parser.error(problem)
    try:
        trainer = build_trainer(args, num_processes)
    except (ValueError, DataError, RewardError) as error:
        parser.error(str(error))
    if trainer.accelerator.is_main_process:
        os.makedirs(run_dir, exist_ok=True)
        runs.write_json_atomic(os.path.join(run_dir, "config.json"), dataclasses.asdict(args))
        metrics_path = os.path.join(run_dir, "metrics.jsonl")
        if args.resume:  # records past the checkpoint are logged again
            runs.truncate_jsonl(metrics_path, before_step=int(last_checkpoint.rsplit("-", 1)[1]))
        elif os.path.exists(metrics_path):
            os.remove(metrics_path)
        config = trainer.args
        print(
            f"trl_sage: {config.world_size} processes x "
            f"micro-batch {config.per_device_train_batch_size} x "
            f"{config.gradient_accumulation_steps} accumulation steps = "
            f"{args.prompts_per_step} prompts x "
            f"{args.rollouts} rollouts per optimizer step; TRL {trl.__version__}"
        )
        if args.min_p > 0:
            print(
                f"note: min-p {args.min_p} truncates the sampler, but TRL's log-probs are the "
                "untruncated tempered policy's (sage.py replays it): the update is slightly "
                "off-policy"
            )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(os.path.join(run_dir, "final"))
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
