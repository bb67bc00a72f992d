"""The task's grading and its reward: is a completion's answer the reference's?

4. Grading (section 5.1): the answer inside ``<SOLUTION>`` when present, else what Math-Verify
   extracts from the whole text, compared with the reference by Math-Verify; Knights-and-Knaves
   answers by matching every person's role (their answers are sentences). ``grade`` is serial;
   ``grade_batch`` runs ``GradingPool`` workers with a hard per-item timeout (section 6 below).
5. The reward r(x, y) in {0, 1} (section 5.1): ``math_reward``, a function over a batch of
   completions with their problems and reference answers -- the signature of any reward; the
   trainer's ``--reward module:function`` (or ``path/to/file.py:function``) plugs in another one,
   checked by ``import_reward``.

Grading choices the paper leaves open: a short answer inside <SOLUTION> is read as LaTeX (wrapped
in ``$...$``) unless it is prose or a plain number; the reference answer likewise. A number in
e-notation (7.5e-8), anywhere, is 7.5 x 10^-8 (math-verify alone reads 7.5 e - 8, e Euler's).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import math
import os
import re
import resource
import runpy
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

from machinery import UsageError
from task.problems import first_line

GRADERS = ("math", "knights_knaves")  # evaluate.py's --grader choices
GRADE_TIMEOUT_S = 5.0  # per item: generous (a normal answer takes 1 to 20 ms)


# --------------------------------------------------------------------------------------------
# 4. Grading
# --------------------------------------------------------------------------------------------


_SOLUTION_BLOCK = re.compile(r"<SOLUTION>(.*?)</SOLUTION>", re.DOTALL)
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")  # a word, not a LaTeX command
_PLAIN_NUMBER = re.compile(r"\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+)?\s*%?\s*")
_E_NOTATION = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)[eE]([-+]?\d{1,3})(?![\w.])")  # 7.5e-8
_POWER_OF_TEN = r"\1\\times10^{\2}"  # what _E_NOTATION's number becomes: 7.5\times10^{-8}


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

    completion = _E_NOTATION.sub(_POWER_OF_TEN, completion)
    reference = _parse_short_answer(_E_NOTATION.sub(_POWER_OF_TEN, str(answer)), timeout)
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


def load_reward_function(spec: str) -> Callable[..., list[float]]:
    """The reward --reward names: "" for the paper's, ``math_reward``, else ``import_reward``'s."""
    return import_reward(spec) if spec else math_reward


def import_reward(spec: str) -> Callable:
    """``module:function`` (an importable module) or ``path/to/file.py:function``, wrapped by
    ``checked_reward``: f(completions, problems, answers) -> one float each.

    >>> import_reward("task.grading:math_reward").__name__
    'math_reward'
    """
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


# --------------------------------------------------------------------------------------------
# 6. The grading pool: worker processes with a hard per-item timeout
# --------------------------------------------------------------------------------------------
#
# Math-Verify's parser can run for hours on an adversarial answer (``9^{9^{9}}`` has 370 million
# digits) and its own timeouts rely on signals, which work only in a main thread. A trainer that
# grades 64 completions per step, or an evaluation that grades 60,000, cannot stall on one item.
# So grading runs in a pool of fresh interpreters, each item under a deadline: an item that runs
# past it has its worker killed, is graded wrong and counted, and a new worker takes the rest of
# the queue. The pool knows nothing about what it grades: ``grading_pool`` above names its
# function.

WORKER_MEMORY_LIMIT = 4 * 2**30  # address-space cap of a worker: a blow-up becomes a MemoryError
# Items a worker gets at once: consecutive items (a problem's G completions) share a reference,
# which a worker then parses once (dealt one at a time, each worker parsed it: +27% CPU).
CHUNK_SIZE = 16
STARTUP_S = 60.0  # the most a worker's start-up (its imports, under load) may take
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker_main(target: str, read_fd: int, write_fd: int) -> None:
    """A grading worker (its own interpreter): imports ``target`` ("module:function"), receives
    chunks of (index, args) and sends back (index, bool(function(*args))) after each item, so the
    parent always knows which item is running."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = (
        WORKER_MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(WORKER_MEMORY_LIMIT, hard)
    )
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    module, name = target.split(":")
    function = getattr(import_module(module), name)  # the import is most of a start-up
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    outbox.send("ready")
    while True:
        try:
            chunk = inbox.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        for index, args in chunk:
            try:
                correct = bool(function(*args))
            except Exception:  # noqa: BLE001 -- MemoryError, RecursionError, parser bugs: wrong
                correct = False
            outbox.send((index, correct))


@dataclass
class _Worker:
    process: subprocess.Popen
    inbox: Connection  # the parent sends chunks on it
    outbox: Connection  # the parent reads answers from it
    deadline: float  # when the item now running (or the start-up) times out
    ready: bool = False  # it has imported the grading function and said so
    pending: deque = field(default_factory=deque)  # the (index, args) sent, not yet answered


