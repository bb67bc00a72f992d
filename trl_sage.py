"""SAGE on TRL's GRPOTrainer: the same guides and the same loss, on an engine that scales out.

sage.py is the tutorial and the single-GPU run, one process. Past one GPU (8 GPUs on a node,
several nodes), this module runs SAGE on TRL's ``GRPOTrainer`` under ``accelerate`` (DDP,
DeepSpeed ZeRO, FSDP), with vLLM colocated or as a server. TRL does generation, rewards,
advantages, batching, distribution and checkpointing; SAGE replaces only the loss:

    the update's own forward pass (TRL's) -> log-probs and entropies
    -> the guide's log q (guides.compute_log_q, Eqs. 9-12) -> loss.policy_loss (Eqs. 3-8)

so every guide and in-loss estimator of this repository runs here unchanged, none re-typed.

The extension point is ``compute_loss``, public in transformers' Trainer. It calls one private
method of TRL, ``_get_per_token_logps_and_entropies`` (the forward pass that also gives TRL's old
and reference log-probs, so all three agree), and appends metrics to ``_metrics``. Both are pinned
with TRL (``TRL_VERSION``) and a test fails, naming the pin, when the private signature changes.

What differs from sage.py (README, "Scaling out"):

* min-p is not replayed in TRL's log-probs: with min-p > 0 the ratio is not exactly 1 on-policy.
* ``--kl-estimator k1_return`` is refused: it puts the KL into the reward before the advantage,
  which TRL computes inside its generation step. k3 (the paper's), k2, ratio_k3 and forward work.
* Advantages are TRL's: grpo (scale_rewards="group") and dr_grpo (scale_rewards="none").
* TRL's ``use_bias_correction_kl`` is off: ``--kl-estimator ratio_k3`` is that correction.
* The guide's random draws (random and token guides) are not restored on resume.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass

import datasets
import torch
from trl import GRPOConfig, GRPOTrainer

import cli
import guides
import loss
import models
import sage
from data import DataError, load_rows, training_problems
from task import SYSTEM_PROMPT, RewardError, load_reward_function

TRL_VERSION = "1.16.0"
# TRL loss types whose aggregation loss.aggregate reproduces (TRL's "bnpo" is a token mean).
AGGREGATION_OF_LOSS_TYPE = {"grpo": "grpo", "bnpo": "batch_token_mean", "dr_grpo": "dr_grpo", "dapo": "dapo"}
SCALE_REWARDS_OF_ADVANTAGE = {"grpo": "group", "dr_grpo": "none"}
LOSS_TYPE_OF_AGGREGATION = {value: key for key, value in AGGREGATION_OF_LOSS_TYPE.items()}

# --------------------------------------------------------------------------------------------
# 1. The trainer: TRL's, with SAGE's loss
# --------------------------------------------------------------------------------------------


class SageGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer whose loss is ``loss.policy_loss`` against the anchor p~ = pi_ref * q."""

    def __init__(self, *args, guide: guides.GuideConfig, kl: str = "reverse", kl_estimator: str = "k3", **kwargs):
        super().__init__(*args, **kwargs)
        if kl_estimator == "k1_return":
            raise ValueError("--kl-estimator k1_return puts the KL into the reward before the advantage, which TRL "
                             "computes during generation: use sage.py, or k3 / k2 / ratio_k3 here")
        if self.loss_type not in AGGREGATION_OF_LOSS_TYPE:
            raise ValueError(f"loss_type {self.loss_type!r} has no SAGE loss: use one of {', '.join(AGGREGATION_OF_LOSS_TYPE)}")
        unsupported = {"top_entropy_quantile": self.top_entropy_quantile < 1.0, "delta": self.args.delta is not None,
                       "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
                       "importance_sampling_level": self.importance_sampling_level != "token",
                       "use_bias_correction_kl": self.args.use_bias_correction_kl}
        if any(unsupported.values()):
            raise ValueError(f"{next(k for k, v in unsupported.items() if v)} is not supported by the SAGE loss; "
                             "leave it at its default")
        self.guide, self.kl, self.kl_estimator = guide, kl, kl_estimator
        self.guide_generator = torch.Generator().manual_seed(self.args.seed + self.accelerator.process_index)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("the SAGE trainer does not return outputs")
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]  # [B, P], [B, C]
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
            compute_entropy=True,
        )
        sage_loss, metrics = self.sage_loss(logps, entropies, inputs, mask)
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        return sage_loss

    def sage_loss(self, logps: torch.Tensor, entropies: torch.Tensor, inputs: dict, mask: torch.Tensor):
        """loss.policy_loss on TRL's inputs, scaled as TRL scales its own loss for accumulation."""
        old_logps = inputs.get("old_per_token_logps", logps.detach())
        log_q = guides.compute_log_q(self.guide, old_logps, entropies, mask, self.state.global_step,
                                     max(1, self.args.max_steps), self.guide_generator)
        importance = inputs.get("importance_sampling_ratio") if self.use_vllm and self.vllm_importance_sampling_correction else None
        if importance is not None:
            importance = importance.expand_as(logps)
        aggregation = AGGREGATION_OF_LOSS_TYPE[self.loss_type]
        training = self.model.training
        accumulation = self.current_gradient_accumulation_steps if training else 1.0
        step_tokens = None
        if aggregation == "dapo":  # TRL's normalizer: the tokens of one accumulation window on this process
            step_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if training:
                step_tokens = step_tokens * accumulation / self.args.steps_per_generation
        value, metrics = loss.policy_loss(
            logps, old_logps, inputs["advantages"].reshape(-1), mask, ref_logps=inputs.get("ref_per_token_logps"),
            log_q=log_q, beta=self.beta, kl=self.kl if self.beta else "none", kl_estimator=self.kl_estimator,
            eps_low=self.epsilon_low, eps_high=self.epsilon_high, aggregation=aggregation,
            max_completion_length=self.max_completion_length, global_num_tokens=step_tokens, entropies=entropies,
            importance_weights=importance, q_constant_per_position=self.guide.name in ("branch", "random"),
        )
        return (value if aggregation == "dapo" else value / accumulation), metrics


