"""SAGE trainer: from-scratch GRPO with a guided anchor (arXiv 2605.18864), one file, top to bottom.

    python sage.py                                   # the embedded CPU demo (tiny model, toy task)
    python sage.py --model Qwen/Qwen2.5-Math-7B --sft-dataset unsloth/OpenMathReasoning-mini

One optimizer step of ``main()`` is the paper's section 5 / App. E, in this order:

    sample prompts -> rollouts (rollout.py, vLLM) -> rewards (task.py, Math-Verify)
    -> [DAPO dynamic sampling] -> advantages (loss.py) -> old / reference log-probs
    -> the guide's log q from the same forward pass (guides.py, Eqs. 9-12)
    -> loss (clipped surrogate + beta * pseudo-KL against p~ = pi_ref * q, Eqs. 3-8)
    -> AdamW step (linear warmup and decay, gradient clipping) -> weight sync into vLLM
    -> metrics -> checkpoint

Before RL, base models get the paper's SFT warm start (App. E.2). Where this differs from the
paper's code (a subclass of TRL's GRPOTrainer):

* The guide's schedule is a pure function of the optimizer step (the authors' code advanced it
  once per micro-batch). The guide is computed from the policy forward pass that the update
  already makes: no extra pass.
* The min-p mask of the sampler is replayed when computing log-probs, so the update is on-policy
  (TRL ignores min-p). Old log-probs come from the trainer, never from the engine; truncated
  importance sampling against the engine's log-probs is an option (``--tis-cap``).
* ``--kl-estimator k1_return`` realizes Eq. 4 exactly; the default ``k3`` is the paper's choice,
  whose fixed point is of forward-KL form (README, "What --kl-estimator does").
* BNPO is the paper's *advantage* (Beta normalization); TRL's "bnpo" loss type is called
  ``batch_token_mean`` here.
* The reference policy is the base model with the LoRA adapter switched off (no second copy);
  a frozen copy exists only with ``--full-finetune``.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

# OpenMP threads spin about a millisecond between kernels, then sleep: on a 2-core CPU where the
# trainer, the colocated vLLM engine and the grading workers take turns, sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) made `make demo` 40% slower (169 s against 119 s, same figures), and
# spinning without bound (ACTIVE) would hold a core while the graders need it. No effect on GPU work.
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import cli  # noqa: E402
import demo  # noqa: E402
import guides  # noqa: E402
import hints  # noqa: E402
import loss  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
import runs  # noqa: E402
from data import (  # noqa: E402
    DataError, Problem, PromptSampler, load_rows, resolve_benchmarks, sft_examples, tokenize_sft_examples,
    training_problems,
)
from evaluate import EvalSampling, evaluation_rows  # noqa: E402
from task import RewardError, build_prompt_ids, chat_ids, load_reward_function, math_reward  # noqa: E402
from trackers import TrackerError, Trackers  # noqa: E402

# --------------------------------------------------------------------------------------------
# 1. Configuration: one typed dataclass, a docstring per field, parsed once
# --------------------------------------------------------------------------------------------


# Presets: values for the fields the user did not set. BNPO is the Beta-normalized advantage with
# TRL's "bnpo" token-mean aggregation; DAPO is clip-higher, the global token mean and dynamic
# sampling. The paper runs both without KL.
PRESETS = {
    "grpo": dict(advantage="grpo", loss_agg="grpo", eps_high=0.2, kl="reverse", dynamic_sampling=False),
    "dr_grpo": dict(advantage="dr_grpo", loss_agg="dr_grpo", eps_high=0.2, kl="reverse", dynamic_sampling=False),
    "bnpo": dict(advantage="bnpo", loss_agg="batch_token_mean", eps_high=0.2, kl="none", dynamic_sampling=False),
    "dapo": dict(advantage="grpo", loss_agg="dapo", eps_high=0.28, kl="none", dynamic_sampling=True),
}


@dataclass
class Config:
    """Every knob of the paper's run; the defaults are the paper's (section 5.1, App. E, Tables 7-8)."""

    # ---- model and data ----
    model: str = ""
    """Policy: a hub name or a local model directory. Empty runs the embedded CPU demo."""
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
    # ---- SFT warm start for base models (App. E.2, Table 7) ----
    sft_dataset: str = ""
    """SFT data (e.g. unsloth/OpenMathReasoning-mini) or a local file; empty skips SFT."""
    sft_dataset_config: str = ""
    """Hub configuration name of the SFT dataset."""
    sft_split: str = "cot"
    """Split of the SFT dataset (OpenMathReasoning-mini: cot)."""
    sft_problem_key: str = "problem"
    """SFT field with the problem."""
    sft_reasoning_key: str = "generated_solution"
    """SFT field with the worked solution (placed between the working-out markers)."""
    sft_answer_key: str = "expected_answer"
    """SFT field with the final answer (placed between <SOLUTION> markers)."""
    sft_max_samples: int = 500
    """Use the first N SFT examples that fit (0: all; App. E.2 uses a small subset)."""
    sft_max_tokens: int = 0
    """Drop SFT examples longer than this, prompt + completion + EOS (0: half of --max-seq-len, App. E.2)."""
    sft_only: bool = False
    """Stop after the SFT stage (its model, <run>/sft_model, is the base of every RL run of Table 1; the demo's too)."""
    sft_epochs: int = 2
    """SFT epochs (paper: 2)."""
    sft_lr: float = 2e-4
    """SFT learning rate (paper: 2e-4)."""
    sft_batch_size: int = 1
    """SFT batch size (paper: 1)."""
    sft_warmup_steps: int = 5
    """SFT linear warmup steps (paper: 5)."""
    # ---- the RL step ----
    algo: str = "grpo"
    """Preset: grpo | dapo | bnpo | dr_grpo; sets the advantage, aggregation, clip and KL (``PRESETS``)."""
    steps: int = 1000
    """Optimizer steps of RL (paper: 1,000)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step (paper: 8)."""
    rollouts: int = rollout.SamplingConfig.n
    """Completions per prompt, the group size G (paper: 8)."""
    reward: str = ""
    """The reward: empty for Math-Verify of the final answer (section 5.1), else module:function or file.py:function, called as f(completions, problems, answers) -> one float each."""
    micro_batch_size: int = 4
    """Sequences per forward/backward; the step's 64 sequences are accumulated (4 fits a 7B on 80 GB)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts (1: on-policy, the ratio is 1 at the first pass)."""
    advantage: str | None = None
    """grpo | dr_grpo | rloo | bnpo (Beta-normalized); unset: the preset's."""
    loss_agg: str | None = None
    """grpo | batch_token_mean | dr_grpo | dapo; unset: the preset's."""
    eps_low: float = 0.2
    """Lower clip of the ratio (paper: 0.2)."""
    eps_high: float | None = None
    """Upper clip of the ratio; unset: the preset's (0.2, DAPO 0.28)."""
    dynamic_sampling: bool | None = None
    """DAPO: drop all-equal-reward groups and refill; unset: the preset's (on for dapo)."""
    max_refill_rounds: int = 4
    """DAPO dynamic sampling: extra rollout rounds at most before training on what is left."""
    overlong_buffer: int = 0
    """DAPO overlong shaping L_cache in tokens (0: off)."""
    self_hints: bool = False
    """Self-hints (arXiv 2602.03143, hints.py): all-wrong groups get a policy-written hint from the reference solution and are sampled again."""
    solution_key: str = ""
    """Field of the training data with the reference solution that self-hints are written from (the demo: its working)."""
    # ---- the anchor and the guide ----
    guide: str = "none"
    """none | random (Eq. 9) | token (Eq. 10) | branch (Eq. 11)."""
    tau: float = guides.GuideConfig.tau
    """Branch guide: entropy threshold in nats (paper: 1.2)."""
    ratio: float = guides.GuideConfig.ratio
    """Branch guide: slope above the threshold (paper: 0.3)."""
    q_min: float = guides.GuideConfig.q_min
    """Guide clamp, lower (paper: 0.6)."""
    q_max: float = guides.GuideConfig.q_max
    """Guide clamp, upper (paper: 1.4)."""
    token_normalization: str = guides.GuideConfig.token_normalization
    """Token guide: percentile | rank | sigmoid."""
    kl: str | None = None
    """reverse | forward | none; unset: the preset's (reverse for grpo/dr_grpo; with a guide, always reverse)."""
    kl_estimator: str = "k3"
    """k3 (paper) | k2 | ratio_k3 | k1_return (realizes Eq. 4); see the README."""
    beta: float = 0.05
    """KL coefficient (paper: 0.05)."""
    reference_min_p: bool = False
    """Replay the sampler's min-p on the reference's log-probs too (off: its full softmax, as the authors' code; docs/min-p.md)."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap C on pi_old / pi_engine (0: off; 2 is usual)."""
    # ---- optimization ----
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
    """Train all weights instead of LoRA (the reference is then a frozen copy; float32 weights on CUDA, since
    AdamW's small steps round away in bf16)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward (a 7B keeps ~6 MB of activations per token without it)."""
    # ---- sampling ----
    max_seq_len: int = 2048
    """Prompt + completion tokens (paper: 2,048; R1-distill: 8,192)."""
    max_prompt_len: int = 512
    """Longer prompts are dropped from the training set; completions get --max-seq-len minus this."""
    temperature: float = rollout.SamplingConfig.temperature
    """Sampling temperature (paper: 1.0)."""
    min_p: float = rollout.SamplingConfig.min_p
    """Sampling min-p (paper: 0.01); replayed in the trainer's log-probs."""
    top_p: float = rollout.SamplingConfig.top_p
    """Sampling top-p (paper: 1.0)."""
    top_k: int = rollout.SamplingConfig.top_k
    """Sampling top-k (-1: off, paper)."""
    # ---- run ----
    seed: int = 3407
    """Seed of everything (paper: 3407)."""
    out: str = "runs"
    """Directory of runs; this run writes to <out>/<name>."""
    name: str = ""
    """Run name (default: <model>-<algo>-<guide>)."""
    resume: bool = False
    """Continue from <out>/<name>/checkpoint exactly where the run stopped."""
    stop_after: int = 0
    """Stop after this many steps of this invocation, checkpointed, for --resume later (0: run to the end)."""
    backend: str = "vllm"
    """Rollout engine: vllm | hf."""
    gpu_memory_utilization: float | None = None
    """vLLM's share of the GPU beside the trainer (default 0.3); on CPU, the share of RAM for its KV cache (0.05)."""
    save_every: int = 50
    """Checkpoint every N steps (and at the end)."""
    report_to: str = "jsonl"
    """Where metrics go, comma-separated: jsonl (always, metrics.jsonl), tensorboard, wandb (WANDB_MODE=offline works without network)."""
    zero_reward_warning: int = 20
    """Warn after this many consecutive steps whose rewards are all zero."""
    # ---- evaluation during training (the final Table 1 evaluation is evaluate.py's) ----
    eval_every: int = 0
    """Evaluate pass@k before the first step, every N steps and after the last, through the training engine (0: off); rows go to <run>/eval.jsonl."""
    eval_benchmarks: str = ""
    """Benchmarks of --eval-every: names (aime, amc23, math500-l5, ...) or local files with problem/answer fields; the demo: its held-out problems."""
    eval_n: int = 8
    """Samples per problem of --eval-every (pass@k for k = 1, 2, 4, ..., n)."""
    eval_temperature: float = EvalSampling.temperature
    """Sampling temperature of --eval-every (the paper's evaluation config)."""
    eval_top_p: float = EvalSampling.top_p
    """Top-p of --eval-every (the paper's evaluation config)."""
    # ---- the embedded demo's sizes ----
    demo_eval_problems: int = 100
    """Demo: held-out problems (of the 400) for pass@k before and after RL."""
    demo_sft_examples: int = 2400
    """Demo: SFT examples drawn from the training problems."""
    demo_sft_noise: float = 0.2
    """Demo: fraction of SFT examples whose final answer is off by 1 or 2, so RL has work left."""
    demo_hard_noise: float = 0.9
    """Demo: fraction of SFT examples of the hard sums (10 and more) that forget the carry: their answer becomes rare."""

    def __post_init__(self):
        """Fields left unset take the --algo preset's value, so a Config built in code is as complete
        as one parsed from the command line. A guide acts only through the anchor p~ = pi_ref * q,
        so with a guide an unset KL is reverse even where the preset has none."""
        for key, value in PRESETS.get(self.algo, {}).items():  # an unknown --algo: validate_config says so
            if getattr(self, key) is None:
                setattr(self, key, "reverse" if key == "kl" and self.guide != "none" else value)



def parse_config(argv: list[str] | None = None) -> Config:
    """CLI -> Config: explicit flags win, then the demo sizes (no --model), then the --algo preset,
    then the defaults."""
    demo_sizes = ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in demo.DEMO_SIZES.items())
    explicit, parser = cli.parse(
        Config, argv, prog="sage.py", description=__doc__.split("\n")[0],
        epilog="The defaults shown are those of a --model run: the paper's settings, sized for one 80 GB GPU "
               "shared with the colocated vLLM engine (gradient checkpointing on, micro-batch 4, the engine "
               f"sleeping during the update). Without --model (the CPU demo) they become: {demo_sizes}.",
    )
    config = Config(**{**({} if explicit.get("model") else demo.DEMO_SIZES), **explicit})
    validate_config(config, parser.error)
    return config


