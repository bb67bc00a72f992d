"""SAGE trainer: GRPO whose reverse-KL anchor pi_ref is reshaped by a guide q (arXiv 2605.18864).

    python sage.py --model Qwen/Qwen2.5-Math-7B      # the paper's run (section 5.1, App. E)
    make demo                                         # a tiny model on a CPU (extras/demo.py)

One optimizer step of ``main()`` (section 5, App. E): prompts -> G rollouts each (rollout.py)
-> rewards -> the log-probs held fixed in the update (pi_ref's) -> advantages (loss.py) -> per
micro-batch, the guide's log q (guides.py, Eqs. 9-12) and the loss, a clipped surrogate plus
beta times the pseudo-KL against p~ = pi_ref * q (Eqs. 3-8) -> AdamW -> weight push -> log ->
checkpoint. ``grep -n "# SAGE:" *.py`` lists every place where SAGE departs from GRPO. Left out,
each behind its flag (extras/): the SFT warm start (App. E.2), DAPO's dynamic sampling,
self-hints; machinery (machinery/) is imported where it is used. Deviations: docs/deviations.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

import guides
import loss
import rollout
from evaluate import EvalConfig

# ---- 1. Configuration: one typed dataclass, a docstring per field, parsed once -----------------

# --algo presets are plain flags placed before the user's, so the user's win. BNPO is the
# Beta-normalized advantage; DAPO is clip-higher, the global token mean and dynamic sampling.
# The paper runs both without KL (a guide keeps its anchor: a preset's --kl none is then dropped).
PRESETS = {
    "grpo": [],
    "dr_grpo": ["--advantage", "dr_grpo", "--loss-agg", "dr_grpo"],
    "bnpo": ["--advantage", "bnpo", "--loss-agg", "batch_token_mean", "--kl", "none"],
    "dapo": ["--loss-agg", "dapo", "--eps-high", "0.28", "--kl", "none", "--dynamic-sampling"],
}
# The extras' knobs, parsed with Config; each extra is imported only where its flag is on.
EXTRAS = {
    "memory": "machinery.memory_plan:PlanConfig",  # --plan-memory, --gpu-gb (not an extra)
    "sft": "extras.sft:SFTConfig",
    "dynamic_sampling": "extras.dynamic_sampling:DynamicSamplingConfig",
    "hints": "extras.hints:HintsConfig",
}


@dataclass
class Config:
    """A run's knobs; the defaults are the paper's (section 5.1, App. E, Tables 7-8)."""

    # ---- model and data ----
    model: str = ""
    """Policy: a hub name or a local model directory (required; `make demo` runs a tiny one)."""
    dataset: str = "open-r1/DAPO-Math-17k-Processed"
    """Training problems: a hub dataset or a local .jsonl/.json/.parquet/.csv file."""
    dataset_config: str = "en"
    """Hub dataset configuration name (ignored for local files)."""
    problem_key: str = "prompt"
    """Field holding the problem text (DAPO-Math-17k-Processed: prompt)."""
    answer_key: str = "solution"
    """Field holding the reference answer (DAPO-Math-17k-Processed: solution)."""
    max_train_samples: int = 2000
    """Use the first N training problems (paper: 2,000)."""
    reward: str = ""
    """Empty: Math-Verify (section 5.1); else module:function or file.py:function, f(completions,
    problems, answers) -> one float each."""
    # ---- the RL step ----
    algo: str = "grpo"
    """Preset: grpo | dapo | bnpo | dr_grpo, flags for advantage, aggregation, clip, KL."""
    steps: int = 1000
    """Optimizer steps of RL (paper: 1,000)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step (paper: 8)."""
    rollouts: int = 8
    """Completions per prompt, the group size G (paper: 8)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward, accumulated over the step (4 fits a 7B on 80 GB)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts (1: on-policy, the ratio is 1 at the first pass)."""
    loss: loss.LossConfig = field(default_factory=loss.LossConfig)
    """The loss's knobs (loss.py): advantage, aggregation, clip range, KL, beta."""
    guide: guides.GuideConfig = field(default_factory=guides.GuideConfig)
    """The guide q and its knobs (guides.py)."""
    # ---- optimization (Table 8) ----
    lr: float = 5e-6
    """AdamW learning rate (public config: 5e-6)."""
    weight_decay: float = 0.01
    """AdamW weight decay (paper: 0.01)."""
    warmup_ratio: float = 0.1
    """Fraction of steps of linear warmup, then linear decay (paper: 0.1)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    lora_rank: int = 8
    """LoRA rank on attention and MLP projections (paper: 8)."""
    lora_alpha: int = 16
    """LoRA alpha."""
    full_finetune: bool = False
    """Train all weights, not LoRA (the reference is then a frozen copy; float32 on CUDA)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward (a 7B keeps ~10 MB per token without it)."""
    # ---- sampling (section 5.1) ----
    max_seq_len: int = 2048
    """Prompt + completion tokens (paper: 2,048; R1-distill: 8,192)."""
    max_prompt_len: int = 512
    """Longer prompts are dropped; completions get --max-seq-len minus this."""
    temperature: float = 1.0
    """Sampling temperature (paper: 1.0)."""
    min_p: float = 0.01
    """Sampling min-p (paper: 0.01); replayed in the trainer's log-probs."""
    top_p: float = 1.0
    """Sampling top-p (paper: 1.0)."""
    top_k: int = -1
    """Sampling top-k (-1: off, paper)."""
    # ---- the run ----
    seed: int = 3407
    """Seed of everything (paper: 3407)."""
    out: str = "runs"
    """Directory of runs; this run writes to <out>/<name>."""
    name: str = ""
    """Run name (default: <model>-<algo>-<guide>)."""
    resume: bool = False
    """Continue from <out>/<name>/checkpoint exactly where the run stopped."""
    stop_after: int = 0
    """Stop after this many steps, checkpointed, for --resume later (0: run to the end)."""
    backend: str = "vllm"
    """Rollout engine: vllm | hf."""
    gpu_memory_utilization: float = 0.0
    """vLLM's share of the GPU (0: 0.3); on CPU, of the RAM for its KV cache (0: 0.05)."""
    save_every: int = 50
    """Checkpoint every N steps (and at the end)."""
    report_to: str = "jsonl"
    """Comma-separated: jsonl (always: metrics.jsonl), tensorboard, wandb (WANDB_MODE=offline)."""
    zero_reward_warning: int = 20
    """Warn after this many consecutive steps whose rewards are all zero."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """pass@k during training (evaluate.py)."""
    extras: dict[str, Any] = field(default_factory=dict, metadata={"flag": None})
    """The extras' knobs by name (EXTRAS), filled by parse_config."""

    def __post_init__(self):
        # dr_grpo's constant divisor is the sampler's completion budget
        completion_budget = self.max_seq_len - self.max_prompt_len
        self.loss = dataclasses.replace(self.loss, max_completion_length=completion_budget)