class GradingPool:
    """Worker processes that grade items with a hard per-item timeout.

    ``target`` names the grading function, "module:function", called as ``function(*item)`` and
    returning a bool. Each worker gets a chunk of items and answers item by item; an item that
    runs past ``timeout_s`` gets its worker killed (SIGKILL: it works even inside C code), is
    graded wrong and counted in ``stats["timeouts"]``, and the rest of its chunk goes back in the
    queue. Workers are fresh interpreters (``python -c``) talking over pipes, so none inherits
    the caller's threads, CUDA context or vLLM engine, and none re-imports the caller's
    ``__main__`` (as multiprocessing's spawn and forkserver would). A worker starts in about a
    second, which only a timeout costs again. Reuse one pool across calls (the trainer grades
    every step); ``close()`` ends its workers.
    """

    def __init__(
        self, target: str, num_workers: int | None = None, timeout_s: float = GRADE_TIMEOUT_S
    ):
        self.target, self.timeout_s = target, timeout_s
        self.num_workers = num_workers or min(32, len(os.sched_getaffinity(0)))
        self.stats = {"timeouts": 0, "crashes": 0}
        self.last_timeouts: list[int] = []  # indices of the last call's items that timed out
        self._workers: list[_Worker] = []

    def _start_worker(self) -> _Worker:
        to_worker, from_worker = os.pipe(), os.pipe()
        code = (
            f"import sys; sys.path.insert(0, {REPOSITORY!r}); from task import grading; "
            f"grading._worker_main({self.target!r}, {to_worker[0]}, {from_worker[1]})"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=(to_worker[0], from_worker[1]),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_worker[0])
        os.close(from_worker[1])
        inbox = Connection(to_worker[1], readable=False)
        outbox = Connection(from_worker[0], writable=False)
        return _Worker(process, inbox, outbox, deadline=time.monotonic() + STARTUP_S)

    def _stop(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait()
        worker.inbox.close()
        worker.outbox.close()

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def map(self, items: Sequence[tuple], progress: bool = False) -> list[bool]:
        """``function(*item)`` for each item, in input order; an item past the timeout, or whose
        worker crashed, is False."""
        results = [False] * len(items)
        numbered = [(index, tuple(args)) for index, args in enumerate(items)]
        # Chunks shrink for small batches so that every worker gets some.
        size = max(1, min(CHUNK_SIZE, len(items) // (4 * self.num_workers)))
        queue = deque(numbered[i : i + size] for i in range(0, len(items), size))
        self.last_timeouts = []
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        bar = tqdm(total=len(items), desc="grading", unit="item", disable=not progress, leave=False)
        with bar:
            while queue or any(worker.pending for worker in self._workers):
                self._dispatch(queue)
                busy = [worker for worker in self._workers if worker.pending or not worker.ready]
                timeout = min(worker.deadline for worker in busy) - time.monotonic()
                answered = wait([worker.outbox for worker in busy], timeout=max(0.0, timeout))
                for worker in busy:
                    try:
                        while worker.outbox in answered and worker.outbox.poll():
                            message = worker.outbox.recv()
                            worker.deadline = time.monotonic() + self.timeout_s
                            if message == "ready":
                                worker.ready = True
                                continue
                            results[message[0]] = message[1]
                            worker.pending.popleft()
                            bar.update()
                    except (EOFError, OSError):  # it died (the OS killed it, a crash)
                        self._fail(worker, queue, "crashes", bar)
                        continue
                    if worker.deadline <= time.monotonic():
                        self._fail(worker, queue, "timeouts", bar)
        return results

    def _dispatch(self, queue: deque) -> None:
        """The next chunk to each worker that is ready and idle."""
        for worker in list(self._workers):
            if worker.ready and not worker.pending and queue:
                chunk = queue.popleft()
                try:
                    worker.inbox.send(chunk)
                except OSError:  # it died while idle (e.g. between calls): a fresh one takes over
                    queue.appendleft(chunk)
                    self._replace(worker)
                    continue
                worker.pending.extend(chunk)
                worker.deadline = time.monotonic() + self.timeout_s

    def _fail(self, worker: _Worker, queue: deque, reason: str, bar) -> None:
        """A worker that died or ran past its deadline: the item it was running (its chunk's first
        unanswered one) is wrong and counted, the rest of the chunk goes back in the queue, and a
        fresh worker takes its place."""
        if not worker.ready:
            raise RuntimeError(
                f"a grading worker failed to start (exit code {worker.process.poll()}); check "
                f"that `import {self.target.split(':')[0]}` works in a fresh interpreter"
            )
        culprit, _ = worker.pending.popleft()
        self.stats[reason] += 1
        if reason == "timeouts":
            self.last_timeouts.append(culprit)
        bar.update()
        if worker.pending:
            queue.appendleft(list(worker.pending))
        self._replace(worker)

    def close(self) -> None:
        """Stop the workers (they hold nothing to save); a later ``map`` starts new ones."""
        for worker in self._workers:
            self._stop(worker)
        self._workers.clear()

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