# --------------------------------------------------------------------------------------------
# 2. The run: sage.py's knobs, our data and reward, TRL's GRPOConfig
# --------------------------------------------------------------------------------------------


@dataclass
class TRLArgs:
    """python trl_sage.py --model PATH --guide branch ... (under accelerate launch for several GPUs)."""

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
    """The reward: empty for Math-Verify, else module:function or file.py:function (as in sage.py)."""
    guide: str = sage.Config.guide
    """none | random (Eq. 9) | token (Eq. 10) | branch (Eq. 11)."""
    tau: float = sage.Config.tau
    """Branch guide: entropy threshold in nats."""
    ratio: float = sage.Config.ratio
    """Branch guide: slope above the threshold."""
    q_min: float = sage.Config.q_min
    """Guide clamp, lower."""
    q_max: float = sage.Config.q_max
    """Guide clamp, upper."""
    kl: str = "reverse"
    """reverse | forward | none."""
    kl_estimator: str = sage.Config.kl_estimator
    """k3 (paper) | k2 | ratio_k3 (k1_return needs sage.py)."""
    beta: float = sage.Config.beta
    """KL coefficient."""
    advantage: str = "grpo"
    """grpo | dr_grpo (TRL computes the advantages)."""
    loss_agg: str = "grpo"
    """grpo | batch_token_mean | dr_grpo | dapo."""
    eps_low: float = sage.Config.eps_low
    """Lower clip of the ratio."""
    eps_high: float = 0.2
    """Upper clip of the ratio."""
    lr: float = sage.Config.lr
    """AdamW learning rate."""
    weight_decay: float = sage.Config.weight_decay
    """AdamW weight decay."""
    warmup_ratio: float = sage.Config.warmup_ratio
    """Linear warmup, then linear decay."""
    lora_rank: int = sage.Config.lora_rank
    """LoRA rank on attention and MLP projections (0: full fine-tuning)."""
    lora_alpha: int = sage.Config.lora_alpha
    """LoRA alpha."""
    steps: int = sage.Config.steps
    """Optimizer steps."""
    prompts_per_step: int = sage.Config.prompts_per_step
    """Prompts per optimizer step, over all processes."""
    rollouts: int = sage.Config.rollouts
    """Completions per prompt, the group size G."""
    micro_batch_size: int = sage.Config.micro_batch_size
    """Completions per forward/backward on each process."""
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
    use_vllm: bool = True
    """Generate with vLLM (False: transformers generate)."""
    vllm_mode: str = "colocate"
    """colocate (each process holds an engine) | server (trl vllm-serve on other GPUs)."""
    vllm_server_host: str = "0.0.0.0"
    """Host of `trl vllm-serve` in server mode."""
    gpu_memory_utilization: float = 0.3
    """vLLM's share of each GPU in colocate mode."""
    seed: int = sage.Config.seed
    """Seed."""
    out: str = sage.Config.out
    """Directory of runs; this run writes to <out>/<name>."""
    name: str = ""
    """Run name (default: trl-<guide>)."""
    save_every: int = sage.Config.save_every
    """Checkpoint every N steps."""
    report_to: str = "none"
    """TRL's report_to: none | tensorboard | wandb."""


def training_dataset(args: TRLArgs) -> datasets.Dataset:
    """The training problems as TRL's conversational prompts (the paper's system prompt, App. E.4),
    with their problem and answer columns for the reward."""
    rows = load_rows(args.dataset, args.dataset_config)
    problems = training_problems(rows, args.problem_key, args.answer_key, args.max_train_samples, args.dataset)
    return datasets.Dataset.from_list([
        {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p["problem"]}],
         "problem": p["problem"], "answer": p["answer"]} for p in problems])


