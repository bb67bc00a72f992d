"""SAGE trainer: GRPO whose reverse-KL anchor pi_ref is reshaped by a guide q (arXiv 2605.18864).

    python sage.py --model Qwen/Qwen2.5-Math-7B               # SAGE: GRPO + branch guide, k3
    python sage.py --model Qwen/Qwen2.5-Math-7B --guide none  # plain GRPO (section 5.1)
    make demo                                                 # a tiny model on a CPU

One optimizer step of ``main()`` (section 5, App. E): prompts -> G rollouts each (rollout.py)
-> rewards -> the log-probs held fixed in the update (pi_ref's) -> advantages (loss.py) -> per
micro-batch, the guide's log q (guides.py, Eqs. 9-12) and the loss, a clipped surrogate plus
beta times the pseudo-KL against p~ = pi_ref * q (Eqs. 3-8) -> AdamW -> weight push -> log ->
checkpoint. ``grep -n "# SAGE:" *.py`` lists every place where SAGE departs from GRPO. Left out,
each behind its flag (extras/): the SFT warm start (App. E.2), DAPO's dynamic sampling,
self-hints. pi_ref (``reference_mode``) is here, the padded batch (``collate``) in loss.py beside
the log-probs, the weight push in rollout.py; the problems and the reward come from task/, the
model's loading, the flags' checks and the run's files from machinery/.
Deviations: docs/deviations.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

import evaluate
import guides
import loss
import rollout
from evaluate import EvalConfig
from extras.flags import DynamicSamplingConfig, HintsConfig, SFTConfig
from machinery import cli, memory_plan, models, runs
from task.grading import load_reward_function
from task.problems import PromptSampler, build_prompt_ids, load_rows, training_problems

# ---- Configuration: one typed dataclass, a docstring per field, parsed once --------------------

# --algo presets are plain flags placed before the user's, so the user's win (``preset_flags``).
# BNPO is the Beta-normalized advantage; DAPO is clip-higher, the global token mean and dynamic
# sampling. The paper runs both without KL.
PRESETS = {
    "grpo": [],
    "dr_grpo": ["--advantage", "dr_grpo", "--loss-agg", "dr_grpo"],
    "bnpo": ["--advantage", "bnpo", "--loss-agg", "batch_token_mean", "--kl", "none"],
    "dapo": ["--loss-agg", "dapo", "--eps-high", "0.28", "--kl", "none", "--dynamic-sampling"],
}
# The extras' knobs, parsed with Config (extras/flags.py holds only these dataclasses); each
# extra's code is imported only where its flag is on.
EXTRAS = {
    "memory": memory_plan.PlanConfig,  # --plan-memory, --gpu-gb (not an extra)
    "sft": SFTConfig,
    "dynamic_sampling": DynamicSamplingConfig,
    "hints": HintsConfig,
}


@dataclass
class Config:
    """A run's knobs; the defaults are the paper's (section 5.1, App. E, Tables 7-8)."""

    # ---- model and data ----
    model: str = ""
    """Policy: a local model directory, a hub name (org/name) or a short name of the paper's
    models such as Qwen2.5-Math-7B (required; `make demo` runs a tiny one)."""
    dataset: str = "open-r1/DAPO-Math-17k-Processed"
    """Training problems: a hub dataset or a local .jsonl/.json/.parquet/.csv file."""
    dataset_config: str = "en"
    """Hub dataset configuration name (ignored for local files)."""
    problem_key: str = "prompt"
    """Field holding the problem text (DAPO-Math-17k-Processed: prompt)."""
    answer_key: str = "solution"
    """Field holding the reference answer (DAPO-Math-17k-Processed: solution)."""
    max_train_samples: int = field(default=2000, metadata={"range": ">= 0"})
    """Use the first N training problems (paper: 2,000)."""
    reward: str = ""
    """Empty: Math-Verify (section 5.1); else module:function or file.py:function, f(completions,
    problems, answers) -> one float each."""
    # ---- the RL step ----
    algo: str = field(default="grpo", metadata={"choices": tuple(PRESETS)})
    """Preset: grpo | dapo | bnpo | dr_grpo, flags for advantage, aggregation, clip, KL."""
    steps: int = field(default=1000, metadata={"range": ">= 1"})
    """RL steps, each one AdamW step per --ppo-epochs pass (paper: 1,000)."""
    prompts_per_step: int = field(default=8, metadata={"range": ">= 1"})
    """Prompts per RL step (paper: 8)."""
    rollouts: int = field(default=8, metadata={"range": ">= 2"})
    """Completions per prompt, the group size G (paper: 8)."""
    micro_batch_size: int = field(default=4, metadata={"range": ">= 1"})
    """Sequences per forward/backward, accumulated over the step (4 fits a 7B on 80 GB)."""
    ppo_epochs: int = field(default=1, metadata={"range": ">= 1"})
    """Passes over each step's rollouts, each ending in a clipped AdamW step (TRL's
    num_iterations; 1: on-policy, the ratio is 1). pi_old, pi_ref and q are held from before the
    first pass, so from the second the ratio moves and the clip acts. The learning-rate schedule
    advances once per RL step, as --steps, --warmup-ratio and the guide's schedules count them:
    the E AdamW steps of one RL step share its learning rate."""
    loss: loss.LossConfig = field(default_factory=loss.LossConfig)
    """The loss's knobs (loss.py): advantage, aggregation, clip range, KL, beta."""
    guide: guides.GuideConfig = field(default_factory=guides.GuideConfig)
    """The guide q and its knobs (guides.py)."""
    # ---- optimization (Table 8) ----
    lr: float = field(default=5e-6, metadata={"range": "> 0"})
    """AdamW learning rate (public config: 5e-6)."""
    weight_decay: float = field(default=0.01, metadata={"range": ">= 0"})
    """AdamW weight decay (paper: 0.01)."""
    warmup_ratio: float = field(default=0.1, metadata={"range": "in [0, 1)"})
    """Fraction of steps of linear warmup, then linear decay (paper: 0.1)."""
    max_grad_norm: float = field(default=1.0, metadata={"range": "> 0"})
    """Gradient clipping norm."""
    lora_rank: int = field(default=8, metadata={"range": ">= 1"})
    """LoRA rank on attention and MLP projections (paper: 8)."""
    lora_alpha: int = field(default=16, metadata={"range": "> 0"})
    """LoRA alpha."""
    full_finetune: bool = False
    """Train all weights, not LoRA (the reference is then a frozen copy; float32 on CUDA)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward (a 7B keeps ~10 MB per token without it)."""
    fast_logprobs: bool = True
    """Log-probs and entropies through machinery/fast_logprobs.py (the same numbers, no [B, C, V]
    float32 tensor); --no-fast-logprobs runs loss.token_logps_and_entropies, the definition."""
    # ---- sampling (section 5.1) ----
    max_seq_len: int = field(default=2048, metadata={"range": ">= 2"})
    """Prompt + completion tokens (paper: 2,048; R1-distill: 8,192)."""
    max_prompt_len: int = field(default=512, metadata={"range": ">= 1"})
    """Longer prompts are dropped; completions get --max-seq-len minus this."""
    temperature: float = field(default=1.0, metadata={"range": "> 0"})
    """Sampling temperature (paper: 1.0)."""
    min_p: float = field(default=0.01, metadata={"range": "in [0, 1)"})
    """Sampling min-p (paper: 0.01); the loss reads it with --loss-distribution min_p."""
    top_p: float = field(default=1.0, metadata={"range": "in (0, 1]"})
    """Sampling top-p (paper: 1.0)."""
    top_k: int = field(default=-1, metadata={"range": ">= -1"})
    """Sampling top-k (-1: off, paper)."""
    # ---- the run ----
    seed: int = field(default=3407, metadata={"range": ">= 0"})
    """Seed of everything (paper: 3407)."""
    out: str = "runs"
    """Directory of runs; this run writes to <out>/<name>."""
    name: str = ""
    """Run name (default: <model>-<algo>-<guide>)."""
    resume: bool = False
    """Continue from <out>/<name>/checkpoint exactly where the run stopped."""
    stop_after: int = field(default=0, metadata={"range": ">= 0"})
    """Stop after this many steps, checkpointed, for --resume later (0: run to the end)."""
    backend: str = field(default="vllm", metadata={"choices": rollout.BACKENDS})
    """Rollout engine: vllm | hf."""
    gpu_memory_utilization: float = field(default=0.0, metadata={"range": "in [0, 1)"})
    """vLLM's share of the GPU (0: enough for one step's sequences beside the trainer, at least
    0.3; docs/gpu.md); on CPU, of the RAM for its KV cache (0: 0.05)."""
    save_every: int = field(default=50, metadata={"range": ">= 1"})
    """Checkpoint every N steps (and at the end)."""
    report_to: str = "jsonl"
    """Comma-separated: jsonl (always: metrics.jsonl), tensorboard, wandb (WANDB_MODE=offline)."""
    zero_reward_warning: int = field(default=20, metadata={"range": ">= 1"})
    """Warn after this many consecutive steps whose rewards are all zero."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """pass@k during training (evaluate.py)."""
    extras: dict[str, Any] = field(
        default_factory=lambda: {name: section() for name, section in EXTRAS.items()},
        metadata={"flag": None},
    )
    """The extras' knobs by name (EXTRAS): their defaults, or parse_config's from the flags."""

    def __post_init__(self):
        # dr_grpo's constant divisor is the sampler's completion budget
        completion_budget = self.max_seq_len - self.max_prompt_len
        self.loss = dataclasses.replace(self.loss, max_completion_length=completion_budget)


EPILOG = (
    "Defaults shown are a --model run's: the paper's settings, sized for one 80 GB GPU shared with "
    "the colocated vLLM engine (gradient checkpointing on, 4 sequences per micro batch, the engine "
    "asleep during the update)."
)


def preset_flags(algo: str | None, guide: str) -> list[str]:
    """The flags of the --algo preset ``algo`` (none for an unknown one: the parser refuses it).
    SAGE: a guide acts only through the KL anchor, so with a guide on, the preset's --kl none is
    dropped and the guide keeps its anchor.

    >>> preset_flags("dapo", guide="none")
    ['--loss-agg', 'dapo', '--eps-high', '0.28', '--kl', 'none', '--dynamic-sampling']
    >>> preset_flags("dapo", guide="branch")
    ['--loss-agg', 'dapo', '--eps-high', '0.28', '--dynamic-sampling']
    """
    flags = PRESETS.get(algo, [])
    if guide != "none" and "--kl" in flags:  # SAGE: the guide keeps its anchor
        at = flags.index("--kl")
        flags = flags[:at] + flags[at + 2 :]
    return flags


def parse_config(argv: list[str] | None = None) -> Config:
    """The command line -> Config: the --algo preset's flags, then the user's (which win)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = cli.peek(argv, algo=Config.algo, guide=guides.GuideConfig.name)
    argv = [*preset_flags(chosen["algo"], guide=chosen["guide"]), *argv]
    config, sections, parser = cli.parse_config(
        Config,
        argv,
        prog="sage.py",
        description=__doc__.split("\n")[0],
        epilog=EPILOG,
        sections=EXTRAS,
    )
    config.extras = sections
    cli.check_config(config, error=parser.error)
    return config


