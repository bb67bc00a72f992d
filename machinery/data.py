"""Data: training problems, SFT examples and benchmarks, from the hub or a local file.

1. ``load_rows``: the one loader. A hub dataset (name, configuration, split) or a local
   .jsonl / .json / .parquet / .csv file, as a list of dicts; failures are one line naming the fix.
2. Training problems (section 5.1: the first 2,000 of DAPO-Math-17k-Processed) as
   {problem, answer}, and the ``PromptSampler`` that draws them step after step (checkpointed).
3. SFT examples (App. E.2): numerically answerable rows of OpenMathReasoning-mini in the paper's
   format, kept only when their whole text fits (never cut), with counts of what was dropped.
4. Benchmarks (section 5.1: AIME 2024-2025, AMC23, MATH-500 level 5, Minerva, Knights-and-Knaves)
   by name from their public hub copies, or from a local file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from machinery import UsageError
from machinery.task import GRADERS, build_prompt_ids, sft_completion

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(UsageError):
    """Data that cannot be used as asked; the message names the problem and the fix."""


# --------------------------------------------------------------------------------------------
# 1. The loader
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# 2. Training problems and the prompt sampler
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# 3. SFT examples (App. E.2)
# --------------------------------------------------------------------------------------------


def sft_examples(
    rows: list[dict], problem_key: str, reasoning_key: str, answer_key: str, where: str
) -> tuple[list[dict], int]:
    """{problem, completion} in the paper's format from the numerically answerable rows (the
    paper keeps those only), and the number of rows dropped for a non-numeric answer."""
    require_fields(
        rows,
        (problem_key, reasoning_key, answer_key),
        where,
        "--sft-problem-key / --sft-reasoning-key / --sft-answer-key",
    )
    examples = []
    for row in rows:
        answer = str(row[answer_key]).strip()
        try:
            float(answer.replace(",", ""))
        except ValueError:
            continue
        examples.append(
            {
                "problem": str(row[problem_key]),
                "completion": sft_completion(str(row[reasoning_key]), answer),
            }
        )
    if not examples:
        raise DataError(f"no numerically answerable SFT examples in {where}")
    return examples, len(rows) - len(examples)


def tokenize_sft_examples(
    tokenizer, examples: list[dict], max_tokens: int, max_samples: int = 0
) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """(prompt ids, completion ids + EOS) of the first ``max_samples`` examples (0: all) whose
    whole text fits in ``max_tokens``, and counts of what was kept and dropped.

    An example is never cut: a cut one would lose its closing ``</SOLUTION>`` and EOS, and SFT
    would teach the model not to close the format (the RL stage would then see no reward).
    """
    pairs, dropped, longest = [], 0, 0
    for example in examples:
        prompt = build_prompt_ids(tokenizer, example["problem"])
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        if len(prompt) + len(completion) > max_tokens:
            dropped += 1
            continue
        pairs.append((prompt, completion))
        longest = max(longest, len(prompt) + len(completion))
        if max_samples and len(pairs) >= max_samples:
            break
    stats = {
        "kept": len(pairs),
        "dropped_too_long": dropped,
        "max_tokens": max_tokens,
        "longest_kept": longest,
    }
    if not pairs:
        raise DataError(
            f"no SFT example fits in {max_tokens} tokens (prompt + completion); raise "
            "--sft-max-tokens or --max-seq-len"
        )
    return pairs, stats


# --------------------------------------------------------------------------------------------
# 4. Benchmarks
# --------------------------------------------------------------------------------------------


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
class HubSource:
    """Where (part of) a benchmark lives on the Hugging Face hub."""

    path: str
    split: str
    problem_key: str
    answer_key: str
    config: str | None = None
    data_files: str | None = None
    level: int | None = None  # keep rows with this "level" (MATH-500's difficulty)


@dataclass(frozen=True)
class Benchmark:
    sources: tuple[HubSource, ...]
    grader: str = "math"
    paper_size: int | None = None  # the number of problems in the paper (section 5.1)


# Standard public copies (the paper names the benchmarks, not the copies).
BENCHMARKS = {
    "aime": Benchmark(
        (
            HubSource("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
            HubSource("opencompass/AIME2025", "test", "question", "answer", config="AIME2025-I"),
            HubSource("opencompass/AIME2025", "test", "question", "answer", config="AIME2025-II"),
        ),
        paper_size=60,
    ),
    "amc23": Benchmark((HubSource("math-ai/amc23", "test", "question", "answer"),), paper_size=40),
    "math500-l5": Benchmark(
        (HubSource("HuggingFaceH4/MATH-500", "test", "problem", "answer", level=5),), paper_size=134
    ),
    "minerva": Benchmark(
        (HubSource("math-ai/minervamath", "test", "question", "answer"),), paper_size=272
    ),
    # Xie et al. 2024, all seven test files (2 to 8 people, 100 puzzles each).
    "knights-and-knaves": Benchmark(
        (
            HubSource(
                "K-and-K/knights-and-knaves",
                "train",
                "quiz",
                "solution_text_format",
                data_files="test/people*_num100.jsonl",
            ),
        ),
        grader="knights_knaves",
    ),
}


def rows_to_problems(
    rows: list[dict],
    problem_key: str,
    answer_key: str,
    grader: str,
    where: str,
    solution_key: str = "",
    group_key: str = "",
) -> list[Problem]:
    """Rows -> Problems; ``solution_key`` and ``group_key`` (optional) fill ``solution`` and
    ``group`` where a row has them ("" where it does not)."""
    require_fields(rows, (problem_key, answer_key), where, "--problem-key / --answer-key")
    return [
        Problem(
            problem=str(row[problem_key]),
            answer=str(row[answer_key]),
            grader=grader,
            solution=str(row.get(solution_key) or "").strip() if solution_key else "",
            group=str(row.get(group_key) or "") if group_key else "",
        )
        for row in rows
    ]


def load_benchmark(name: str, solution_key: str = "", group_key: str = "") -> list[Problem]:
    """A benchmark by name (``BENCHMARKS``), from the hub or the local datasets cache; its rows'
    ``solution_key`` and ``group_key`` fields (MATH-500: solution, level) fill the problems'
    reference solution and group.

    Offline and not cached, it raises one line naming the fixes: run once online (the cache
    then serves offline runs, e.g. with HF_HUB_OFFLINE=1), or pass a local file.
    """
    if name not in BENCHMARKS:
        raise DataError(
            f"unknown benchmark {name!r}; use one of {', '.join(BENCHMARKS)} "
            "or a .jsonl/.parquet file"
        )
    benchmark, problems = BENCHMARKS[name], []
    for source in benchmark.sources:
        try:
            rows = load_rows(source.path, source.config, source.split, source.data_files)
        except DataError as error:
            raise DataError(
                f"benchmark {name!r}: {error} with --problem-key/--answer-key"
            ) from None
        if source.level is not None:
            rows = [
                row for row in rows if str(row["level"]).removeprefix("Level ") == str(source.level)
            ]
        problems += rows_to_problems(
            rows,
            problem_key=source.problem_key,
            answer_key=source.answer_key,
            grader=benchmark.grader,
            where=source.path,
            solution_key=solution_key,
            group_key=group_key,
        )
    if benchmark.paper_size and len(problems) != benchmark.paper_size:
        print(
            f"[data] note: {name} has {len(problems)} problems here, "
            f"{benchmark.paper_size} in the paper",
            file=sys.stderr,
        )
    return problems


def resolve_benchmarks(
    spec: str,
    problem_key: str = "problem",
    answer_key: str = "answer",
    grader: str = "math",
    solution_key: str = "",
    group_key: str = "",
) -> dict[str, tuple[str, list[Problem]]]:
    """``aime,amc23,path/to/mine.jsonl`` -> {name: (source, problems)}; files are named by stem.
    Local files' ``solution_key`` and ``group_key`` fields fill each problem's reference solution
    and group (the support probe's input)."""
    if grader not in GRADERS:
        raise DataError(f"unknown grader {grader!r}; use one of {', '.join(GRADERS)}")
    resolved = {}
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        if os.path.splitext(entry)[1].lower() in LOCAL_FORMATS:
            name = os.path.splitext(os.path.basename(entry))[0]
            problems = rows_to_problems(
                load_rows(entry),
                problem_key=problem_key,
                answer_key=answer_key,
                grader=grader,
                where=entry,
                solution_key=solution_key,
                group_key=group_key,
            )
            resolved[name] = (os.path.abspath(entry), problems)
        else:
            sources = BENCHMARKS[entry].sources if entry in BENCHMARKS else ()
            problems = load_benchmark(entry, solution_key=solution_key, group_key=group_key)
            resolved[entry] = ("hub:" + ",".join(s.path for s in sources), problems)
        if not resolved[list(resolved)[-1]][1]:
            raise DataError(f"benchmark {entry!r} has no problems")
    if not resolved:
        raise DataError("no benchmarks given; pass e.g. --benchmarks aime,amc23,math500-l5")
    return resolved


def problems_fingerprint(problems: Sequence[Problem]) -> str:
    """sha256 of the problems, answers and graders (a resumed run must see the same ones)."""
    payload = json.dumps([(p.problem, p.answer, p.grader) for p in problems], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()