def trl_reward(reward_function):
    """Our reward with TRL's calling convention: completions (chat messages or text) and the
    dataset's columns as keyword arguments."""

    def reward(prompts, completions, problem, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward_function(texts, problem, answer)

    reward.__name__ = getattr(reward_function, "__name__", "reward")
    return reward


def grpo_config(args: TRLArgs, num_processes: int) -> GRPOConfig:
    """TRL's config for sage.py's step: prompts_per_step x rollouts completions per optimizer step,
    sampled fresh every step (TRL counts batches in completions, per process)."""
    completions = args.prompts_per_step * args.rollouts
    per_process = completions // num_processes
    if completions % (num_processes * args.micro_batch_size):
        raise ValueError(f"--prompts-per-step x --rollouts ({completions}) must split into {num_processes} processes "
                         f"x micro-batches of --micro-batch-size {args.micro_batch_size}")
    return GRPOConfig(
        output_dir=os.path.join(args.out, args.name or f"trl-{args.guide}"), seed=args.seed, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_ratio,
        lr_scheduler_type="linear", per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=per_process // args.micro_batch_size, generation_batch_size=completions,
        num_generations=args.rollouts, max_completion_length=args.max_seq_len - args.max_prompt_len,
        temperature=args.temperature, top_p=args.top_p, top_k=max(args.top_k, 0), min_p=args.min_p or None,
        beta=args.beta if args.kl != "none" else 0.0, epsilon=args.eps_low, epsilon_high=args.eps_high,
        loss_type=LOSS_TYPE_OF_AGGREGATION[args.loss_agg], scale_rewards=SCALE_REWARDS_OF_ADVANTAGE[args.advantage],
        use_bias_correction_kl=False, use_vllm=args.use_vllm, vllm_mode=args.vllm_mode,
        vllm_server_host=args.vllm_server_host, vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        gradient_checkpointing=args.gradient_checkpointing, save_steps=args.save_every, logging_steps=1,
        report_to=args.report_to, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
    )


def validate(args: TRLArgs) -> None:
    """One-line errors for the knobs TRL cannot run as asked."""
    checks = [
        (args.guide in guides.GUIDES, f"unknown --guide {args.guide!r}: choose one of {', '.join(guides.GUIDES)}"),
        (args.kl in loss.KL_MODES, f"unknown --kl {args.kl!r}: choose one of {', '.join(loss.KL_MODES)}"),
        (args.kl_estimator in ("k2", "k3", "ratio_k3"), f"--kl-estimator {args.kl_estimator} is not available on TRL "
         "(k1_return puts the KL into the reward before the advantage, which TRL computes during generation): use "
         "k3, k2 or ratio_k3, or sage.py"),
        (args.advantage in SCALE_REWARDS_OF_ADVANTAGE, f"--advantage {args.advantage} is not available on TRL: use "
         f"{' or '.join(SCALE_REWARDS_OF_ADVANTAGE)}"),
        (args.loss_agg in LOSS_TYPE_OF_AGGREGATION, f"unknown --loss-agg {args.loss_agg!r}: choose one of "
         f"{', '.join(LOSS_TYPE_OF_AGGREGATION)}"),
        (args.guide == "none" or (args.kl == "reverse" and args.beta > 0),
         f"--guide {args.guide} acts only through the KL anchor: use --kl reverse with --beta > 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def build_trainer(args: TRLArgs) -> SageGRPOTrainer:
    """Model (LoRA unless --lora-rank 0), data, reward and TRL's config, as sage.py sets them."""
    from accelerate import PartialState

    validate(args)
    model, tokenizer = models.load_base_model(args.model, device="cpu")  # TRL places it, and checkpoints
    if args.lora_rank:
        model = models.wrap_lora(model, args.lora_rank, args.lora_alpha)
    guide = guides.GuideConfig(name=args.guide, tau=args.tau, ratio=args.ratio, q_min=args.q_min, q_max=args.q_max)
    return SageGRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=trl_reward(load_reward_function(args.reward)),
        args=grpo_config(args, PartialState().num_processes), train_dataset=training_dataset(args), guide=guide,
        kl=args.kl, kl_estimator=args.kl_estimator,
    )


def main(argv: list[str] | None = None) -> None:
    given, parser = cli.parse(TRLArgs, argv, prog="trl_sage.py", description=__doc__.split("\n")[0])
    args = TRLArgs(**given)
    try:
        trainer = build_trainer(args)
    except (ValueError, DataError, RewardError) as error:
        parser.error(str(error))
    trainer.train()
    trainer.save_model(trainer.args.output_dir)
    trainer.state.save_to_json(os.path.join(trainer.args.output_dir, "trainer_state.json"))  # the logged metrics


def private_signature_matches() -> str | None:
    """None if TRL's private method that compute_loss calls has the signature this module was
    written against; else a one-line explanation naming the pinned version."""
    import trl

    parameters = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    expected = ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"]
    if parameters[: len(expected)] != expected:
        return (f"TRL {trl.__version__}: GRPOTrainer._get_per_token_logps_and_entropies{tuple(parameters)} changed "
                f"from the signature trl_sage.py was written for (TRL {TRL_VERSION}: {tuple(expected)}, returning "
                f"logps, entropies, aux_loss); pin trl=={TRL_VERSION} or update SageGRPOTrainer.compute_loss")
    return None


if __name__ == "__main__":
    main(sys.argv[1:])