# ---- Setting up: the run directory, the problems, the policy and its reference, the engine -----


def start_run(config: Config) -> tuple[str, float | None]:
    """The model's short name resolved, then <out>/<name> checked, the cheapest and most
    specific check first: it can be written, a checkpoint needs --resume and the flags that
    shaped it, a --full-finetune's weights must fit, then (on CUDA) the memory plan's estimate,
    whose forecast peak in GB comes back with the run directory (None on the CPU); seed; no
    write. --plan-memory prints the plan and ends the program first."""
    config.model = models.resolve_model(config.model)  # Qwen2.5-Math-7B -> Qwen/Qwen2.5-Math-7B
    if config.extras["memory"].plan_memory:  # the forecast, then the end
        from extras import memory_report

        memory_report.print_plan(config, with_reference=needs_reference(config))
        raise SystemExit(0)
    model = os.path.basename(config.model.rstrip("/"))
    run_dir = os.path.join(config.out, config.name or f"{model}-{config.algo}-{config.guide.name}")
    cli.check_run_dir(run_dir, config, with_reference=needs_reference(config))
    # On CUDA a run that cannot fit ends here; one that fits gets its forecast peak (no plan on CPU)
    forecast_gb = None
    if torch.cuda.is_available():
        forecast_gb = memory_plan.before_loading(config, with_reference=needs_reference(config))
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    return run_dir, forecast_gb


