"""The embedded CPU demo: a tiny model, a tokenizer and a task built by code, so that
``python sage.py`` runs the paper's whole pipeline (SFT, GRPO + Branch with vLLM rollouts, pass@k
on held-out problems) on a laptop, with nothing downloaded.

1. ``DEMO_SIZES``: the trainer's settings for the demo (the paper's code path, smaller numbers).
2. A byte-level BPE tokenizer trained by code on the prompt's own words, with Qwen's chat tokens
   and the paper's format markers as single tokens.
3. A randomly initialized Qwen2 model (head size 64, the size vLLM's CPU backend runs).
4. The task: single-digit additions in four phrasings, 400 problems with numeric answers, a
   held-out part never trained on; SFT examples with wrong answers on purpose (a fraction of the
   easy sums off by one or two, most hard sums without their carry), so the SFT model is right
   only part of the time and on the hard sums rarely samples the right answer at all: support
   that RL has to find, as in the paper (its pass@64 is well below 1).
5. The before/after table, ``summary.json`` and the pass@k plot.

This module supplies data and models; the trainer (sage.py) runs them.
"""

from __future__ import annotations

import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.pre_tokenizers import ByteLevel, Digits
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from analysis import plot_pass_at_k, plot_run
from runs import read_jsonl, write_json_atomic
from task import FORMAT_TOKENS, SYSTEM_PROMPT, format_completion

# --------------------------------------------------------------------------------------------
# 1. The trainer's settings for the demo
# --------------------------------------------------------------------------------------------

# Values of sage.Config fields when no --model is given (flags still win).
DEMO_SIZES = dict(
    steps=500,
    prompts_per_step=8,
    rollouts=8,
    micro_batch_size=64,
    gradient_checkpointing=False,
    guide="branch",
    lr=5e-4,
    warmup_ratio=0.05,
    lora_rank=16,
    lora_alpha=32,
    max_seq_len=640,  # room for self-hints: the hint request holds the problem and its solution
    max_prompt_len=576,  # completions get the remaining 64 tokens
    save_every=100,
    gpu_memory_utilization=0.2,
    sft_epochs=2,
    sft_lr=2e-3,
    sft_batch_size=16,
    sft_warmup_steps=10,
    # pass@k on the held-out problems every 100 steps, sampled as in training (the policy RL shapes)
    eval_every=100,
    eval_temperature=1.0,
    eval_top_p=1.0,
)
DEMO_TEMPLATES = ("What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "What is the sum of {a} and {b}?")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# --------------------------------------------------------------------------------------------
# 2-3. The tokenizer and the model
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# 4. The task
# --------------------------------------------------------------------------------------------


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


def demo_sft_examples(train: list[dict], count: int, noise: float, hard_noise: float, seed: int) -> list[dict]:
    """``count`` SFT examples drawn from the training problems, some of them wrong on purpose.

    Easy sums (below 10): a fraction ``noise`` carries an answer off by 1 or 2. Hard sums (10 and
    more): a fraction ``hard_noise`` forgets the carry, working and answer alike (7+5=2), a
    systematic error. So the SFT model is right only part of the time on the easy sums and rarely
    writes the carry at all on the hard ones: support that RL has to find (the paper's y2).

    >>> demo_sft_examples([{"problem": "Add 7 and 5.", "answer": "12", "working": "7+5=12"}], 1, 0.0, 1.0, 0)
    [{'problem': 'Add 7 and 5.', 'completion': '<start_working_out>7+5=2<end_working_out><SOLUTION>2</SOLUTION>'}]
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        problem = rng.choice(train)
        working, answer = problem["working"], problem["answer"]
        if int(answer) >= 10 and rng.random() < hard_noise:
            answer = str(int(answer) % 10)
            working = working.split("=")[0] + "=" + answer
        elif int(answer) < 10 and rng.random() < noise:
            answer = str(int(answer) + rng.choice([-2, -1, 1, 2]))
        examples.append({"problem": problem["problem"], "completion": format_completion(working, answer)})
    return examples


# --------------------------------------------------------------------------------------------
# 5. The result: a table, summary.json and the pass@k plot
# --------------------------------------------------------------------------------------------


def write_demo_summary(run_dir: str, steps: int, eval_n: int) -> dict:
    """Print pass@1 and pass@n of the SFT start (the evaluation before any update) and of the RL
    result (after the last step), from <run>/eval.jsonl; write summary.json, the pass@k plot
    passk.png and the training curves curves.png."""
    rows = {row["step"]: row for row in read_jsonl(os.path.join(run_dir, "eval.jsonl")) if row["benchmark"] == "demo"}
    stages = {"SFT start": rows[0], "after RL": rows[steps]}
    table = {label: {f"pass@{k}": row[f"pass@{k}"] for k in (1, eval_n)} for label, row in stages.items()}
    print(f"\n{'':14}{'pass@1':>10}{f'pass@{eval_n}':>10}")
    for label, values in table.items():
        print(f"{label:14}{values['pass@1']:>10.3f}{values[f'pass@{eval_n}']:>10.3f}")
    files = {label: {"model": {"name": label}, "benchmarks": {"demo": {"pass_at_k": row["pass_at_k"]}}}
             for label, row in stages.items()}
    write_json_atomic(os.path.join(run_dir, "summary.json"), {"before": table["SFT start"], "after": table["after RL"],
                                                              "details": files})
    plot_pass_at_k(files, os.path.join(run_dir, "passk.png"))
    plot_run([run_dir], os.path.join(run_dir, "curves.png"))
    return table