def validate_config(config: Config, error) -> None:
    """One-line errors for settings that cannot run."""
    if config.algo not in PRESETS:  # first: the fields it would have set are still unset
        error(f"unknown --algo {config.algo!r}: choose one of {', '.join(PRESETS)}")
    checks = [
        (config.guide in guides.GUIDES, f"unknown --guide {config.guide!r}: choose one of {', '.join(guides.GUIDES)}"),
        (config.kl in loss.KL_MODES, f"unknown --kl {config.kl!r}: choose one of {', '.join(loss.KL_MODES)}"),
        (config.kl_estimator in loss.KL_ESTIMATORS, f"unknown --kl-estimator {config.kl_estimator!r}: choose one of {', '.join(loss.KL_ESTIMATORS)}"),
        (config.advantage in loss.ADVANTAGES, f"unknown --advantage {config.advantage!r}: choose one of {', '.join(loss.ADVANTAGES)}"),
        (config.loss_agg in loss.AGGREGATIONS, f"unknown --loss-agg {config.loss_agg!r}: choose one of {', '.join(loss.AGGREGATIONS)}"),
        (config.backend in rollout.BACKENDS, f"unknown --backend {config.backend!r}: choose one of {', '.join(rollout.BACKENDS)}"),
        (config.steps >= 1, "--steps must be >= 1"),
        (config.prompts_per_step >= 1, "--prompts-per-step must be >= 1"),
        (config.rollouts >= 2, "--rollouts must be >= 2 (group advantages compare completions of one prompt)"),
        (config.micro_batch_size >= 1, "--micro-batch-size must be >= 1"),
        (config.max_prompt_len < config.max_seq_len, "--max-prompt-len must be below --max-seq-len"),
        (config.beta >= 0, "--beta must be >= 0"),
        (0 <= config.eps_low < 1 and config.eps_high >= 0, "--eps-low must be in [0, 1) and --eps-high >= 0"),
        (not (config.guide != "none" and (config.kl == "none" or config.beta == 0)),
         f"--guide {config.guide} acts only through the KL anchor: use --kl reverse with --beta > 0"),
        (config.kl_estimator != "k1_return" or config.kl == "reverse", "--kl-estimator k1_return needs --kl reverse"),
        (not config.sft_only or not config.model or config.sft_dataset, "--sft-only with --model needs --sft-dataset"),
    ]
    for ok, message in checks:
        if not ok:
            error(message)