def needs_reference(config: Config) -> bool:
    """The anchor is on: a KL term with beta > 0 needs pi_ref's log-probs."""
    return config.loss.kl != "none" and config.loss.beta > 0


@dataclass
class Task:
    """What a step's rollouts are drawn from and graded by: the training problems {problem,
    answer, prompt_ids}, the sampler that draws each step's prompts (checkpointed), the reward."""

    problems: list[dict]
    sampler: PromptSampler
    reward_function: Any


def load_task(config: Config, tokenizer) -> Task:
    """The training problems whose prompt fits --max-prompt-len, their sampler, and --reward."""
    problems = training_problems(
        load_rows(config.dataset, config.dataset_config),
        problem_key=config.problem_key,
        answer_key=config.answer_key,
        limit=config.max_train_samples,
        where=config.dataset,
        solution_key=config.extras["hints"].solution_key,
    )
    for problem in problems:
        problem["prompt_ids"] = build_prompt_ids(tokenizer, problem["problem"])
    fitting = [p for p in problems if len(p["prompt_ids"]) <= config.max_prompt_len]
    if not fitting:
        raise SystemExit(f"error: no prompt fits in --max-prompt-len {config.max_prompt_len}")
    sampler = PromptSampler(len(fitting), config.seed)
    return Task(fitting, sampler=sampler, reward_function=load_reward_function(config.reward))


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def wrap_lora(model, rank: int, alpha: int):
    """LoRA adapters on the attention and MLP projections (paper: rank 8)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def make_policy(model, full_finetune: bool, lora_rank: int, lora_alpha: int, with_reference: bool):
    """(policy, frozen_reference): LoRA adapters whose reference is the base with the adapter off
    (no copy), or, when fine-tuning every weight, the model itself and a frozen copy (if a KL
    anchor needs a reference)."""
    if not full_finetune:
        return wrap_lora(model, lora_rank, lora_alpha), None
    return model, (copy.deepcopy(model).eval().requires_grad_(False) if with_reference else None)


@contextlib.contextmanager
def reference_mode(policy, frozen_reference):
    """Yield the reference policy: the frozen copy, or the LoRA base with the adapter off."""
    if frozen_reference is not None:
        yield frozen_reference
    else:
        with policy.disable_adapter():
            yield policy


@dataclass
class Learner:
    """What the update trains and holds: the policy, its frozen reference (None: pi_ref is the
    LoRA base with the adapters off), AdamW and its schedule, the guide's random generator (the
    random and token guides draw from it), and the tokenizer's padding id."""

    policy: Any
    reference: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    guide_generator: torch.Generator
    pad_id: int


