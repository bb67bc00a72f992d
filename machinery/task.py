"""The task: the problems, what the model is asked, the format it answers in, and the reward.

1. Problems, from the hub or a local file. ``load_rows`` is the one loader: a hub dataset (name,
   configuration, split) or a local .jsonl / .json / .parquet / .csv file, as a list of dicts;
   failures are one line naming the fix. Training problems (section 5.1: the first 2,000 of
   DAPO-Math-17k-Processed) as {problem, answer}, and the ``PromptSampler`` that draws them step
   after step (checkpointed); benchmarks (section 5.1: AIME 2024-2025, AMC23, MATH-500 level 5,
   Minerva, Knights-and-Knaves) by name from their public hub copies, or from a local file.
2. The prompt (App. E.4): the paper's system prompt and the problem, through the tokenizer's chat
   template once (``build_prompt_ids``).
3. The answer format (App. E.4): ``<start_working_out> ... <end_working_out><SOLUTION> answer
   </SOLUTION>`` (``format_completion``; ``sft_completion`` for SFT targets); ``extract_solution``
   reads the last ``<SOLUTION>`` block back.
4. Grading (section 5.1): the answer inside ``<SOLUTION>`` when present, else what Math-Verify
   extracts from the whole text, compared with the reference by Math-Verify; Knights-and-Knaves
   answers by matching every person's role (their answers are sentences). ``grade`` is serial;
   ``grade_batch`` runs ``grading_pool.GradingPool`` workers with a hard per-item timeout.
5. The reward r(x, y) in {0, 1} (section 5.1): ``math_reward``, a function over a batch of
   completions with their problems and reference answers -- the signature of any reward; the
   trainer's ``--reward module:function`` (or ``path/to/file.py:function``) plugs in another one,
   checked by ``load_reward_function``.

Grading choices the paper leaves open: a short answer inside <SOLUTION> is read as LaTeX (wrapped
in ``$...$``) unless it is prose or a plain number; the reference answer likewise. (The SFT
examples of App. E.2 are extras/sft.py's.)
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import math
import os
import random
import re
import runpy
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module

from machinery import UsageError
from machinery.grading_pool import DEFAULT_TIMEOUT_S as GRADE_TIMEOUT_S
from machinery.grading_pool import GradingPool

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
GRADERS = ("math", "knights_knaves")  # evaluate.py's --grader choices


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
    if looks_local and not os.path.isfile(source):
        raise DataError(f"cannot load dataset {source!r}: no such file")
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
    require_fields(rows, (problem_key, answer_key), where, "--problem-key / --answer-key")
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
            keys = (source.problem_key, source.answer_key)
            require_fields(rows, keys, source.path, "--problem-key / --answer-key")
            problems += [
                Problem(
                    problem=str(row[source.problem_key]),
                    answer=str(row[source.answer_key]),
                    grader=benchmark.grader,
                    solution=str(row.get(solution_key) or "").strip() if solution_key else "",
                    group=str(row.get(group_key) or "") if group_key else "",
                )
                for row in rows
            ]
        if benchmark.paper_size and len(problems) != benchmark.paper_size:
            print(
                f"[data] note: {name} has {len(problems)} problems here, "
                f"{benchmark.paper_size} in the paper",
                file=sys.stderr,
            )
        if not problems:
            raise DataError(f"benchmark {entry!r} has no problems")
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


# --------------------------------------------------------------------------------------------
# 4. Grading
# --------------------------------------------------------------------------------------------


_SOLUTION_BLOCK = re.compile(r"<SOLUTION>(.*?)</SOLUTION>", re.DOTALL)
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")  # a word, not a LaTeX command
_PLAIN_NUMBER = re.compile(r"\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+)?\s*%?\s*")


def extract_solution(completion: str) -> str | None:
    """The text of the last ``<SOLUTION>...</SOLUTION>`` block (App. E.4 format), or None.

    >>> extract_solution("<start_working_out> 2+2 <end_working_out><SOLUTION> 4 </SOLUTION>")
    '4'
    >>> extract_solution("no block, the answer is 4") is None
    True
    """
    blocks = _SOLUTION_BLOCK.findall(completion)
    return blocks[-1].strip() if blocks else None


def _quiet_math_verify() -> None:
    # math-verify logs a warning per timeout and when its own (signal) timeouts are off;
    # we count timeouts ourselves.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)


@functools.lru_cache(maxsize=4096)
def _parse_short_answer(text: str, timeout: int | None) -> list:
    """math-verify's parse of a bare answer such as ``1/2``, ``\\frac{1}{2}`` or ``(1, 2]``.

    Bare LaTeX is wrapped in ``$...$`` first, so that sets and intervals are read as such
    (unwrapped, math-verify reads ``(1, 2]`` as the number 2: its LaTeX extraction needs a
    delimiter, and no option of its parse reads bare LaTeX); prose and plain numbers are parsed
    as they are (plain numbers skip the LaTeX parser: ~1 ms instead of ~20 ms). Cached: the
    trainer grades G = 8 completions per reference, evaluation n = 256, and answers repeat.
    """
    from math_verify import parse

    if not text.strip():
        return []
    if _PLAIN_NUMBER.fullmatch(text):
        return parse(text, parsing_timeout=timeout)
    wrapped = f"${text}$"
    reads_as_latex = not any(d in text for d in _LATEX_DELIMITERS) and not _PROSE_WORD.search(text)
    first, second = (wrapped, text) if reads_as_latex else (text, wrapped)
    return parse(first, parsing_timeout=timeout) or parse(second, parsing_timeout=timeout)


def _grade_math(completion: str, answer: str, timeout: int | None) -> bool:
    from math_verify import parse, verify

    reference = _parse_short_answer(str(answer), timeout)
    if not reference:
        return False
    solution = extract_solution(completion)
    if solution is not None:
        prediction = _parse_short_answer(solution, timeout)
    else:
        prediction = parse(completion, parsing_timeout=timeout)
    return bool(prediction) and bool(verify(reference, prediction, timeout_seconds=timeout))


_ROLE_STATEMENT = re.compile(r"\b([A-Z][a-zA-Z]*) is a (knight|knave|Knight|Knave)\b")


def _grade_knights_knaves(completion: str, answer: str) -> bool:
    """Correct iff every person named in the reference gets the reference's role.

    The answer is the <SOLUTION> block when present, else the whole text, where the last role
    stated for a person counts.
    """
    reference = {name: role.lower() for name, role in _ROLE_STATEMENT.findall(answer)}
    solution = extract_solution(completion)
    stated = _ROLE_STATEMENT.findall(completion if solution is None else solution)
    predicted = {name: role.lower() for name, role in stated}  # the last statement wins
    return bool(reference) and all(predicted.get(name) == role for name, role in reference.items())


def _grade(completion: str, answer: str, grader: str, timeout: int | None) -> bool:
    if grader == "math":
        return _grade_math(completion, answer, timeout)
    if grader == "knights_knaves":
        return _grade_knights_knaves(completion, answer)
    raise ValueError(f"unknown grader {grader!r}; use one of {GRADERS}")


def grade_in_worker(completion: str, answer: str, grader: str) -> bool:
    """``grade`` without math-verify's own timeouts: in a pool worker the parent's hard timeout is
    the single guard, so every timeout is counted and none depends on signals reaching Python."""
    _quiet_math_verify()
    return _grade(completion, answer, grader, timeout=None)


def grade(completion: str, answer: str, grader: str = "math") -> bool:
    """Whether a completion's final answer equals the reference (the reward of section 5.1).

    Serial and in-process. In the main thread math-verify's own (signal-based) timeouts guard
    each step; in other threads they cannot, so use ``grade_batch`` (a pool with hard timeouts)
    for anything untrusted in bulk.

    >>> reply = "<start_working_out> ... <end_working_out><SOLUTION> 1/2 </SOLUTION>"
    >>> grade(reply, "\\\\frac{1}{2}")
    True
    >>> grade("so the answer is \\\\boxed{0.5}", "1/2")
    True
    >>> grade("<SOLUTION> 3 </SOLUTION>", "4")
    False
    """
    _quiet_math_verify()
    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout = max(1, math.ceil(GRADE_TIMEOUT_S)) if in_main_thread else None
    return _grade(completion, answer, grader, timeout)


def grading_pool(num_workers: int | None = None, timeout_s: float = GRADE_TIMEOUT_S) -> GradingPool:
    """A pool of workers that run ``grade_in_worker`` (close it, or use it as a context manager)."""
    return GradingPool(
        "machinery.task:grade_in_worker", num_workers=num_workers, timeout_s=timeout_s
    )


@functools.cache
def default_pool() -> GradingPool:
    """The process-wide pool ``grade_batch`` uses (made on first use, its workers stopped at
    exit)."""
    pool = grading_pool()
    atexit.register(pool.close)
    return pool


def grade_batch(
    completions: Sequence[str],
    answers: Sequence[str],
    graders: str | Sequence[str] = "math",
    *,
    pool: GradingPool | None = None,
    progress: bool = False,
) -> list[bool]:
    """``grade`` over a batch (``graders``: one name, or one per completion), in parallel worker
    processes with a hard per-item timeout: a pathological item (a parser that never returns) is
    graded wrong and counted in ``pool.stats["timeouts"]``. Uses ``default_pool()`` unless a pool
    is given."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    graders = [graders] * len(completions) if isinstance(graders, str) else graders
    items = list(zip(map(str, completions), map(str, answers), graders))
    return (pool or default_pool()).map(items, progress=progress)