# --------------------------------------------------------------------------------------------
# 2. The rollout engine, colocated with the trainer
# --------------------------------------------------------------------------------------------


def start_engine(config: Config, base_path: str, policy):
    """The rollout engine on the base model, in the trainer's dtype, holding the policy's weights."""
    dtype = "bfloat16" if models.device_and_dtype()[1] == torch.bfloat16 else "float32"
    limits = rollout.engine_limits(config.prompts_per_step, config.rollouts, config.max_prompt_len,
                                   config.max_seq_len) if config.backend == "vllm" else {}
    engine = rollout.make_engine(base_path, config.backend, max_model_len=config.max_seq_len, seed=config.seed,
                                 dtype=dtype, gpu_memory_utilization=config.gpu_memory_utilization,
                                 model=policy if config.backend == "hf" else None, **limits)
    if config.resume:  # a fresh policy equals the base the engine loaded (LoRA starts at B = 0)
        engine.sync_weights(policy)
    return engine


# --------------------------------------------------------------------------------------------
# 3. SFT warm start (App. E.2)
# --------------------------------------------------------------------------------------------


def sft(model, pairs: list[tuple[list[int], list[int]]], pad_token_id: int, config: Config, epochs: int, lr: float,
        batch_size: int, warmup_steps: int, progress: bool = True) -> list[float]:
    """Supervised fine-tuning on completion tokens only; returns the per-step losses.

    Paper (Table 7): 2 epochs, batch 1, lr 2e-4, linear schedule, 5 warmup steps, weight decay 0.01,
    on examples whose whole text is at most half the max length (``tokenize_sft_examples``).
    """
    device = next(model.parameters()).device
    total_steps = epochs * math.ceil(len(pairs) / batch_size)
    optimizer, scheduler = models.make_optimizer(model, lr, config.weight_decay, total_steps, warmup_steps)
    rng, losses = random.Random(config.seed), []
    model.train()
    with tqdm(total=total_steps, desc="sft", disable=not progress) as bar:
        for _ in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for start in range(0, len(order), batch_size):
                chosen = [pairs[i] for i in order[start : start + batch_size]]
                batch = loss.collate([p for p, _ in chosen], [c for _, c in chosen], pad_token_id, device)
                logps, _ = loss.completion_logps(model, batch, 1.0, 0.0)
                mask = batch["completion_mask"]
                step_loss = -(logps * mask).sum() / mask.sum()
                step_loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(step_loss.item())
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def run_sft_stage(config: Config, run_dir: str) -> str:
    """SFT with LoRA (App. E.2), merged into the base and saved as <run>/sft_model for RL.

    <run>/sft_stats.json records how many examples were kept and how many were dropped (a
    non-numeric answer, or longer than --sft-max-tokens).
    """
    model, tokenizer = models.load_base_model(config.model, config.gradient_checkpointing)
    rows = load_rows(config.sft_dataset, config.sft_dataset_config, config.sft_split)
    examples, not_numeric = sft_examples(rows, config.sft_problem_key, config.sft_reasoning_key,
                                         config.sft_answer_key, config.sft_dataset)
    max_tokens = config.sft_max_tokens or config.max_seq_len // 2
    pairs, stats = tokenize_sft_examples(tokenizer, examples, max_tokens, config.sft_max_samples)
    runs.write_json_atomic(os.path.join(run_dir, "sft_stats.json"), {**stats, "dropped_not_numeric": not_numeric})
    tqdm.write(f"sft: {stats['kept']} examples of at most {max_tokens} tokens "
               f"({stats['dropped_too_long']} longer ones and {not_numeric} non-numeric ones dropped)")
    model = models.wrap_lora(model, config.lora_rank, config.lora_alpha)
    sft(model, pairs, tokenizer.pad_token_id, config, config.sft_epochs, config.sft_lr, config.sft_batch_size,
        config.sft_warmup_steps)
    final = runs.save_model_atomic(model.merge_and_unload(), tokenizer, os.path.join(run_dir, "sft_model"))
    del model
    gc.collect()  # return the SFT model's GPU memory before RL loads its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return final