def load_policy(config: Config, base_path: str, pad_id: int) -> Learner:
    """LoRA adapters on the model at ``base_path``, whose reference pi_ref is that model with the
    adapters off (no copy; a frozen copy only with --full-finetune); AdamW with linear warmup and
    decay (Table 8); ``pad_id``, the tokenizer's, pads the update's batches."""
    model = models.load_base_model(
        base_path,
        gradient_checkpointing=config.gradient_checkpointing,
        full_finetune=config.full_finetune,
    )
    loss.attend_somewhere_under_sdpa()  # the update's batches are left-padded
    policy, reference = make_policy(
        model,
        full_finetune=config.full_finetune,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        with_reference=needs_reference(config),
    )
    optimizer, scheduler = models.make_optimizer(
        policy,
        lr=config.lr,
        weight_decay=config.weight_decay,
        total_steps=config.steps,
        warmup_steps=int(config.warmup_ratio * config.steps),
    )
    generator = torch.Generator().manual_seed(config.seed)
    return Learner(policy, reference, optimizer, scheduler, generator, pad_id)


def start_engine(config: Config, base_path: str, learner: Learner):
    """The rollout engine on the model at ``base_path``, with the policy's weights: bf16 on CUDA
    (as the memory plan counts it, even where --full-finetune trains float32 weights: the push
    casts them), float32 on the CPU; on CUDA it holds as many of a step's sequences as fit beside
    the trainer."""
    dtype = str(models.device_and_dtype()[1]).removeprefix("torch.")
    if config.backend == "hf":  # transformers generate (extras/hf_engine.py), through the policy
        from extras import hf_engine

        make_engine, limits = hf_engine.make_engine, {}
    else:  # vLLM, its batch limits sized to one step's batch
        make_engine = rollout.make_engine
        limits = rollout.engine_limits(
            prompts_per_call=config.prompts_per_step,
            n=config.rollouts,
            max_prompt_len=config.max_prompt_len,
            max_model_len=config.max_seq_len,
        )
    engine = make_engine(
        base_path,
        max_model_len=config.max_seq_len,
        seed=config.seed,
        dtype=dtype,
        gpu_memory_utilization=config.gpu_memory_utilization or None,  # 0: the engine's default
        trainer_bytes=models.resident_bytes(learner.policy, learner.reference),
        model=learner.policy if config.backend == "hf" else None,  # hf samples from the policy
        **limits,
    )
    if config.resume:  # a fresh policy equals the model the engine loaded (LoRA starts at B = 0)
        engine.sync_weights(learner.policy)
    return engine


# ---- Rollouts and rewards ----------------------------------------------------------------------


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

    def select(self, rows: list[int]) -> Rollouts:
        """These rows, in this order (DAPO's refill and self-hints keep or swap groups)."""
        columns = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Rollouts(**{name: [column[r] for r in rows] for name, column in columns.items()})

    def concat(self, others: list[Rollouts]) -> Rollouts:
        """These rows, then those of ``others``."""
        names = [f.name for f in dataclasses.fields(self)]
        parts = [self, *others]
        return Rollouts(**{name: [x for p in parts for x in getattr(p, name)] for name in names})


def generate_rollouts(engine, problems: list[dict], config: Config, seed: int) -> Rollouts:
    """G completions per problem from the engine, one call, seeded."""
    sampling = rollout.SamplingConfig(
        n=config.rollouts,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        max_tokens=config.max_seq_len - config.max_prompt_len,  # the completion budget
        seed=seed,
    )
    groups = engine.generate([problem["prompt_ids"] for problem in problems], sampling)
    pairs = [(p, c) for p, group in zip(problems, groups) for c in group]  # prompt-major
    return Rollouts(
        prompt_ids=[p["prompt_ids"] for p, _ in pairs],
        completion_ids=[list(c.token_ids) for _, c in pairs],
        texts=[c.text for _, c in pairs],
        finish_reasons=[c.finish_reason for _, c in pairs],
        engine_logps=[list(c.logprobs) for _, c in pairs],
        problems=[p["problem"] for p, _ in pairs],
        answers=[p["answer"] for p, _ in pairs],
    )