# --------------------------------------------------------------------------------------------
# 5. The reward
# --------------------------------------------------------------------------------------------


def math_reward(
    completions: Sequence[str], problems: Sequence[str], answers: Sequence[str]
) -> list[float]:
    """r(x, y) = 1 if the completion's final answer equals the reference (Math-Verify), else 0.

    A reward function takes a batch of completions (decoded text), their problems and their
    reference answers, one each, and returns one float per completion. This is the paper's.
    """
    return [float(correct) for correct in grade_batch(completions, answers)]


class RewardError(UsageError):
    """A reward function that cannot be used; the message names the problem and the fix."""


def load_reward_function(
    spec: str,
) -> Callable[[Sequence[str], Sequence[str], Sequence[str]], list[float]]:
    """The reward named by ``--reward``: "" for ``math_reward``, else ``module:function`` (an
    importable module) or ``path/to/file.py:function``, wrapped by ``checked_reward``.

    >>> load_reward_function("machinery.task:math_reward").__name__
    'math_reward'
    """
    if not spec:
        return math_reward
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise RewardError(f"--reward {spec!r}: write module:function or path/to/file.py:function")
    if where.endswith(".py") and not os.path.isfile(where):
        raise RewardError(f"--reward {spec!r}: no file {where!r}; pass an existing .py file")
    try:  # the file's or the module's names
        found = runpy.run_path(where) if where.endswith(".py") else vars(import_module(where))
    except Exception as error:  # noqa: BLE001 -- whatever the user's module raises on import
        raise RewardError(
            f"--reward {spec!r}: cannot import {where!r} ({type(error).__name__}: "
            f"{first_line(error)}); pass an importable module or a .py file"
        ) from None
    function = found.get(name)
    if not callable(function):
        raise RewardError(f"--reward {spec!r}: {where!r} has no function {name!r}")
    try:
        inspect.signature(function).bind(["completion"], ["problem"], ["answer"])
    except (TypeError, ValueError):
        raise RewardError(
            f"--reward {spec!r}: a reward takes (completions, problems, answers), three lists, "
            f"and returns one float per completion; {name}{inspect.signature(function)} does not"
        ) from None
    return checked_reward(function, spec)


def checked_reward(function: Callable, name: str) -> Callable:
    """``function`` with its output checked: one finite number per completion, else a one-line
    error."""

    def reward(
        completions: Sequence[str], problems: Sequence[str], answers: Sequence[str]
    ) -> list[float]:
        values = function(list(completions), list(problems), list(answers))
        try:
            values = [float(value) for value in values]
        except (TypeError, ValueError):
            raise RewardError(
                f"reward {name} returned {type(values).__name__} {str(values)[:80]}; it must "
                "return one float per completion"
            ) from None
        if len(values) != len(completions):
            raise RewardError(
                f"reward {name} returned {len(values)} values for {len(completions)} completions"
            )
        bad = next((i for i, value in enumerate(values) if not math.isfinite(value)), None)
        if bad is not None:
            raise RewardError(
                f"reward {name} returned {values[bad]} for completion {bad}: rewards must be finite"
            )
        return values

    reward.__name__ = getattr(function, "__name__", "reward")
    return reward