EPILOG = (
    "Defaults shown are a --model run's: the paper's settings, sized for one 80 GB GPU shared with "
    "the colocated vLLM engine (gradient checkpointing on, 4 sequences per micro batch, the engine "
    "asleep during the update)."
)


def parse_config(argv: list[str] | None = None) -> Config:
    """The command line -> Config: the --algo preset's flags, then the user's (which win)."""
    from machinery import cli, flag_checks

    argv = cli.expand_preset(sys.argv[1:] if argv is None else list(argv), PRESETS)
    extras = {name: cli.import_object(path) for name, path in EXTRAS.items()}
    title = __doc__.split("\n")[0]
    config, sections, parser = cli.parse_config(Config, argv, "sage.py", title, EPILOG, extras)
    config.extras = sections
    flag_checks.check_config(config, PRESETS, parser.error)
    return config


# ---- 2. Setting up: the run directory, the problems, the policy and its reference, the engine --


def start_run(config: Config) -> str:
    """<out>/<name> checked (a checkpoint needs --resume, a CUDA run must fit), seed; no write."""
    from machinery import flag_checks, memory_plan

    memory_plan.before_loading(config, sage=sys.modules[__name__])  # --plan-memory ends here
    model = os.path.basename(config.model.rstrip("/"))
    run_dir = os.path.join(config.out, config.name or f"{model}-{config.algo}-{config.guide.name}")
    flag_checks.check_run_dir(run_dir, config)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    return run_dir


