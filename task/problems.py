"""The task's problems, what the model is asked, and the format it answers in.

1. Problems, from the hub or a local file. ``load_rows`` is the one loader: a hub dataset (name,
   configuration, split) or a local .jsonl / .json / .parquet / .csv file, as a list of dicts;
   failures are one line naming the fix. Training problems (section 5.1: the first 2,000 of
   DAPO-Math-17k-Processed) as {problem, answer}, and the ``PromptSampler`` that draws them step
   after step (checkpointed); benchmarks (section 5.1: AIME 2024-2025, AMC23, MATH-500 level 5,
   Minerva, Knights-and-Knaves) by name from their public hub copies, or from a local file.
2. The prompt (App. E.4): the paper's system prompt and the problem, through the tokenizer's chat
   template once (``build_prompt_ids``).
3. The answer format (App. E.4): ``<start_working_out> ... <end_working_out><SOLUTION> answer
   </SOLUTION>`` (``format_completion``; ``sft_completion`` for SFT targets); grading.py's
   ``extract_solution`` reads the last ``<SOLUTION>`` block back.

(The SFT examples of App. E.2 are extras/sft.py's.)
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from machinery import UsageError

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# --------------------------------------------------------------------------------------------
# 1. Problems: the loader, training problems and the prompt sampler, benchmarks
# --------------------------------------------------------------------------------------------


class DataError(UsageError):
    """Data that cannot be used as asked; the message names the problem and the fix."""


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def load_rows(
    source: str, config_name: str | None = None, split: str = "train", data_files: str | None = None
) -> list[dict]:
    """Rows of a hub dataset or of a local .jsonl/.json/.parquet/.csv file."""
    extension = os.path.splitext(source)[1].lower()
    looks_local = extension in LOCAL_FORMATS or os.path.exists(source)
    if looks_local and extension not in LOCAL_FORMATS:
        raise DataError(
            f"{source}: unknown file type {extension!r}; use one of {', '.join(LOCAL_FORMATS)}"
        )
    import datasets

    datasets.disable_progress_bars()
    try:
        if looks_local:
            rows = datasets.load_dataset(LOCAL_FORMATS[extension], data_files=source, split="train")
        else:
            rows = datasets.load_dataset(
                source, config_name or None, split=split, data_files=data_files
            )
    except Exception as error:  # noqa: BLE001 -- offline, not cached, renamed upstream, a bad file
        if looks_local:
            raise DataError(local_file_problem(source, extension, error)) from None
        raise DataError(
            f"cannot load dataset {source!r} ({first_line(error)}); pass a local .jsonl/.parquet "
            "file, or run once with internet access so the hub copy is cached"
        ) from None
    return list(rows)


def local_file_problem(path: str, extension: str, error: Exception) -> str:
    """Why a local data file did not load, with the line that does not parse for JSON Lines and
    JSON files (the loader's own message would send the user to the network).
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as problem:
        return f"cannot read dataset {path} ({first_line(problem)})"
    lines = text.splitlines() if extension == ".jsonl" else [text]
    for number, line in enumerate(lines, start=1):
        if extension not in (".jsonl", ".json") or not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as problem:
            at = number if extension == ".jsonl" else problem.lineno
            return f"{path}: line {at} does not parse as JSON ({problem.msg}); fix it"
        if extension == ".jsonl" and not isinstance(value, dict):
            return f"{path}: line {number} is not a JSON object; write one object per line"
    return (
        f"cannot parse dataset {path} ({first_line(error)}); check that every row has the same "
        "fields"
    )


def require_fields(rows: list[dict], keys: Sequence[str], where: str, flags: str) -> None:
    """One line naming the fields the rows do have and the flags that choose them."""
    if rows and any(key not in rows[0] for key in keys):
        missing = next(key for key in keys if key not in rows[0])
        raise DataError(
            f"{where} has no field {missing!r} (fields: {', '.join(sorted(rows[0]))}); set {flags}"
        )


def training_problems(
    rows: list[dict],
    problem_key: str,
    answer_key: str,
    limit: int,
    where: str,
    solution_key: str = "",
) -> list[dict]:
    """The first ``limit`` rows (0: all) as {problem, answer} (and the reference ``solution`` of
    ``solution_key``, "" where a row has none); a row without an answer is an error."""
    keys, flags = (problem_key, answer_key), "--problem-key / --answer-key"
    if solution_key:  # self-hints' reference solutions
        keys, flags = (*keys, solution_key), f"{flags} / --solution-key"
    require_fields(rows, keys, where, flags)
    problems = []
    for index, row in enumerate(rows[: limit or None]):
        answer = row.get(answer_key)
        if answer is None or str(answer).strip() == "":
            raise DataError(
                f"{where} row {index} has no answer in field {answer_key!r}; clean the data or "
                "pick another --answer-key"
            )
        problem = {"problem": str(row[problem_key]), "answer": str(answer)}
        if solution_key:
            problem["solution"] = str(row.get(solution_key) or "").strip()
        problems.append(problem)
    if not problems:
        raise DataError(f"{where} has no rows")
    return problems


class PromptSampler:
    """Problem indices in a seeded random order, epoch after epoch; its position is checkpointed.

    >>> sampler = PromptSampler(4, seed=0)
    >>> first = sampler.take(3); state = sampler.state_dict(); rest = sampler.take(5)
    >>> sorted(first + rest[:1]) == [0, 1, 2, 3]    # an epoch is a permutation
    True
    >>> again = PromptSampler(4, seed=0); again.load_state_dict(state); again.take(5) == rest
    True
    """

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


@dataclass(frozen=True)
class Problem:
    """One evaluation problem: the text shown to the model, its reference answer, its grader, and
    (for evaluate.py's support probe) a reference solution and a group such as easy / hard."""

    problem: str
    answer: str
    grader: str = "math"
    solution: str = ""
    group: str = ""


@dataclass(frozen=True)
class Source:
    """Where (part of) a benchmark lives: a hub dataset or a local file, and its fields."""

    path: str
    split: str = "train"
    problem_key: str = "problem"
    answer_key: str = "answer"
    config: str | None = None
    data_files: str | None = None
    level: int | None = None  # keep rows with this "level" (MATH-500's difficulty)


@dataclass(frozen=True)
class Benchmark:
    sources: tuple[Source, ...]
    grader: str = "math"
    paper_size: int | None = None  # the number of problems in the paper (section 5.1)


# Standard public copies (the paper names the benchmarks, not the copies).
BENCHMARKS = {
    "aime": Benchmark(
        (
            Source("HuggingFaceH4/aime_2024"),
            Source(
                "opencompass/AIME2025", split="test", problem_key="question", config="AIME2025-I"
            ),
            Source(
                "opencompass/AIME2025", split="test", problem_key="question", config="AIME2025-II"
            ),
        ),
        paper_size=60,
    ),
    "amc23": Benchmark(
        (Source("math-ai/amc23", split="test", problem_key="question"),), paper_size=40
    ),
    "math500-l5": Benchmark(
        (Source("HuggingFaceH4/MATH-500", split="test", level=5),), paper_size=134
    ),
    "minerva": Benchmark(
        (Source("math-ai/minervamath", split="test", problem_key="question"),), paper_size=272
    ),
    # Xie et al. 2024, all seven test files (2 to 8 people, 100 puzzles each).
    "knights-and-knaves": Benchmark(
        (
            Source(
                "K-and-K/knights-and-knaves",
                problem_key="quiz",
                answer_key="solution_text_format",
                data_files="test/people*_num100.jsonl",
            ),
        ),
        grader="knights_knaves",
    ),
}


def resolve_benchmarks(
    spec: str,
    problem_key: str = "problem",
    answer_key: str = "answer",
    grader: str = "math",
    solution_key: str = "",
    group_key: str = "",
) -> dict[str, tuple[str, list[Problem]]]:
    """``aime,amc23,path/to/mine.jsonl`` -> {name: (source, problems)}: a name of ``BENCHMARKS``
    from the hub or the local datasets cache, or a local file, named by its stem, with its
    ``problem_key`` and ``answer_key`` fields and graded by ``grader``. The rows'
    ``solution_key`` and ``group_key`` fields (MATH-500: solution, level) fill each problem's
    reference solution and group (the support probe's input), "" where a row has none.

    A benchmark offline and not cached raises one line naming the fixes: run once online (the
    cache then serves offline runs, e.g. with HF_HUB_OFFLINE=1), or pass a local file.
    """
    resolved = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        stem, extension = os.path.splitext(os.path.basename(entry))
        if extension.lower() in LOCAL_FORMATS:
            name, where = stem, os.path.abspath(entry)
            benchmark = Benchmark(
                (Source(entry, problem_key=problem_key, answer_key=answer_key),), grader
            )
        elif entry in BENCHMARKS:
            name, benchmark = entry, BENCHMARKS[entry]
            where = "hub:" + ",".join(source.path for source in benchmark.sources)
        else:
            raise DataError(
                f"unknown benchmark {entry!r}; use one of {', '.join(BENCHMARKS)} "
                "or a .jsonl/.parquet file"
            )
        if name in resolved:  # two files of one stem, or a file named as a benchmark
            raise DataError(f"--benchmarks has {name!r} twice: give a file once, by its own name")
        problems = []
        for source in benchmark.sources:
            try:
                rows = load_rows(source.path, source.config, source.split, source.data_files)
            except DataError as error:
                if entry not in BENCHMARKS:  # a local file's line says it all
                    raise
                raise DataError(
                    f"benchmark {name!r}: {error} with --problem-key/--answer-key"
                ) from None
            if source.level is not None:
                rows = [
                    row
                    for row in rows
                    if str(row["level"]).removeprefix("Level ") == str(source.level)
                ]
            pairs = training_problems(rows, source.problem_key, source.answer_key, 0, source.path)
            problems += [
                Problem(
                    **pair,  # problem, answer: each row has an answer
                    grader=benchmark.grader,
                    solution=str(row.get(solution_key) or "").strip() if solution_key else "",
                    group=str(row.get(group_key) or "") if group_key else "",
                )
                for pair, row in zip(pairs, rows)
            ]
        if benchmark.paper_size and len(problems) != benchmark.paper_size:
            print(
                f"[data] note: {name} has {len(problems)} problems here, "
                f"{benchmark.paper_size} in the paper",
                file=sys.stderr,
            )
        resolved[name] = (where, problems)
    if not resolved:
        raise DataError("no benchmarks given; pass e.g. --benchmarks aime,amc23,math500-l5")
    return resolved


# --------------------------------------------------------------------------------------------
# 2-3. The prompt and the answer format (App. E.4)
# --------------------------------------------------------------------------------------------


SYSTEM_PROMPT = (
    "You are given a problem. Think about the problem and provide your working out. Place it "
    "between <start_working_out> and <end_working_out>. Then, provide your solution between "
    "<SOLUTION> and </SOLUTION>."
)
FORMAT_TOKENS = ("<start_working_out>", "<end_working_out>", "<SOLUTION>", "</SOLUTION>")


def build_prompt_ids(tokenizer, problem: str) -> list[int]:
    """The chat template applied once: the paper's system prompt, the problem as the user
    message, the assistant turn opened."""
    return chat_ids(
        tokenizer,
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}],
    )


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat messages through the tokenizer's template, the assistant turn opened."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def format_completion(working: str, answer: str) -> str:
    """The paper's completion format (App. E.4).

    >>> format_completion("2+2=4", "4")
    '<start_working_out>2+2=4<end_working_out><SOLUTION>4</SOLUTION>'
    """
    return f"<start_working_out>{working}<end_working_out><SOLUTION>{answer}</SOLUTION>"


def sft_completion(reasoning: str, answer: str) -> str:
    """An SFT target in the paper's format, from a worked solution and its answer (App. E.2).

    Reasoning traces such as OpenMathReasoning's hold ``<think>`` tags: they are removed, so the
    model learns the paper's markers only.

    >>> sft_completion("<think> 2+2=4 </think>", "4")
    '<start_working_out>2+2=4<end_working_out><SOLUTION>4</SOLUTION>'
    """
    for tag in ("<think>", "</think>"):
        reasoning = reasoning.replace(tag, "")
    return format_completion(reasoning.strip(), answer.strip())
