"""The task's grading and its reward: is a completion's answer the reference's?

4. Grading (section 5.1): the answer inside ``<SOLUTION>`` when present, else what Math-Verify
   extracts from the whole text, compared with the reference by Math-Verify; Knights-and-Knaves
   answers by matching every person's role (their answers are sentences). ``grade`` is serial;
   ``grade_batch`` runs ``grading_pool.GradingPool`` workers with a hard per-item timeout.
5. The reward r(x, y) in {0, 1} (section 5.1): ``math_reward``, a function over a batch of
   completions with their problems and reference answers -- the signature of any reward; the
   trainer's ``--reward module:function`` (or ``path/to/file.py:function``) plugs in another one,
   checked by ``load_reward_function``.

Grading choices the paper leaves open: a short answer inside <SOLUTION> is read as LaTeX (wrapped
in ``$...$``) unless it is prose or a plain number; the reference answer likewise.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import math
import os
import re
import runpy
import threading
from collections.abc import Callable, Sequence
from importlib import import_module

from machinery import UsageError
from task.grading_pool import DEFAULT_TIMEOUT_S as GRADE_TIMEOUT_S
from task.grading_pool import GradingPool
from task.problems import first_line

GRADERS = ("math", "knights_knaves")  # evaluate.py's --grader choices


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
    return GradingPool("task.grading:grade_in_worker", num_workers=num_workers, timeout_s=timeout_s)


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

    >>> load_reward_function("task.grading:math_reward").__name__
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