def needs_reference(config: Config) -> bool:
    """The anchor is on: a KL term with beta > 0 needs pi_ref's log-probs."""
    return config.loss.kl != "none" and config.loss.beta > 0


def load_problems(config: Config, tokenizer) -> list[dict]:
    """The training problems {problem, answer, prompt_ids} whose prompt fits --max-prompt-len."""
    from machinery.data import load_rows, training_problems
    from machinery.task import build_prompt_ids

    rows = load_rows(config.dataset, config.dataset_config)
    fields = (config.problem_key, config.answer_key)
    limit, solution_key = config.max_train_samples, config.extras["hints"].solution_key
    problems = training_problems(rows, *fields, limit, config.dataset, solution_key)
    for problem in problems:
        problem["prompt_ids"] = build_prompt_ids(tokenizer, problem["problem"])
    fitting = [p for p in problems if len(p["prompt_ids"]) <= config.max_prompt_len]
    if not fitting:
        raise SystemExit(f"error: no prompt fits in --max-prompt-len {config.max_prompt_len}")
    return fitting


def load_policy(config: Config, base_path: str):
    """(policy, frozen reference or None, optimizer, scheduler, tokenizer): LoRA adapters on the
    base, whose reference is the base with the adapters off (no copy; a frozen copy only with
    --full-finetune); AdamW with linear warmup and decay (Table 8)."""
    from machinery import models

    full, checkpointing = config.full_finetune, config.gradient_checkpointing
    model, tokenizer = models.load_base_model(base_path, checkpointing, None, full)
    lora = (config.lora_rank, config.lora_alpha)
    policy, reference = models.make_policy(model, full, *lora, needs_reference(config))
    schedule = (config.steps, int(config.warmup_ratio * config.steps))  # total, warmup
    optimizer, scheduler = models.make_optimizer(policy, config.lr, config.weight_decay, *schedule)
    return policy, reference, optimizer, scheduler, tokenizer


def start_engine(config: Config, base_path: str, policy):
    """The rollout engine on the base model, in the trainer's dtype, with the policy's weights."""
    dtype = "bfloat16" if next(policy.parameters()).dtype == torch.bfloat16 else "float32"
    shape = (config.prompts_per_step, config.rollouts, config.max_prompt_len, config.max_seq_len)
    limits = rollout.engine_limits(*shape) if config.backend == "vllm" else {}  # one step's batch
    memory = config.gpu_memory_utilization or None  # (0: the engine's default share)
    engine = rollout.make_engine(  # (the HF backend samples from the policy itself)
        base_path, config.backend, max_model_len=config.max_seq_len, seed=config.seed, dtype=dtype,
        gpu_memory_utilization=memory, model=policy if config.backend == "hf" else None, **limits,
    )  # fmt: skip
    if config.resume:  # a fresh policy equals the base the engine loaded (LoRA starts at B = 0)
        engine.sync_weights(policy)
    return engine


# ---- 3. Rollouts and rewards -------------------------------------------------------------------