def compute_rewards(rollouts: Rollouts, reward_function) -> torch.Tensor:
    """r(x, y) [N] from the reward function (Math-Verify of the final answer by default): what
    the groups' signal, the logged accuracy and self-hints read; DAPO's length penalty is added
    to the returns later (``train_on``)."""
    texts, problems, answers = rollouts.texts, rollouts.problems, rollouts.answers
    return torch.tensor(reward_function(texts, problems, answers), dtype=torch.float32)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are not all equal (the others give A = 0).

    >>> informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), group_size=2).tolist()
    [False, True]
    """
    groups = rewards.view(-1, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > 0


def collect_rollouts(engine, task: Task, config: Config, step: int, timer):
    """Prompts -> G rollouts each -> rewards, and the extras that act here (self-hints, DAPO's
    dynamic sampling). Returns (rollouts, rewards [N], metrics of the sampling)."""

    def sample(chosen: list[dict], seed: int) -> tuple[Rollouts, torch.Tensor]:
        rollouts = generate_rollouts(engine, chosen, config=config, seed=seed)
        return rollouts, compute_rewards(rollouts, task.reward_function)

    def timed_sample(chosen: list[dict], seed: int) -> tuple[Rollouts, torch.Tensor]:
        with timer("rollout"):
            rollouts = generate_rollouts(engine, chosen, config=config, seed=seed)
        with timer("reward"):
            return rollouts, compute_rewards(rollouts, task.reward_function)

    chosen = [task.problems[i] for i in task.sampler.take(config.prompts_per_step)]
    rollouts, rewards = timed_sample(chosen, rollout.rollout_seed(config.seed, step))
    metrics = {}
    if config.extras["hints"].self_hints:  # extras/hints.py
        from extras import hints

        with timer("hints"):
            rollouts, rewards, metrics = hints.self_hint(
                engine,
                rollouts,
                rewards=rewards,
                chosen=chosen,
                config=config,
                step=step,
                sample=sample,
            )
    without_signal = int((~informative_groups(rewards, config.rollouts)).sum())
    metrics["frac_zero_signal_groups"] = without_signal / config.prompts_per_step
    if config.extras["dynamic_sampling"].dynamic_sampling:  # extras/dynamic_sampling.py
        from extras import dynamic_sampling

        rollouts, rewards, refilled = dynamic_sampling.refill(
            task.sampler,
            task.problems,
            rollouts=rollouts,
            rewards=rewards,
            config=config,
            step=step,
            sample=timed_sample,
            informative=informative_groups,
        )
        metrics |= refilled  # the fraction over every round's groups
    return rollouts, rewards, metrics


# ---- The update: held-fixed log-probs, the guide's log q, advantages, the loss -----------------


def micro_batches(rollouts: Rollouts, config: Config, pad_id: int, device) -> list:
    """[(rows, batch)] per micro-batch: the batch as ``loss.collate`` makes it [B, P + C], plus the
    engine's log-probs [B, C]."""
    total, size = len(rollouts.completion_ids), config.micro_batch_size
    result = []
    for start in range(0, total, size):
        rows = list(range(start, min(start + size, total)))
        batch = loss.collate(
            [rollouts.prompt_ids[i] for i in rows],
            [rollouts.completion_ids[i] for i in rows],
            pad_id=pad_id,
            device=device,
            group_size=config.rollouts,
        )
        width = batch["completion_mask"].shape[1]
        engine_logps = [rollouts.engine_logps[i] for i in rows]
        batch["engine_logps"] = rollout.pad_rows(engine_logps, length=width, device=device)
        result.append((rows, batch))
    return result


def policy_min_p(config: Config) -> float:
    """The min-p of the distribution the loss reads: 0 (pi_T's full softmax, the default) or the
    sampler's (--loss-distribution min_p: its truncation, renormalized)."""
    return config.min_p if config.loss.distribution == "min_p" else 0.0


def sampled_logps(model, batch: dict, config: Config, min_p: float | None = None):
    """log pi(y_t) and H_t [B, C] of ``model`` at the sampler's temperature, over the distribution
    --loss-distribution names (``min_p`` overrides it)."""
    return loss.completion_logps(
        model,
        batch,
        temperature=config.temperature,
        min_p=policy_min_p(config) if min_p is None else min_p,
        fast=config.fast_logprobs,
    )