def demo_base_model(config: Config, run_dir: str) -> str:
    """The demo's base model: the tiny model built by code, SFT-ed on the demo task (with a
    fraction of wrong answers, so RL has work left), saved as <run>/sft_model."""
    base_dir = os.path.join(run_dir, "sft_model")
    if os.path.exists(os.path.join(base_dir, "config.json")):
        return base_dir
    train, _ = demo.demo_problems(config.seed, config.demo_eval_problems)
    init_dir = demo.save_tiny_model(os.path.join(run_dir, "init_model"), seed=config.seed, hidden_size=128,
                                    num_layers=2, num_heads=2, max_position_embeddings=config.max_seq_len)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    examples = demo.demo_sft_examples(train, config.demo_sft_examples, config.demo_sft_noise, config.demo_hard_noise,
                                      config.seed + 1)
    pairs, _ = tokenize_sft_examples(tokenizer, examples, config.max_seq_len)
    sft(model, pairs, tokenizer.pad_token_id, config, config.sft_epochs, config.sft_lr, config.sft_batch_size,
        config.sft_warmup_steps)
    runs.save_model_atomic(model, tokenizer, base_dir)
    shutil.rmtree(init_dir, ignore_errors=True)
    return base_dir


# --------------------------------------------------------------------------------------------
# 4. The RL step's pieces, in execution order
# --------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """One step's samples, flattened prompt-major: row i is completion i % G of prompt i // G."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    engine_logps: list[list[float]]
    problems: list[str]
    answers: list[str]

    def select(self, rows: list[int]) -> Rollouts:
        """The given rows, in order."""
        return Rollouts(*([getattr(self, f.name)[r] for r in rows] for f in dataclasses.fields(self)))

    def replace_groups(self, groups: list[int], other: Rollouts, group_size: int) -> Rollouts:
        """These rollouts with groups ``groups`` taken from ``other`` (whose groups follow that list)."""
        source = {g: i for i, g in enumerate(groups)}
        rows = [(other, source[r // group_size] * group_size + r % group_size) if r // group_size in source else (self, r)
                for r in range(len(self.texts))]
        return Rollouts(*([getattr(part, f.name)[row] for part, row in rows] for f in dataclasses.fields(self)))

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        return Rollouts(*([x for part in parts for x in getattr(part, f.name)] for f in dataclasses.fields(Rollouts)))


def generate_rollouts(engine, prompts: list[list[int]], problems: list[dict], config: Config, seed: int) -> Rollouts:
    """G completions per prompt from the engine, one call, seeded."""
    sampling = rollout.SamplingConfig(
        n=config.rollouts, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
        min_p=config.min_p, max_tokens=config.max_seq_len - config.max_prompt_len, seed=seed,
    )
    groups = engine.generate(prompts, sampling)
    flat = [(prompt, problem, c) for prompt, problem, group in zip(prompts, problems, groups) for c in group]
    return Rollouts(
        prompt_ids=[prompt for prompt, _, _ in flat],
        completion_ids=[list(c.token_ids) for _, _, c in flat],
        texts=[c.text for _, _, c in flat],
        finish_reasons=[c.finish_reason for _, _, c in flat],
        engine_logps=[list(c.logprobs) for _, _, c in flat],
        problems=[problem["problem"] for _, problem, _ in flat],
        answers=[problem["answer"] for _, problem, _ in flat],
    )


def compute_rewards(rollouts: Rollouts, config: Config, reward_function=math_reward) -> torch.Tensor:
    """r(x, y) from the reward function (Math-Verify of the final answer by default) [N], plus
    DAPO's overlong shaping when --overlong-buffer > 0."""
    rewards = torch.tensor(reward_function(rollouts.texts, rollouts.problems, rollouts.answers), dtype=torch.float32)
    if config.overlong_buffer > 0:
        max_len = config.max_seq_len - config.max_prompt_len
        lengths = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float32)
        rewards = rewards + overlong_penalty(lengths, max_len, config.overlong_buffer)
    return rewards


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO: 0 up to L_max - L_cache, then linear down to -1 at L_max, -1 beyond.

    >>> overlong_penalty(torch.tensor([50.0, 90.0, 100.0, 120.0]), max_len=100, buffer=20)
    tensor([ 0.0000, -0.5000, -1.0000, -1.0000])
    """
    start = max_len - buffer
    return ((start - lengths) / buffer).clamp(-1.0, 0.0)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are not all equal (the others give A = 0)."""
    groups = rewards.view(-1, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > 0


def self_hint(engine, rollouts: Rollouts, rewards: torch.Tensor, chosen: list[dict], config: Config, step: int,
              reward_function, stats: hints.HintStats) -> tuple[Rollouts, torch.Tensor]:
    """Self-hinting (hints.py): the policy writes hints for the all-wrong groups from their
    reference solutions; levels 1, 2, 3 in turn, each still-unsolved group is sampled again on
    prompt + hint, graded against its original answer, and replaces its unhinted group."""
    group_size, tokenizer = config.rollouts, engine.tokenizer
    unsolved = [g for g, group in enumerate(rewards.view(-1, group_size)) if group.max() <= 0]
    asking = [g for g in unsolved if chosen[g].get("solution")]
    stats.groups_needing_hint, stats.missing_solution = len(unsolved), len(unsolved) - len(asking)
    requests = {g: chat_ids(tokenizer, hints.hint_request_messages(chosen[g]["problem"], chosen[g]["solution"]))
                for g in asking}
    requests = {g: ids for g, ids in requests.items() if len(ids) <= config.max_prompt_len}
    if not requests:
        return rollouts, rewards
    writing = rollout.SamplingConfig(n=1, temperature=config.eval_temperature, top_p=config.eval_top_p, min_p=config.min_p,
                                     max_tokens=config.max_seq_len - config.max_prompt_len,
                                     seed=rollout.rollout_seed(config.seed, step, 1000))
    replies = engine.generate(list(requests.values()), writing)
    levels = {g: hints.parse_hint_levels(group[0].text) for g, group in zip(requests, replies)}
    kept_hint = {}  # group -> the hint its final rollouts were sampled with
    for number, level in enumerate(hints.LEVELS, start=1):
        targets = [g for g in requests if level in levels[g] and rewards.view(-1, group_size)[g].max() <= 0]
        hinted = {g: build_prompt_ids(tokenizer, hints.hinted_problem(chosen[g]["problem"], levels[g][level]))
                  for g in targets}
        targets = [g for g in targets if len(hinted[g]) <= config.max_prompt_len]
        if not targets:
            continue
        again = generate_rollouts(engine, [hinted[g] for g in targets], [chosen[g] for g in targets], config,
                                  rollout.rollout_seed(config.seed, step, 1000 + number))
        again_rewards = compute_rewards(again, config, reward_function)  # the original problem and answer
        rollouts = rollouts.replace_groups(targets, again, group_size)
        rows = torch.tensor([g * group_size + i for g in targets for i in range(group_size)])
        rewards = rewards.clone().index_put_((rows,), again_rewards)
        kept_hint.update({g: levels[g][level] for g in targets})
    hinted_groups = sorted(kept_hint)  # resampled on a hint (a hint too long at every level is not)
    stats.groups_hinted = len(hinted_groups)
    stats.hint_chars += [len(kept_hint[g]) for g in hinted_groups]
    stats.leaked += sum(hints.leaks_answer(kept_hint[g], chosen[g]["answer"]) for g in hinted_groups)
    groups = rewards.view(-1, group_size)
    stats.groups_solved_by_hint = sum(int(groups[g].max() > 0) for g in hinted_groups)
    stats.reward_with_hints = groups[hinted_groups].flatten().tolist()
    stats.reward_without_hints = groups[[g for g in range(len(groups)) if g not in hinted_groups]].flatten().tolist()
    return rollouts, rewards


def collect_rollouts(engine, sampler: PromptSampler, prompts: list[list[int]], problems: list[dict], config: Config,
                     step: int, reward_function=math_reward, timer: runs.PhaseTimer | None = None,
                     hint_stats: hints.HintStats | None = None) -> tuple[Rollouts, torch.Tensor, int, int]:
    """Prompts -> G completions each -> rewards; with DAPO's dynamic sampling, the groups whose
    rewards are all equal (no signal) are dropped and fresh prompts refill the batch.

    Returns (rollouts, rewards [N], groups sampled, groups without signal).
    """
    timer = timer or runs.PhaseTimer()
    chosen = sampler.take(config.prompts_per_step)
    with timer("rollout"):
        rollouts = generate_rollouts(engine, [prompts[i] for i in chosen], [problems[i] for i in chosen], config,
                                     rollout.rollout_seed(config.seed, step))
    with timer("reward"):
        rewards = compute_rewards(rollouts, config, reward_function)
    if config.self_hints:
        with timer("hints"):
            rollouts, rewards = self_hint(engine, rollouts, rewards, [problems[i] for i in chosen], config, step,
                                          reward_function, hint_stats)
    informative = informative_groups(rewards, config.rollouts)
    num_groups, num_zero_signal = config.prompts_per_step, int((~informative).sum())
    if hint_stats is not None:
        hint_stats.prompts, hint_stats.prompts_with_signal = num_groups, num_groups - num_zero_signal
    if not config.dynamic_sampling:
        return rollouts, rewards, num_groups, num_zero_signal
    wanted = config.prompts_per_step * config.rollouts
    kept = [(rollouts, rewards, informative)]
    for refill_round in range(1, config.max_refill_rounds + 1):
        if sum(int(flags.sum()) for _, _, flags in kept) * config.rollouts >= wanted:
            break
        chosen = sampler.take(config.prompts_per_step)
        with timer("rollout"):
            more = generate_rollouts(engine, [prompts[i] for i in chosen], [problems[i] for i in chosen], config,
                                     rollout.rollout_seed(config.seed, step, refill_round))
        with timer("reward"):
            more_rewards = compute_rewards(more, config, reward_function)
        more_informative = informative_groups(more_rewards, config.rollouts)
        num_groups += config.prompts_per_step
        num_zero_signal += int((~more_informative).sum())
        kept.append((more, more_rewards, more_informative))
    rows = [[g * config.rollouts + i for g in flags.nonzero().flatten().tolist() for i in range(config.rollouts)]
            for _, _, flags in kept]
    rollouts = Rollouts.concat([part.select(part_rows) for (part, _, _), part_rows in zip(kept, rows)])
    rewards = torch.cat([part_rewards[part_rows] for (_, part_rewards, _), part_rows in zip(kept, rows)])
    return rollouts.select(list(range(min(len(rewards), wanted)))), rewards[:wanted], num_groups, num_zero_signal


@torch.no_grad()
def held_fixed_logps(policy, frozen_reference, batch: dict, config: Config, need_old: bool) -> dict:
    """The per-token log-probs that stay fixed during the update: the reference's (unless beta = 0
    or no KL) and, when the update needs them before its own forward pass (ppo_epochs > 1, or
    k1_return), the old policy's log-probs and entropies (with the sampler's min-p, on-policy).
    Each [B, C]."""
    fixed = {}
    if config.kl != "none" and config.beta > 0:
        with models.reference_mode(policy, frozen_reference) as reference:
            # The reference's full softmax (the authors' anchor); replaying min-p there too would
            # act as an implicit guide q = 1 / M_ref >= 1 at every position (docs/min-p.md).
            ref_min_p = config.min_p if config.reference_min_p else 0.0
            fixed["ref_logps"], _ = loss.completion_logps(reference, batch, config.temperature, ref_min_p)
    if need_old:
        fixed["old_logps"], fixed["entropies"] = loss.completion_logps(policy, batch, config.temperature, config.min_p)
    return fixed


def return_shaped_advantages(rewards: torch.Tensor, micro_batches: list[list[int]], batches: list[dict], held_fixed: list[dict],
                             config: Config, guide_config: guides.GuideConfig, guide_generator: torch.Generator,
                             step: int) -> torch.Tensor:
    """``--kl-estimator k1_return`` (realizes Eq. 4): the guide's log q first, then each reward
    minus beta times its completion's sequence-level k1 against p~ (Eq. 8), then the advantages.

    rewards: [N] on the CPU (the grader's); the log-probs in ``held_fixed`` live on the model's
    device, so each micro-batch's shaped rewards come back to the CPU before they meet. Stores
    each micro-batch's log_q in ``held_fixed`` for the loss.
    """
    shaped = []
    for rows, batch, fixed in zip(micro_batches, batches, held_fixed):
        fixed["log_q"] = guides.compute_log_q(guide_config, fixed["old_logps"], fixed["entropies"],
                                              batch["completion_mask"], step, config.steps, guide_generator)
        shaped.append(loss.kl_shaped_rewards(rewards[rows], fixed["old_logps"], fixed["ref_logps"], fixed["log_q"],
                                             batch["completion_mask"], config.beta).cpu())
    return loss.compute_advantages(torch.cat(shaped), config.rollouts, config.advantage)


def update_policy(policy, frozen_reference, optimizer, rollouts: Rollouts, rewards: torch.Tensor,
                  advantages: torch.Tensor, config: Config, guide_config: guides.GuideConfig,
                  guide_generator: torch.Generator, step: int, pad_id: int,
                  timer: runs.PhaseTimer | None = None) -> dict:
    """Old/ref log-probs -> the guide's log q -> loss -> backward, over micro-batches; then one
    AdamW step. Returns the step's metrics (its phases' times go to ``timer``)."""
    timer = timer or runs.PhaseTimer()
    device = next(policy.parameters()).device
    total_rows = len(rollouts.completion_ids)
    micro_batches = [list(range(start, min(start + config.micro_batch_size, total_rows)))
                     for start in range(0, total_rows, config.micro_batch_size)]
    max_completion = config.max_seq_len - config.max_prompt_len
    step_tokens = float(sum(len(c) for c in rollouts.completion_ids))
    need_old = config.ppo_epochs > 1 or config.kl_estimator == "k1_return"
    batches = [loss.collate([rollouts.prompt_ids[i] for i in rows], [rollouts.completion_ids[i] for i in rows],
                            pad_id, device, group_size=config.rollouts) for rows in micro_batches]
    with timer("reference"):
        held_fixed = [held_fixed_logps(policy, frozen_reference, batch, config, need_old) for batch in batches]
        if config.kl_estimator == "k1_return" and config.kl == "reverse" and config.beta > 0:
            advantages = return_shaped_advantages(rewards, micro_batches, batches, held_fixed, config, guide_config,
                                                  guide_generator, step)
    with timer("update"):
        metrics = accumulate_gradients(policy, rollouts, micro_batches, batches, held_fixed, advantages, config,
                                              guide_config, guide_generator, step, max_completion, step_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm).item()
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"the gradient norm is {grad_norm} at step {step}; stopped, the last checkpoint "
                                     "is kept; lower --lr or --beta")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {**metrics, "grad_norm": grad_norm}


def accumulate_gradients(policy, rollouts: Rollouts, micro_batches: list[list[int]], batches: list[dict],
                         held_fixed: list[dict], advantages: torch.Tensor, config: Config,
                         guide_config: guides.GuideConfig, guide_generator: torch.Generator, step: int,
                         max_completion: int, step_tokens: float) -> dict:
    """The policy's forward pass, the guide's log q from it, the loss and its backward, micro-batch
    by micro-batch, the gradients accumulating into the step's. Returns the averaged metrics."""
    device = next(policy.parameters()).device
    total_rows = len(rollouts.completion_ids)
    policy.train()
    metrics = runs.StepMetrics()
    for _ in range(config.ppo_epochs):
        for rows, batch, fixed in zip(micro_batches, batches, held_fixed):
            logps, entropies = loss.completion_logps(policy, batch, config.temperature, config.min_p)  # [B, C]
            old_logps = fixed.get("old_logps", logps.detach())
            entropies = fixed.get("entropies", entropies)
            mask = batch["completion_mask"]
            if "log_q" not in fixed:  # the guide from the same forward pass, fixed for the rest of the step (Eq. 3)
                fixed["log_q"] = guides.compute_log_q(guide_config, old_logps, entropies, mask, step, config.steps,
                                                      guide_generator)
            engine_logps = rollout.pad_rows([rollouts.engine_logps[i] for i in rows], mask.shape[1], device)
            importance = None
            if config.tis_cap > 0:  # truncated importance sampling: min(pi_old / pi_engine, C)
                importance = torch.exp(old_logps - engine_logps).clamp(max=config.tis_cap) * mask
            micro_loss, micro_metrics = loss.policy_loss(
                logps, old_logps, advantages[rows].to(device), mask, ref_logps=fixed.get("ref_logps"),
                log_q=fixed["log_q"], beta=config.beta, kl=config.kl, kl_estimator=config.kl_estimator,
                eps_low=config.eps_low, eps_high=config.eps_high, aggregation=config.loss_agg,
                max_completion_length=max_completion, global_num_tokens=step_tokens, entropies=entropies,
                importance_weights=importance, q_constant_per_position=guide_config.name in ("branch", "random"),
            )
            if not torch.isfinite(micro_loss):
                raise FloatingPointError(f"the loss is {micro_loss.item()} at step {step}; stopped, the last "
                                         "checkpoint is kept; lower --lr or --beta")
            weight = loss.micro_batch_weight(config.loss_agg, len(rows), total_rows, len(micro_batches)) / config.ppo_epochs
            (micro_loss * weight).backward()
            metrics.add({**micro_metrics, **rollout.engine_gap(old_logps, engine_logps, mask)}, len(rows))
    return metrics.result()


# --------------------------------------------------------------------------------------------
# 5. A run: its directory, data, resume, records
# --------------------------------------------------------------------------------------------


def start_run(config: Config) -> str:
    """Create <out>/<name>, refuse to overwrite a checkpoint or resume nothing, seed, save the config."""
    model = os.path.basename(config.model.rstrip("/")) if config.model else "demo"
    run_dir = os.path.join(config.out, config.name or f"{model}-{config.algo}-{config.guide}")
    if not config.resume and os.path.exists(runs.checkpoint_dir(run_dir)):
        raise SystemExit(f"error: {run_dir} already holds a checkpoint; pass --resume to continue it or --name for a new run")
    if config.resume and not runs.has_checkpoint(run_dir):
        raise SystemExit(f"error: --resume but no checkpoint in {runs.checkpoint_dir(run_dir)}; drop --resume to start fresh")
    if config.full_finetune and config.model:
        models.check_full_finetune_fits(config.model, with_reference=config.kl != "none" and config.beta > 0,
                                        with_engine=config.backend == "vllm")
    os.makedirs(run_dir, exist_ok=True)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    runs.write_json_atomic(os.path.join(run_dir, "config.json"), dataclasses.asdict(config))
    return run_dir


def base_model_and_problems(config: Config, run_dir: str) -> tuple[str, list[dict], list[dict] | None]:
    """(the RL base model's path, the training problems, the demo's held-out problems or None):
    the demo's SFT-ed tiny model, or --model after the SFT stage when --sft-dataset is given."""
    if not config.model:
        train, held_out = demo.demo_problems(config.seed, config.demo_eval_problems)
        train = [{**p, "solution": p["working"]} for p in train]  # the reference workings, for self-hints
        return demo_base_model(config, run_dir), train, held_out
    rows = load_rows(config.dataset, config.dataset_config)
    problems = training_problems(rows, config.problem_key, config.answer_key, config.max_train_samples, config.dataset,
                                 config.solution_key)
    if not config.sft_dataset:
        return config.model, problems, None
    if config.resume:
        return os.path.join(run_dir, "sft_model"), problems, None
    return run_sft_stage(config, run_dir), problems, None


def tokenized_prompts(problems: list[dict], tokenizer, max_prompt_len: int) -> tuple[list[dict], list[list[int]]]:
    """The problems whose prompt fits in --max-prompt-len, and their prompt token ids."""
    prompts = [build_prompt_ids(tokenizer, p["problem"]) for p in problems]
    keep = [i for i, prompt in enumerate(prompts) if len(prompt) <= max_prompt_len]
    if not keep:
        raise SystemExit(f"error: every training prompt is longer than --max-prompt-len {max_prompt_len}")
    return [problems[i] for i in keep], [prompts[i] for i in keep]


def eval_benchmarks(config: Config, held_out: list[dict] | None) -> dict[str, list[Problem]]:
    """What --eval-every evaluates: --eval-benchmarks, else the demo's held-out problems."""
    if config.eval_every <= 0:
        return {}
    if config.eval_benchmarks:
        return {name: problems for name, (_, problems) in resolve_benchmarks(config.eval_benchmarks).items()}
    if held_out is not None:
        return {"demo": [Problem(p["problem"], p["answer"]) for p in held_out]}
    raise SystemExit("error: --eval-every needs --eval-benchmarks (names such as aime, or local .jsonl files)")


def evaluate_policy(engine, tokenizer, benchmarks: dict[str, list[Problem]], config: Config, step: int) -> list[dict]:
    """pass@k of the current policy through the training engine (no second engine)."""
    sampling = EvalSampling(temperature=config.eval_temperature, top_p=config.eval_top_p, top_k=config.top_k,
                            min_p=config.min_p, max_tokens=config.max_seq_len - config.max_prompt_len)
    return evaluation_rows(engine, tokenizer, benchmarks, config.eval_n, config.seed, sampling, step)


def restore_or_start(config: Config, run_dir: str, policy, optimizer, scheduler, sampler: PromptSampler,
                     guide_generator: torch.Generator) -> int:
    """The step to start from: the checkpoint's with --resume (weights, optimizer, scheduler, RNG,
    sampler and guide states restored; metrics.jsonl and eval.jsonl cut back to it), else 0 with
    fresh logs."""
    logs = [os.path.join(run_dir, name) for name in ("metrics.jsonl", "eval.jsonl")]
    if not config.resume:
        for path in logs:
            if os.path.exists(path):
                os.remove(path)
        return 0
    state = runs.load_checkpoint(run_dir, policy, optimizer, scheduler)
    sampler.load_state_dict(state["sampler"])
    guide_generator.set_state(state["guide_generator"])
    runs.truncate_jsonl(logs[0], state["step"])  # metrics of steps 0 .. step - 1
    runs.truncate_jsonl(logs[1], state["step"] + 1)  # evaluations after 0 .. step updates
    return state["step"]


def log_evaluation(rows: list[dict], run_dir: str, trackers: Trackers, progress) -> None:
    """Append evaluation rows to <run>/eval.jsonl, send eval/<benchmark>/pass@k to the trackers,
    show pass@1 on the progress bar."""
    for row in rows:
        runs.append_jsonl(os.path.join(run_dir, "eval.jsonl"), row)
        trackers.log_extra({f"eval/{row['benchmark']}/{key}": value for key, value in row.items()
                            if key.startswith("pass@")}, row["step"])
        n = row["n"]
        progress.write(f"eval after {row['step']} steps, {row['benchmark']}: pass@1 {row['pass@1']:.3f}, "
                       f"pass@{n} {row[f'pass@{n}']:.3f}")


def step_record(step: int, rollouts: Rollouts, rewards: torch.Tensor, num_groups: int, num_zero_signal: int,
                metrics: dict, times: dict, lr: float) -> dict:
    """One line of metrics.jsonl."""
    lengths = [len(c) for c in rollouts.completion_ids]
    return {
        "step": step,
        "reward": rewards.mean().item(),
        "accuracy": (rewards > 0.5).float().mean().item(),
        "frac_zero_signal_groups": num_zero_signal / max(1, num_groups),
        "response_length": sum(lengths) / max(1, len(lengths)),
        "frac_truncated": sum(r == "length" for r in rollouts.finish_reasons) / max(1, len(lengths)),
        "lr": lr,
        **metrics,
        **times,
    }


# --------------------------------------------------------------------------------------------
# 6. main(): the run, stage by stage
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv)
    run_dir = start_run(config)
    if config.sft_only:
        return {"sft_model": run_sft_stage(config, run_dir) if config.model else demo_base_model(config, run_dir)}
    # ---- data, the base model (after SFT), the policy and its reference, the optimizer ----
    base_path, problems, held_out = base_model_and_problems(config, run_dir)
    model, tokenizer = models.load_base_model(base_path, config.gradient_checkpointing, full_finetune=config.full_finetune)
    problems, prompts = tokenized_prompts(problems, tokenizer, config.max_prompt_len)
    policy, frozen_reference = models.make_policy(model, config.full_finetune, config.lora_rank, config.lora_alpha,
                                                  with_reference=config.kl != "none" and config.beta > 0)
    optimizer, scheduler = models.make_optimizer(policy, config.lr, config.weight_decay, config.steps,
                                                 int(config.warmup_ratio * config.steps))
    guide_config = guides.GuideConfig(name=config.guide, tau=config.tau, ratio=config.ratio, q_min=config.q_min,
                                      q_max=config.q_max, token_normalization=config.token_normalization)
    guide_generator = torch.Generator().manual_seed(config.seed)
    sampler = PromptSampler(len(problems), config.seed)
    start_step = restore_or_start(config, run_dir, policy, optimizer, scheduler, sampler, guide_generator)
    reward_function, benchmarks = load_reward_function(config.reward), eval_benchmarks(config, held_out)
    trackers = Trackers(config.report_to, run_dir, os.path.basename(run_dir), dataclasses.asdict(config), config.resume)
    # ---- the rollout engine holding the policy's weights; pass@k before any update ----
    engine = start_engine(config, base_path, policy)
    progress = tqdm(range(start_step, config.steps), desc="rl", initial=start_step, total=config.steps)
    if benchmarks and start_step == 0:
        log_evaluation(evaluate_policy(engine, tokenizer, benchmarks, config, step=0), run_dir, trackers, progress)

    zero_reward_streak, finished = 0, True
    for step in progress:
        timer, started = runs.PhaseTimer(), time.perf_counter()
        # 1-3. prompts -> rollouts -> rewards (DAPO: groups without signal dropped and refilled)
        hint_stats = hints.HintStats() if config.self_hints else None
        rollouts, rewards, num_groups, num_zero_signal = collect_rollouts(engine, sampler, prompts, problems, config,
                                                                          step, reward_function, timer, hint_stats)
        with timer("sleep"):
            engine.sleep(level=2)  # CUDA: drop the engine's weights and KV cache for the update; CPU: no-op
        zero_reward_streak = zero_reward_streak + 1 if rewards.numel() == 0 or rewards.max() <= 0 else 0
        if zero_reward_streak == config.zero_reward_warning:
            tqdm.write(f"warning: {zero_reward_streak} steps in a row with all-zero rewards: no learning signal; "
                       "check the answer format and the reward, or warm-start with --sft-dataset")
        metrics = {}
        if rewards.numel() > 0:  # (dynamic sampling may find no group with signal: nothing to learn)
            # 4. advantages
            advantages = loss.compute_advantages(rewards, config.rollouts, config.advantage)
            # 5-8. old/ref log-probs -> the guide's log q -> loss -> AdamW
            metrics = update_policy(policy, frozen_reference, optimizer, rollouts, rewards, advantages, config,
                                    guide_config, guide_generator, step, tokenizer.pad_token_id, timer)
        scheduler.step()
        # 9. weight sync into the engine
        with timer("sync"):
            engine.sync_weights(policy)
        # 10. metrics, and pass@k every --eval-every steps
        times = {**timer.record(), "time/step_s": time.perf_counter() - started}
        times["time/other_s"] = times["time/step_s"] - sum(timer.seconds.values())
        record = step_record(step, rollouts, rewards, num_groups, num_zero_signal,
                             {**metrics, **(hint_stats.record() if hint_stats else {})}, times, scheduler.get_last_lr()[0])
        trackers.log(record, step)
        progress.set_postfix(reward=f"{record['reward']:.3f}", kl=f"{record.get('kl/ref_k3', 0.0):.4f}")
        if benchmarks and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
            log_evaluation(evaluate_policy(engine, tokenizer, benchmarks, config, step=step + 1), run_dir, trackers,
                           progress)
        # 11. checkpoint
        stopping = config.stop_after > 0 and step + 1 - start_step >= config.stop_after
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps or stopping:
            runs.save_checkpoint(run_dir, policy, optimizer, scheduler, {
                "step": step + 1, "sampler": sampler.state_dict(), "guide_generator": guide_generator.get_state(),
            })
        if stopping and step + 1 < config.steps:
            tqdm.write(f"stopped after step {step + 1} as asked; continue with --resume")
            finished = False
            break
    trackers.close()
    if held_out is not None and benchmarks and finished:
        return demo.write_demo_summary(run_dir, config.steps, config.eval_n)
    return {}


if __name__ == "__main__":
    try:
        main()
    except (DataError, RewardError, TrackerError, rollout.RolloutError, FloatingPointError) as error:
        sys.exit(f"error: {error}")