@dataclass
class Rollouts:
    """One step's samples, flattened prompt-major: row i is completion i % G of prompt i // G."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    engine_logps: list[list[float]]  # the engine's log-probs of the sampled tokens
    problems: list[str]
    answers: list[str]


def generate_rollouts(engine, problems: list[dict], config: Config, seed: int) -> Rollouts:
    """G completions per problem from the engine, one call, seeded."""
    max_tokens = config.max_seq_len - config.max_prompt_len  # the completion budget
    knobs = (config.temperature, config.top_p, config.top_k, config.min_p)
    sampling = rollout.SamplingConfig(config.rollouts, *knobs, max_tokens, seed)
    groups = engine.generate([problem["prompt_ids"] for problem in problems], sampling)
    pairs = [(p, c) for p, group in zip(problems, groups) for c in group]  # prompt-major
    return Rollouts(
        [p["prompt_ids"] for p, _ in pairs], [list(c.token_ids) for _, c in pairs],
        [c.text for _, c in pairs], [c.finish_reason for _, c in pairs],
        [list(c.logprobs) for _, c in pairs], [p["problem"] for p, _ in pairs],
        [p["answer"] for p, _ in pairs],
    )  # fmt: skip


def compute_rewards(rollouts: Rollouts, reward_function, config: Config) -> torch.Tensor:
    """r(x, y) [N] from the reward function (Math-Verify of the final answer by default)."""
    texts, problems, answers = rollouts.texts, rollouts.problems, rollouts.answers
    rewards = torch.tensor(reward_function(texts, problems, answers), dtype=torch.float32)
    if config.extras["dynamic_sampling"].overlong_buffer > 0:  # DAPO's overlong shaping
        from extras import dynamic_sampling

        rewards = rewards + dynamic_sampling.overlong_penalty_of(rollouts, config)
    return rewards


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are not all equal (the others give A = 0).

    >>> informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), group_size=2).tolist()
    [False, True]
    """
    groups = rewards.view(-1, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > 0


def collect_rollouts(engine, sampler, problems, config: Config, step: int, reward_function, timer):
    """Prompts -> G rollouts each -> rewards, and the extras that act here (self-hints, DAPO's
    dynamic sampling). Returns (rollouts, rewards [N], metrics of the sampling)."""

    def sample(chosen: list[dict], seed: int) -> tuple[Rollouts, torch.Tensor]:
        with timer("rollout"):
            rollouts = generate_rollouts(engine, chosen, config, seed)
        with timer("reward"):
            return rollouts, compute_rewards(rollouts, reward_function, config)

    chosen = [problems[i] for i in sampler.take(config.prompts_per_step)]
    rollouts, rewards = sample(chosen, rollout.rollout_seed(config.seed, step))
    metrics = {}
    if config.extras["hints"].self_hints:  # extras/hints.py
        from extras import hints

        with timer("hints"):
            hinted = hints.self_hint(
                engine, rollouts, rewards, chosen, config, step, reward_function
            )
        rollouts, rewards, metrics = hinted
    counts = (config.prompts_per_step, int((~informative_groups(rewards, config.rollouts)).sum()))
    if config.extras["dynamic_sampling"].dynamic_sampling:  # extras/dynamic_sampling.py
        from extras import dynamic_sampling

        first = (rollouts, rewards, counts)
        rollouts, rewards, counts = dynamic_sampling.refill(
            sampler, problems, first, config, step, sample
        )
    metrics["frac_zero_signal_groups"] = counts[1] / max(1, counts[0])
    return rollouts, rewards, metrics


# ---- 4. The update: held-fixed log-probs, advantages, the guide, the loss ----------------------


def micro_batches(rollouts: Rollouts, config: Config, pad_id: int, device) -> list:
    """[(rows, batch)] per micro-batch: the batch as ``collate`` makes it [B, P + C], plus the
    engine's log-probs [B, C]."""
    from machinery.batches import collate

    total, size = len(rollouts.completion_ids), config.micro_batch_size
    result = []
    for rows in (list(range(start, min(start + size, total))) for start in range(0, total, size)):
        prompts = [rollouts.prompt_ids[i] for i in rows]
        completions = [rollouts.completion_ids[i] for i in rows]
        batch = collate(prompts, completions, pad_id, device, group_size=config.rollouts)
        width = batch["completion_mask"].shape[1]
        engine_logps = [rollouts.engine_logps[i] for i in rows]
        batch["engine_logps"] = rollout.pad_rows(engine_logps, width, device)
        result.append((rows, batch))
    return result


def guide_log_q(config: Config, old_logps, entropies, completion_mask, step: int, generator):
    """The guide's log q_t [B, C] from the policy's own signals, fixed in the update (Eqs. 9-12)."""
    # SAGE: log q, the one new per-token quantity; the guide adds no forward pass
    return guides.compute_log_q(
        config.guide, old_logps, entropies, completion_mask, step, config.steps, generator
    )


@torch.no_grad()
def held_fixed_logps(policy, reference, batch: dict, config: Config, guide) -> loss.HeldFixed:
    """The per-token log-probs that stay fixed during the update, each [B, C]: the reference's
    (when the anchor is on) and, when the update needs them before its own forward pass
    (--ppo-epochs > 1, or k1_return), pi_old's log-probs and entropies and the guide's log q."""
    from machinery.models import reference_mode

    ref_logps = ref_entropies = old_logps = entropies = log_q = None
    temperature, min_p = config.temperature, config.min_p
    if needs_reference(config):
        with reference_mode(policy, reference) as reference_policy:
            # The reference's full softmax is the anchor (the authors' too); replaying min-p there
            # would act as an implicit guide q = 1 / M_ref (docs/min-p.md).
            ref_min_p = min_p if config.loss.reference_min_p else 0.0
            reference_logps = loss.completion_logps(reference_policy, batch, temperature, ref_min_p)
            ref_logps, ref_entropies = reference_logps
    if config.ppo_epochs > 1 or config.loss.kl_estimator == "k1_return":
        old_logps, entropies = loss.completion_logps(policy, batch, temperature, min_p)
    from_reference = config.guide.entropy == "reference"  # --guide-entropy
    signals = (ref_logps, ref_entropies) if from_reference else (old_logps, entropies)
    if signals[0] is not None:
        log_q = guide(*signals, batch["completion_mask"])
    return loss.HeldFixed(old_logps, ref_logps, log_q, entropies, batch["engine_logps"])


def kl_shaped_returns(rewards: torch.Tensor, batches: list, held: list, beta: float):
    """SAGE (k1_return, Eq. 8): each reward minus beta times its completion's k1 against p~ =
    pi_ref * q, so that the advantages carry the pseudo-KL and the fixed point is Eq. 4's.

    rewards: [N] on the CPU (the grader's); each micro-batch's returns come back to the CPU.
    """
    returns = []
    for (rows, batch), fixed in zip(batches, held):
        terms = (fixed.old_logps, fixed.ref_logps, fixed.log_q, batch["completion_mask"])
        returns.append(loss.kl_shaped_rewards(rewards[rows], *terms, beta).cpu())
    return torch.cat(returns)


def update_policy(policy, optimizer, batches, held, advantages, config: Config, guide) -> dict:
    """Per micro-batch: the policy's forward pass, the guide's log q from it, the loss and its
    backward (gradients accumulate into the step's); then one clipped AdamW step. ``guide``
    (``guide_log_q`` bound to this step) maps (old_logps, entropies, mask) to log q."""
    from machinery.runs import StepMetrics

    policy.train()
    metrics, device = StepMetrics(), next(policy.parameters()).device
    total_rows = sum(len(rows) for rows, _ in batches)
    step_tokens = float(sum(batch["completion_mask"].sum().item() for _, batch in batches))
    constant_q = config.guide.name in ("branch", "random")  # q is one number per position
    sampler = (config.temperature, config.min_p)
    for _ in range(config.ppo_epochs):
        for (rows, batch), fixed in zip(batches, held):
            mask = batch["completion_mask"]
            logps, entropies = loss.completion_logps(policy, batch, *sampler)  # [B, C] each
            if fixed.old_logps is None:  # on-policy, one pass: pi_old = pi_theta, q from this pass
                old_logps, log_q = logps.detach(), fixed.log_q
                log_q = guide(old_logps, entropies, mask) if log_q is None else log_q
                fixed = dataclasses.replace(fixed, old_logps=old_logps, entropies=entropies)
                fixed.log_q = log_q
            advantage = advantages[rows].to(device)
            micro_loss, micro_metrics = loss.policy_loss(
                logps, advantage, mask, fixed, config.loss, step_tokens, constant_q
            )
            if not torch.isfinite(micro_loss):
                raise FloatingPointError(f"the loss is {micro_loss.item()}: lower --lr or --beta")
            rows_weight = (config.loss.aggregation, len(rows), total_rows, len(batches))
            weight = loss.micro_batch_weight(*rows_weight)
            (micro_loss * (weight / config.ppo_epochs)).backward()
            gap = rollout.engine_gap(fixed.old_logps, fixed.engine_logps, mask)
            metrics.add({**micro_metrics, **gap}, len(rows))
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm).item()
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"the gradient norm is {grad_norm}: lower --lr or --beta")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**metrics.result(), "grad_norm": grad_norm}