@torch.no_grad()
def held_fixed_logps(policy, reference, batch: dict, config: Config):
    """The per-token tensors that stay fixed during the update (Eq. 3), each [B, C], as a
    ``loss.HeldFixed``: the reference's log-probs and entropies (when the anchor is on), and
    pi_old's log-probs and entropies when the update needs them before its own forward pass
    (--ppo-epochs > 1: pi_old must not move between passes; k1_return: the returns need them).
    The guide's log q is computed from these signals later, by ``guide_log_q``."""
    held = loss.HeldFixed(engine_logps=batch["engine_logps"])
    if needs_reference(config):
        with reference_mode(policy, reference) as reference_policy:
            # The reference's full softmax is the anchor (the authors' too); replaying min-p there
            # would act as an implicit guide q = 1 / M_ref (docs/min-p.md).
            ref_min_p = config.min_p if config.loss.reference_min_p else 0.0
            held.ref_logps, held.ref_entropies = sampled_logps(
                reference_policy, batch, config=config, min_p=ref_min_p
            )
    if config.ppo_epochs > 1 or config.loss.kl_estimator == "k1_return":
        held.old_logps, held.entropies = sampled_logps(policy, batch, config=config)
    return held


def guide_log_q(fixed: loss.HeldFixed, mask, config: Config, step: int, generator):
    """SAGE: the guide's log q_t (Eqs. 7, 9-12) of one micro-batch, [B, C]. The one place log q
    is computed: the first time it is asked for (by the k1_return returns, else by the update's
    first pass), then held fixed like pi_old and pi_ref (Eq. 3). The guide reads pi_ref's
    signals with --guide-entropy reference (the reference pass's, at no extra cost), else
    pi_old's: the held pass's, or on-policy the update's own forward pass (at no cost either)."""
    if fixed.log_q is None:
        reads_reference = config.guide.entropy == "reference" and needs_reference(config)
        fixed.log_q = guides.compute_log_q(
            config.guide,
            fixed.ref_logps if reads_reference else fixed.old_logps,
            entropies=fixed.ref_entropies if reads_reference else fixed.entropies,
            completion_mask=mask,
            step=step,
            total_steps=config.steps,
            generator=generator,
        )
    return fixed.log_q


def kl_shaped_returns(
    rewards: torch.Tensor, batches: list, held: list, config: Config, step: int, generator
):
    """SAGE (k1_return, Eq. 8): each reward minus beta times its completion's k1 against p~ =
    pi_ref * q, so that the advantages carry the pseudo-KL and the fixed point is Eq. 4's.

    rewards: [N] on the CPU (the grader's); each micro-batch's returns come back to the CPU.
    """
    returns = []
    for (rows, batch), fixed in zip(batches, held):
        mask = batch["completion_mask"]
        shaped = loss.kl_shaped_rewards(
            rewards[rows],
            fixed.old_logps,
            ref_logps=fixed.ref_logps,
            log_q=guide_log_q(fixed, mask, config=config, step=step, generator=generator),
            completion_mask=mask,
            beta=config.loss.beta,
        )
        returns.append(shaped.cpu())
    return torch.cat(returns)


def step_advantages(
    rewards: torch.Tensor, batches: list, held: list, config: Config, step: int, generator
):
    """One advantage per completion [N]; with k1_return, of the returns the pseudo-KL shaped."""
    returns = rewards
    if config.loss.kl_estimator == "k1_return" and needs_reference(config):
        # SAGE: each return minus beta * k1 against p~ = pi_ref * q (Eq. 8)
        returns = kl_shaped_returns(
            rewards, batches, held=held, config=config, step=step, generator=generator
        )
    return loss.compute_advantages(returns, config.rollouts, kind=config.loss.advantage)


class StepMetrics:
    """Metrics over a step's micro-batches: the step's token means of the micro-batches' token
    means (entropy, kl/*, q/*, clip_ratio/*, engine/*), whatever --micro-batch-size, and the
    extremes of the "*min" / "*max" keys over the whole step."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.extremes: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        self.tokens += tokens
        for key, value in metrics.items():
            if key.endswith("min"):
                self.extremes[key] = min(self.extremes.get(key, value), value)
            elif key.endswith("max"):
                self.extremes[key] = max(self.extremes.get(key, value), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * tokens

    def result(self) -> dict[str, float]:
        return {**{key: value / self.tokens for key, value in self.sums.items()}, **self.extremes}


FIRST_UPDATE_HINT = (
    "the first update, before any AdamW step, gives it, so not --lr: to narrow it down, rerun "
    "with --no-fast-logprobs, or on CUDA with a --micro-batch-size that divides --rollouts "
    "(docs/gpu.md)"
)


def update_policy(
    policy, optimizer, batches, held, advantages, config: Config, step: int, generator
) -> dict:
    """--ppo-epochs passes over the step's rollouts, each: per micro-batch, the policy's forward
    pass, the guide's log q from it (unless the held pass gave it), the loss and its backward
    (gradients accumulate into the pass's); then a clipped AdamW step. pi_old, pi_ref and q stay
    the ``held`` ones in every pass (Eq. 3), so from the second pass the ratio and its clip act.
    Returns the passes' mean metrics: loss is what the backward passes take, the sum over
    micro-batches of loss x micro_batch_weight; grad_norm the norm before clipping."""
    if config.ppo_epochs > 1 and any(fixed.old_logps is None for fixed in held):
        raise ValueError("--ppo-epochs > 1 needs pi_old's log-probs held before the first pass")
    policy.train()
    metrics, device = StepMetrics(), next(policy.parameters()).device
    total_rows = sum(len(rows) for rows, _ in batches)
    step_tokens = float(sum(batch["completion_mask"].sum().item() for _, batch in batches))
    constant_q = config.guide.name in ("branch", "random")  # q is one number per position
    grad_norms, step_loss = [], 0.0
    for epoch in range(config.ppo_epochs):
        # a non-finite loss or gradient before any AdamW step cannot come from the learning rate
        hint = "lower --lr or --beta" if step > 0 or epoch > 0 else FIRST_UPDATE_HINT
        for (rows, batch), fixed in zip(batches, held):
            mask = batch["completion_mask"]
            logps, entropies = sampled_logps(policy, batch, config=config)  # [B, C] each
            if fixed.old_logps is None:  # on-policy, one pass: pi_old = pi_theta
                fixed = dataclasses.replace(fixed, old_logps=logps.detach(), entropies=entropies)
            guide_log_q(fixed, mask, config=config, step=step, generator=generator)  # SAGE: q
            micro_loss, micro_metrics = loss.policy_loss(
                logps,
                advantages[rows].to(device),
                completion_mask=mask,
                fixed=fixed,
                config=config.loss,
                step_tokens=step_tokens,
            )
            micro_metrics |= loss.anchor_offset(fixed.log_q, mask, q_constant=constant_q)
            if not torch.isfinite(micro_loss):
                raise FloatingPointError(f"the loss is {micro_loss.item()}: {hint}")
            weight = loss.micro_batch_weight(
                config.loss.aggregation, micro_rows=len(rows), total_rows=total_rows
            )
            (micro_loss * weight).backward()
            step_loss += micro_metrics["loss"] * weight
            gap = rollout.engine_gap(fixed.old_logps, fixed.engine_logps, mask=mask)
            metrics.add({**micro_metrics, **gap}, tokens=mask.sum().item())
        # the norm, checked before the clip scales every gradient by max_grad_norm / norm
        gradients = [p.grad for p in policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(gradients)
        if not torch.isfinite(norm):
            where = nonfinite_gradients(policy)
            raise FloatingPointError(f"the gradient norm is {norm.item()} ({where}): {hint}")
        torch.nn.utils.clip_grads_with_norm_(policy.parameters(), config.max_grad_norm, norm)
        optimizer.step()  # the next pass's ratio is pi_theta / pi_old with this step's theta
        optimizer.zero_grad(set_to_none=True)
        grad_norms.append(norm.item())
    passes = config.ppo_epochs
    return {**metrics.result(), "loss": step_loss / passes, "grad_norm": sum(grad_norms) / passes}


def nonfinite_gradients(policy) -> str:
    """Where a non-finite gradient norm comes from, for its error line: how many trained tensors
    have a gradient that is not finite, and the one nearest the loss (the last in the model's
    order, which the backward pass reaches first: the layers before it inherit its NaN).

    >>> layer = torch.nn.Linear(2, 1)
    >>> layer(torch.tensor([[1.0, float("nan")]])).sum().backward()  # d/d weight = the input
    >>> nonfinite_gradients(layer)
    'not finite in 1 of 2 gradients, the one nearest the loss: weight'
    """
    gradients = {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}
    names = [name for name, gradient in gradients.items() if not gradient.isfinite().all()]
    if not names:
        return "every gradient is finite: their norm overflowed"
    return (
        f"not finite in {len(names)} of {len(gradients)} gradients, the one nearest the loss: "
        f"{names[-1]}"
    )


def train_on(learner: Learner, rollouts: Rollouts, rewards, config: Config, step, timer) -> dict:
    """Steps 2-4 of an RL step on its graded rollouts [N], rewards [N]: per micro-batch what the
    update holds fixed (pi_ref's log-probs; pi_old's and log q when they must come before it),
    the advantages, then the update itself; its metrics."""
    policy, generator = learner.policy, learner.guide_generator
    batches = micro_batches(rollouts, config, pad_id=learner.pad_id, device=policy.device)
    # 2. what the update holds fixed: pi_ref's log-probs (pi_old's, log q if needed)
    with timer("reference"):
        held = [
            held_fixed_logps(policy, learner.reference, batch, config=config)
            for _, batch in batches
        ]
    # 3. advantages of the returns: the rewards, less DAPO's length penalty with --overlong-buffer
    # (the groups were chosen by the rewards alone, as DAPO does), less the pseudo-KL with k1_return
    returns, shaping = rewards, {}
    if config.extras["dynamic_sampling"].overlong_buffer > 0:
        from extras import dynamic_sampling

        penalty = dynamic_sampling.overlong_penalty_of(rollouts, config)  # [N], in [-1, 0]
        returns, shaping = rewards + penalty, {"overlong_penalty": penalty.mean().item()}
    advantages = step_advantages(
        returns, batches, held=held, config=config, step=step, generator=generator
    )
    # 4. per micro-batch: forward pass -> log q -> loss -> backward; per pass, AdamW
    with timer("update"):
        return shaping | update_policy(
            policy,
            learner.optimizer,
            batches=batches,
            held=held,
            advantages=advantages,
            config=config,
            step=step,
            generator=generator,
        )


def evaluate_if_due(engine, policy, tokenizer, benchmarks, config: Config, logger, updates: int):
    """pass@k (and, with --eval-solution-key, the support probe) after ``updates`` optimizer
    steps when --eval-every says so (evaluate.py); its rows to eval.jsonl and the trackers. No
    benchmarks: evaluation is off."""
    if benchmarks and evaluate.due(config, benchmarks, updates=updates):
        rows = evaluate.training_evaluation(
            engine, tokenizer, benchmarks, config, updates=updates, policy=policy
        )
        logger.log_evaluation(rows)


# ---- main(): the run, stage by stage -----------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv)
    run_dir, forecast_gb = start_run(config)
    # ---- the problems and the reward, before any model loads (a bad --answer-key costs none) ----
    tokenizer = models.load_tokenizer(config.model)  # (an SFT start keeps it)
    sft_only = config.extras["sft"].sft_only  # (trains no policy: no RL data)
    task = None if sft_only else load_task(config, tokenizer)
    held_out = evaluate.training_benchmarks(config) if config.eval.eval_every > 0 else {}
    base_path = config.model
    if config.extras["sft"].sft_dataset:  # App. E.2: the SFT warm start (--sft-only ends there)
        from extras import sft

        base_path = sft.warm_start(config, run_dir, wrap_lora=wrap_lora)
    # ---- the policy, pi_ref and AdamW; the engine ----
    learner = load_policy(config, base_path, pad_id=tokenizer.pad_token_id)
    runs.save_run_config(run_dir, config)  # the run can start: data, reward and model loaded
    policy, optimizer, scheduler = learner.policy, learner.optimizer, learner.scheduler
    state = (policy, optimizer, scheduler, task.sampler, learner.guide_generator, tokenizer)
    start = runs.restore_or_start(config.resume, run_dir, state=state)
    logger = runs.RunLogger(config, run_dir, forecast_gb=forecast_gb, start=start)
    with runs.CountedMemory() as engine_memory:  # CUDA: what the engine keeps in torch's counters
        engine = start_engine(config, base_path, learner)
    if start == 0:  # pass@k (and the probe) of the starting policy, not again on a resume
        evaluate_if_due(engine, policy, tokenizer, held_out, config, logger=logger, updates=0)
    with tqdm(desc="rl", initial=start, total=config.steps) as progress:
        for step in range(start, config.steps):
            timer = runs.PhaseTimer(engine=engine_memory)  # the trainer's peaks, engine left out
            # 1. prompts -> G rollouts each -> rewards (and the extras that act here)
            rollouts, rewards, metrics = collect_rollouts(
                engine, task, config=config, step=step, timer=timer
            )
            with timer("sleep"):
                engine.sleep(level=2)  # CUDA: drop the engine's weights and KV cache
            if rewards.numel() > 0:  # (dynamic sampling may leave no group with signal)
                # 2-4. what the update holds fixed, the advantages, the update (AdamW)
                metrics |= train_on(
                    learner, rollouts, rewards=rewards, config=config, step=step, timer=timer
                )
            # 5. the weight push into the engine
            with timer("sync"):
                engine.sync_weights(policy)
            # 6. metrics, and pass@k every --eval-every steps
            logger.log_step(
                step,
                rollouts,
                rewards=rewards,
                metrics=metrics,
                timer=timer,
                lr=scheduler.get_last_lr()[0],  # the one this step trained with
                progress=progress,
            )
            scheduler.step()
            evaluate_if_due(engine, policy, tokenizer, held_out, config, logger, updates=step + 1)
            progress.update()
            # 7. checkpoint (and --stop-after)
            if runs.checkpoint_if_due(run_dir, step, start=start, config=config, state=state):
                break
    logger.close()
    engine.close()
    return {"run_dir": run_dir, "finished": progress.n >= config.steps}  # every step done


if __name__ == "__main__":
    cli.run(main)