# ---- 5. main(): the run, stage by stage --------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    from machinery import runs, task, trackers
    from machinery.data import PromptSampler

    config = parse_config(argv)
    run_dir, base_path = start_run(config), config.model
    # App. E.2: the SFT warm start of a base model (--sft-only ends the run there)
    if config.extras["sft"].sft_dataset:
        from extras import sft

        base_path = sft.warm_start(config, run_dir)
    # ---- the policy and its reference, the problems, the optimizer, the engine ----
    policy, reference, optimizer, scheduler, tokenizer = load_policy(config, base_path)
    problems = load_problems(config, tokenizer)
    guide_generator = torch.Generator().manual_seed(config.seed)
    sampler = PromptSampler(len(problems), config.seed)
    state = (policy, optimizer, scheduler, sampler, guide_generator)  # what a checkpoint holds
    reward_function = task.load_reward_function(config.reward)
    runs.save_run_config(run_dir, config)  # the run can start: the model, data and reward loaded
    start = runs.restore_or_start(config.resume, run_dir, *state)
    logger = trackers.RunLogger(config, run_dir, tokenizer)
    engine = start_engine(config, base_path, policy)
    logger.evaluate(engine, updates=start, first=True)  # pass@k of the starting policy
    for step in logger.progress_bar(start):
        timer = runs.PhaseTimer()
        # 1-2. prompts -> G rollouts each -> rewards (and the extras that act here: hints, refill)
        sampled = collect_rollouts(engine, sampler, problems, config, step, reward_function, timer)
        rollouts, rewards, metrics = sampled
        with timer("sleep"):
            engine.sleep(level=2)  # CUDA: drop the engine's weights and KV cache for the update
        if rewards.numel() > 0:  # (dynamic sampling may leave no group with signal)
            batches = micro_batches(rollouts, config, tokenizer.pad_token_id, policy.device)
            guide = functools.partial(guide_log_q, config, step=step, generator=guide_generator)
            # 3. the log-probs held fixed during the update: pi_ref's (pi_old's, log q when needed)
            with timer("reference"):
                held = [held_fixed_logps(policy, reference, b, config, guide) for _, b in batches]
            # 4. advantages (with k1_return, of the returns the pseudo-KL shaped)
            returns = rewards
            if config.loss.kl_estimator == "k1_return" and needs_reference(config):
                # SAGE: each return minus beta * k1 against p~ = pi_ref * q (Eq. 8)
                returns = kl_shaped_returns(rewards, batches, held, config.loss.beta)
            advantages = loss.compute_advantages(returns, config.rollouts, config.loss.advantage)
            # 5-7. per micro-batch: the guide's log q -> loss -> backward; then one AdamW step
            with timer("update"):
                metrics |= update_policy(
                    policy, optimizer, batches, held, advantages, config, guide
                )
        scheduler.step()
        # 8. the weight push into the engine
        with timer("sync"):
            engine.sync_weights(policy)
        # 9. metrics, and pass@k every --eval-every steps
        logger.log_step(step, rollouts, rewards, metrics, timer, scheduler.get_last_lr()[0])
        logger.evaluate(engine, updates=step + 1)
        # 10. checkpoint (and --stop-after)
        if runs.checkpoint_if_due(run_dir, step, start, config, state):
            break
    logger.close()
    engine.close()
    return {"run_dir": run_dir, "finished": logger.finished}


if __name__ == "__main__":
    from machinery import cli

    cli.run(main)
