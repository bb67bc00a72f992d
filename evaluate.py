"""Evaluation of SAGE models: grading, unbiased pass@k at n = 256 on vLLM, the paper's analyses.

Read top to bottom, this is an evaluation run:

1. Grading (shared with the trainer's rewards): ``grade(completion, answer)`` reads the answer
   inside ``<SOLUTION>...</SOLUTION>`` (the paper's format, App. E.4) when present, else what
   math-verify extracts from the whole text, and compares it with the reference by math-verify.
   ``grade_batch`` runs a ``GradingPool`` of worker processes with a hard per-item timeout: an
   input that hangs the parser is graded wrong, counted, and its worker replaced.
2. pass@k (section 5.1, Chen et al. 2021): the unbiased estimator 1 - C(n-c, k) / C(n, k), as
   the stable product 1 - prod_{i=n-c+1..n} (1 - k/i), for every k = 1, 2, 4, ..., n, with its
   sampling variance (SPEC section 8) for standard errors, and mean / std over seeds.
3. Benchmarks by name (AIME 2024+2025, AMC23, MATH-500 level 5, Minerva, Knights-and-Knaves)
   from the hub with ``datasets``, or a local JSONL / Parquet file.
4. Prompts: the tokenizer's chat template, applied once, with the paper's system prompt.
5. ``evaluate_problems``: one engine call per seed with n samples per prompt, pooled grading,
   per-problem correct counts, pass@k. ``run_evaluation`` (the CLI) adds several benchmarks,
   the model's identity, a LoRA adapter merged in memory, an atomic results file and resume.
6. The paper's analyses: reasoning-pattern frequencies over correct solutions (Eq. 13) and the
   perplexity of completions under a base model (Eq. 39, Figure 7).
7. Plots: pass@k curves over log2 k, one panel per benchmark, one line per model (Figure 3).
8. The command line: ``python evaluate.py --model PATH ...`` and the subcommands ``plot``,
   ``patterns`` and ``perplexity``.

Where this differs from the authors' evaluation (SPEC section 8): their pass@1 used the last
problem's responses only, they reported pass@k at k = n only, and they sampled with HF generate.
Here every problem counts, every power of two k is reported with a standard error, and sampling
runs on vLLM, one call per seed over all benchmarks (n = 256 on ~500 problems keeps a few GB of
token ids and log-probs in host memory for the duration of a call).

Grading choices the paper leaves open: a short answer inside <SOLUTION> is read as LaTeX (wrapped
in ``$...$``) unless it is prose or a plain number; the reference answer likewise. Knights-and-Knaves answers
are graded by matching every person's role, not by math-verify (their answers are sentences).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

GRADE_TIMEOUT_S = 5.0  # per item: generous (a normal answer takes 1 to 20 ms)
WORKER_MEMORY_LIMIT = 4 * 2**30  # address-space cap of a grading worker: a blow-up is a MemoryError
GRADERS = ("math", "knights_knaves")


class EvalError(ValueError):
    """A user-facing problem (bad input, missing data): the CLI prints it as one line."""


# --------------------------------------------------------------------------------------------
# 1. Grading
# --------------------------------------------------------------------------------------------

_SOLUTION_BLOCK = re.compile(r"<SOLUTION>(.*?)</SOLUTION>", re.DOTALL)
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")  # a word, not a LaTeX command
# 42, -7, 0.5, 1,000, 3/4, 12%: math-verify reads these without its (slow) LaTeX parser.
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


def _parse_short_answer(text: str, timeout: int | None) -> list:
    """math-verify's parse of a bare answer such as ``1/2``, ``\\frac{1}{2}`` or ``(1, 2]``.

    Bare LaTeX is wrapped in ``$...$`` first, so that sets and intervals are read as such
    (unwrapped, math-verify reads ``(1, 2]`` as the number 2); prose and plain numbers are
    parsed as they are (plain numbers skip the LaTeX parser: ~1 ms instead of ~20 ms).
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


@functools.lru_cache(maxsize=4096)
def _parse_reference(answer: str, timeout: int | None) -> list:
    # Cached: the trainer grades G = 8 completions per reference, evaluation n = 256.
    return _parse_short_answer(answer, timeout)


def _grade_math(completion: str, answer: str, timeout: int | None) -> bool:
    from math_verify import parse, verify

    reference = _parse_reference(str(answer), timeout)
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
    predicted = {}
    for name, role in _ROLE_STATEMENT.findall(completion if solution is None else solution):
        predicted[name] = role.lower()
    return bool(reference) and all(predicted.get(name) == role for name, role in reference.items())


def _grade(completion: str, answer: str, grader: str, timeout: int | None) -> bool:
    if grader == "math":
        return _grade_math(completion, answer, timeout)
    if grader == "knights_knaves":
        return _grade_knights_knaves(completion, answer)
    raise EvalError(f"unknown grader {grader!r}; use one of {GRADERS}")


def grade(completion: str, answer: str, grader: str = "math") -> bool:
    """Whether a completion's final answer equals the reference (the reward of section 5.1).

    Serial and in-process. In the main thread math-verify's own (signal-based) timeouts guard
    each step; in other threads they cannot, so use ``grade_batch`` (a pool with hard timeouts)
    for anything untrusted in bulk.

    >>> grade("<start_working_out> ... <end_working_out><SOLUTION> 1/2 </SOLUTION>", "\\\\frac{1}{2}")
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


def _worker_main(read_fd: int, write_fd: int, memory_limit: int | None) -> None:
    """A grading worker (its own interpreter): receives chunks of (index, completion, answer,
    grader), sends back (index, correct) after each item, so the parent always knows which
    item is running."""
    from multiprocessing.connection import Connection

    if memory_limit:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_limit if hard == resource.RLIM_INFINITY else min(memory_limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    _quiet_math_verify()
    _grade("<SOLUTION> 1 </SOLUTION>", "1", "math", timeout=None)  # warm up imports and regexes
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    outbox.send("ready")
    while True:
        try:
            chunk = inbox.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if chunk is None:
            return
        for index, completion, answer, grader in chunk:
            try:
                # No math-verify timeouts here: the parent's hard timeout is the single guard,
                # so every timeout is counted and none depends on signals reaching Python code.
                correct = _grade(completion, answer, grader, timeout=None)
            except Exception:  # noqa: BLE001 -- MemoryError, RecursionError, parser bugs: wrong
                correct = False
            outbox.send((index, correct))


@dataclass
class _Worker:
    process: object  # subprocess.Popen
    inbox: object  # Connection the parent sends chunks on
    conn: object  # Connection the parent reads results from
    deadline: float  # when the item now running (or the start-up) times out
    ready: bool = False  # the worker has imported math-verify and said so
    pending: deque = field(default_factory=deque)  # indices sent and not yet answered


class GradingPool:
    """Worker processes that grade (completion, answer) pairs with a hard per-item timeout.

    Each worker gets a chunk of items and answers item by item; an item that runs past
    ``timeout_s`` gets its worker killed (SIGKILL: it works even inside C code), is graded wrong
    and counted in ``stats["timeouts"]``, and the rest of its chunk goes back in the queue.
    Workers are fresh interpreters (``python -c "import evaluate; ..."``) talking over pipes, so
    none inherits the caller's threads, CUDA context or vLLM engine, and none re-imports the
    caller's ``__main__`` (as multiprocessing's spawn and forkserver would). A worker starts in
    about a second, which only a timeout costs again. Reuse one pool across calls (the trainer
    grades every step); ``close()`` ends it.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = GRADE_TIMEOUT_S,
        chunk_size: int = 16,
        memory_limit: int | None = WORKER_MEMORY_LIMIT,
    ):
        if timeout_s <= 0:
            raise EvalError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers or min(32, len(os.sched_getaffinity(0)))
        self.timeout_s = float(timeout_s)
        self.chunk_size = chunk_size
        self.memory_limit = memory_limit
        self.stats = {"graded": 0, "timeouts": 0, "crashes": 0, "workers_started": 0}
        self.last_timeouts: list[int] = []  # indices of the last call's items that timed out
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def _start_worker(self) -> _Worker:
        import subprocess
        from multiprocessing.connection import Connection

        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        here = os.path.dirname(os.path.abspath(__file__))
        code = (
            f"import sys; sys.path.insert(0, {here!r}); import evaluate; "
            f"evaluate._worker_main({to_worker_r}, {from_worker_w}, {self.memory_limit!r})"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL
        )
        os.close(to_worker_r)
        os.close(from_worker_w)
        self.stats["workers_started"] += 1
        inbox = Connection(to_worker_w, readable=False)
        deadline = time.monotonic() + max(60.0, self.timeout_s)  # start-up: imports under load
        return _Worker(process, inbox, Connection(from_worker_r, writable=False), deadline)

    def _stop(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait()
        worker.inbox.close()
        worker.conn.close()

    def _replace(self, worker: _Worker) -> _Worker:
        self._stop(worker)
        fresh = self._start_worker()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def grade(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        graders: str | Sequence[str] = "math",
        progress: bool = False,
    ) -> list[bool]:
        """Grade ``completions[i]`` against ``answers[i]``; results in input order."""
        from multiprocessing.connection import wait

        from tqdm import tqdm

        if len(completions) != len(answers):
            raise EvalError(f"{len(completions)} completions but {len(answers)} answers")
        graders = [graders] * len(completions) if isinstance(graders, str) else list(graders)
        if len(graders) != len(completions) or any(g not in GRADERS for g in graders):
            raise EvalError(f"graders must be one of {GRADERS}: one name, or one per completion")
        items = [(i, str(c), str(a), g) for i, (c, a, g) in enumerate(zip(completions, answers, graders))]
        if not items:
            return []
        with self._lock:
            if self._closed:
                raise EvalError("this GradingPool is closed; create a new one")
            while len(self._workers) < self.num_workers:
                self._workers.append(self._start_worker())
            # Chunks shrink for small batches so that every worker gets some.
            size = max(1, min(self.chunk_size, len(items) // (4 * self.num_workers)))
            queue = deque(items[i : i + size] for i in range(0, len(items), size))
            results: list[bool | None] = [None] * len(items)
            self.last_timeouts = []
            with tqdm(total=len(items), desc="grading", unit="item", disable=not progress, leave=False) as bar:
                self._run(queue, items, results, bar, wait)
            self.stats["graded"] += len(items)
        return [bool(r) for r in results]

    def _run(self, queue: deque, items: list, results: list, bar, wait) -> None:
        """The scheduling loop: dispatch chunks, collect answers, enforce deadlines."""
        remaining = len(items)

        def settle(index: int, correct: bool) -> None:
            nonlocal remaining
            results[index] = correct
            remaining -= 1
            bar.update(1)

        def dispatch(worker: _Worker) -> None:
            if worker.ready and queue and not worker.pending:
                chunk = queue.popleft()
                try:
                    worker.inbox.send(chunk)
                except OSError:  # it died while idle (e.g. between calls): a fresh one takes over
                    queue.appendleft(chunk)
                    self._replace(worker)
                    return
                worker.pending.extend(index for index, *_ in chunk)
                worker.deadline = time.monotonic() + self.timeout_s

        def fail_current(worker: _Worker, reason: str) -> None:
            # The item now running is the first unanswered one of the worker's chunk.
            if worker.pending:
                culprit = worker.pending.popleft()
                settle(culprit, False)
                self.stats[reason] += 1
                if reason == "timeouts":
                    self.last_timeouts.append(culprit)
                if worker.pending:
                    queue.appendleft([items[index] for index in worker.pending])
            elif not worker.ready:
                raise RuntimeError(
                    f"a grading worker failed to start (exit code {worker.process.poll()}); "
                    "check that `import evaluate, math_verify` works in a fresh interpreter"
                )
            self._replace(worker)

        while remaining:
            for worker in list(self._workers):
                dispatch(worker)
            waiting = [worker for worker in self._workers if worker.pending or not worker.ready]
            if not waiting:
                raise RuntimeError(f"grading stalled with {remaining} items left and no worker busy")
            timeout = max(0.0, min(worker.deadline for worker in waiting) - time.monotonic())
            ready = wait([worker.conn for worker in waiting], timeout=timeout)
            for worker in waiting:
                try:
                    while worker.conn in ready and worker.conn.poll():
                        message = worker.conn.recv()
                        if message == "ready":
                            worker.ready = True
                        else:
                            index, correct = message
                            settle(index, bool(correct))
                            worker.pending.popleft()
                        worker.deadline = time.monotonic() + self.timeout_s
                except (EOFError, OSError):  # it died (the OS killed it, a crash): replace it
                    fail_current(worker, "crashes")
                    continue
                if worker.deadline <= time.monotonic():
                    fail_current(worker, "timeouts")

    def worker_cpu_seconds(self) -> float:
        """CPU time (user + system) the live workers have used so far (Linux /proc)."""
        total = 0
        for worker in self._workers:
            with open(f"/proc/{worker.process.pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
        return total / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        with self._lock:
            for worker in self._workers:
                try:
                    worker.inbox.send(None)
                except OSError:
                    pass
            for worker in self._workers:
                try:
                    worker.process.wait(timeout=2)
                except Exception:  # noqa: BLE001 -- subprocess.TimeoutExpired: force it
                    pass
                self._stop(worker)
            self._workers.clear()
            self._closed = True

    def __enter__(self) -> "GradingPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default_pool: GradingPool | None = None


def default_pool() -> GradingPool:
    """The process-wide pool ``grade_batch`` uses (created on first use, closed at exit)."""
    global _default_pool
    if _default_pool is None or _default_pool._closed:
        import atexit

        _default_pool = GradingPool()
        atexit.register(_default_pool.close)
    return _default_pool


def grade_batch(
    completions: Sequence[str],
    answers: Sequence[str],
    graders: str | Sequence[str] = "math",
    *,
    pool: GradingPool | None = None,
    progress: bool = False,
) -> list[bool]:
    """``grade`` over a batch, in parallel worker processes with a hard per-item timeout.

    A pathological item (a parser that never returns) is graded wrong and counted in
    ``pool.stats["timeouts"]``. Uses ``default_pool()`` unless a pool is given.
    """
    return (pool or default_pool()).grade(completions, answers, graders, progress=progress)


# --------------------------------------------------------------------------------------------
# 2. pass@k: the unbiased estimator, its variance, summaries over problems and seeds
# --------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples (Chen et al. 2021).

    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k/i) (SPEC section 6), and
    1.0 when n - c < k (every k-subset holds a correct sample).

    >>> pass_at_k(4, 1, 2)  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    0.5
    >>> pass_at_k(256, 0, 256), pass_at_k(256, 1, 256), round(pass_at_k(10, 3, 1), 12)  # pass@1 = c/n
    (0.0, 1.0, 0.3)
    """
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise EvalError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@functools.lru_cache(maxsize=None)
def _overlap_probabilities(n: int, k: int) -> tuple[float, ...]:
    # P(two independent random k-subsets of n share j elements), j = 0..k (hypergeometric).
    total = math.comb(n, k)
    return tuple(math.comb(k, j) * math.comb(n - k, k - j) / total for j in range(k + 1))


def pass_at_k_variance(n: int, p: float, k: int) -> float:
    """Variance of the pass@k estimator when c ~ Binomial(n, p) (SPEC section 8).

    Var = C(n,k)^-1 sum_{j=1..k} C(k,j) C(n-k,k-j) [(1-p)^(2k-j) - (1-p)^(2k)]: the estimator's
    square is the chance that two random k-subsets both miss, and they overlap in j samples.

    >>> pass_at_k_variance(1, 0.5, 1)  # one Bernoulli(1/2) sample: p (1 - p)
    0.25
    """
    if not (0.0 <= p <= 1.0 and 1 <= k <= n):
        raise EvalError(f"pass_at_k_variance needs 0 <= p <= 1 and 1 <= k <= n; got p={p}, k={k}, n={n}")
    q = 1.0 - p
    weights = _overlap_probabilities(n, k)
    return sum(weights[j] * (q ** (2 * k - j) - q ** (2 * k)) for j in range(1, k + 1))


def ks_up_to(n: int) -> list[int]:
    """k = 1, 2, 4, ..., and n itself (SPEC section 6 reports every power of two up to n).

    >>> ks_up_to(256)[-3:], ks_up_to(12)
    ([64, 128, 256], [1, 2, 4, 8, 12])
    """
    ks = [2**e for e in range(n.bit_length()) if 2**e <= n]
    return ks if ks[-1] == n else ks + [n]


def pass_at_k_of_counts(counts: Sequence[int], n: int, ks: Sequence[int]) -> dict:
    """Benchmark pass@k (mean over problems) and its standard error, for one seed.

    The standard error is that of sampling: sqrt(sum_x Var_x) / P with Var_x the estimator's
    variance at the plug-in p = c_x / n (problems held fixed).

    >>> pass_at_k_of_counts([0, 2, 4], n=4, ks=[1, 4])["pass_at_k"]
    {'1': 0.5, '4': 0.6666666666666666}
    """
    if not counts:
        raise EvalError("no problems to score")
    out = {"pass_at_k": {}, "pass_at_k_stderr": {}}
    for k in ks:
        values = [pass_at_k(n, c, k) for c in counts]
        variance = sum(pass_at_k_variance(n, c / n, k) for c in counts)
        out["pass_at_k"][str(k)] = sum(values) / len(values)
        out["pass_at_k_stderr"][str(k)] = math.sqrt(variance) / len(counts)
    return out


def summarize_seeds(seed_entries: Sequence[dict], ks: Sequence[int]) -> dict:
    """Mean, std (over seeds, ddof = 1; 0 for one seed) and standard error per k.

    The standard error is that of the mean over seeds: sqrt(sum_s se_s^2) / S.
    """
    summary = {}
    for k in map(str, ks):
        values = [entry["pass_at_k"][k] for entry in seed_entries]
        errors = [entry["pass_at_k_stderr"][k] for entry in seed_entries]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        stderr = math.sqrt(sum(e * e for e in errors)) / len(errors)
        summary[k] = {"mean": mean, "std": std, "stderr": stderr, "num_seeds": len(values)}
    return summary


# --------------------------------------------------------------------------------------------
# 3. Benchmarks: by name from the hub, or a local JSONL / Parquet file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One evaluation problem: the text shown to the model, its reference answer, its grader."""

    problem: str
    answer: str
    grader: str = "math"


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
    "minerva": Benchmark((HubSource("math-ai/minervamath", "test", "question", "answer"),), paper_size=272),
    # Xie et al. 2024, all seven test files (2 to 8 people, 100 puzzles each).
    "knights-and-knaves": Benchmark(
        (
            HubSource(
                "K-and-K/knights-and-knaves", "train", "quiz", "solution_text_format",
                data_files="test/people*_num100.jsonl",
            ),
        ),
        grader="knights_knaves",
    ),
}
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _rows_to_problems(rows, problem_key: str, answer_key: str, grader: str, where: str) -> list[Problem]:
    columns = list(rows.column_names)
    missing = [key for key in (problem_key, answer_key) if key not in columns]
    if missing:
        raise EvalError(
            f"{where} has no column {missing[0]!r} (columns: {', '.join(columns)}); "
            "pass --problem-key / --answer-key"
        )
    return [Problem(str(row[problem_key]), str(row[answer_key]), grader) for row in rows]


def load_local_benchmark(path: str, problem_key: str = "problem", answer_key: str = "answer",
                         grader: str = "math") -> list[Problem]:
    """Problems from a local JSONL / JSON / Parquet file, one problem per row."""
    import datasets

    suffix = os.path.splitext(path)[1].lower()
    if suffix not in LOCAL_SUFFIXES:
        raise EvalError(f"{path}: unknown file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}")
    if not os.path.isfile(path):
        raise EvalError(f"benchmark file {path} does not exist")
    if grader not in GRADERS:
        raise EvalError(f"unknown grader {grader!r}; use one of {GRADERS}")
    datasets.disable_progress_bars()
    rows = datasets.load_dataset(LOCAL_SUFFIXES[suffix], data_files=path, split="train")
    return _rows_to_problems(rows, problem_key, answer_key, grader, path)


def load_benchmark(name: str) -> list[Problem]:
    """A benchmark by name (``BENCHMARKS``), from the hub or the local datasets cache.

    Offline and not cached, it raises one line naming the fixes: run once online (the cache
    then serves offline runs, e.g. with HF_HUB_OFFLINE=1), or pass a local file.
    """
    import datasets

    if name not in BENCHMARKS:
        raise EvalError(f"unknown benchmark {name!r}; use one of {', '.join(BENCHMARKS)} or a .jsonl/.parquet file")
    benchmark = BENCHMARKS[name]
    problems = []
    datasets.disable_progress_bars()
    for source in benchmark.sources:
        try:
            rows = datasets.load_dataset(
                source.path, source.config, split=source.split, data_files=source.data_files
            )
        except Exception as error:  # noqa: BLE001 -- offline, not cached, renamed upstream ...
            raise EvalError(
                f"benchmark {name!r} ({source.path}) could not be loaded "
                f"({type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}); "
                "run once with internet access to cache it, or pass a local .jsonl/.parquet file "
                "with --problem-key/--answer-key"
            ) from None
        if source.level is not None:
            rows = rows.filter(lambda row: str(row["level"]).removeprefix("Level ") == str(source.level))
        problems += _rows_to_problems(rows, source.problem_key, source.answer_key, benchmark.grader, source.path)
    if benchmark.paper_size and len(problems) != benchmark.paper_size:
        print(f"[evaluate] note: {name} has {len(problems)} problems here, {benchmark.paper_size} in the paper",
              file=sys.stderr)
    return problems


def resolve_benchmarks(spec: str, problem_key: str = "problem", answer_key: str = "answer",
                       grader: str = "math") -> dict[str, tuple[str, list[Problem]]]:
    """``aime,amc23,path/to/mine.jsonl`` -> {name: (source, problems)}; files are named by stem."""
    resolved = {}
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        if os.path.splitext(entry)[1].lower() in LOCAL_SUFFIXES:
            name = os.path.splitext(os.path.basename(entry))[0]
            resolved[name] = (os.path.abspath(entry), load_local_benchmark(entry, problem_key, answer_key, grader))
        else:
            resolved[entry] = ("hub:" + ",".join(s.path for s in BENCHMARKS.get(entry, Benchmark(())).sources),
                               load_benchmark(entry))
        if not resolved[list(resolved)[-1]][1]:
            raise EvalError(f"benchmark {entry!r} has no problems")
    if not resolved:
        raise EvalError("no benchmarks given; pass e.g. --benchmarks aime,amc23,math500-l5")
    return resolved


def problems_fingerprint(problems: Sequence[Problem]) -> str:
    """sha256 of the problems, answers and graders (a resumed run must see the same ones)."""
    payload = json.dumps([dataclasses.astuple(p) for p in problems], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# 4. Prompts and the model
# --------------------------------------------------------------------------------------------


def build_prompt_ids(tokenizer, problem: str) -> list[int]:
    """The chat template applied once: the paper's system prompt (App. E.4), the problem as the
    user message, the assistant turn opened."""
    from sage import SYSTEM_PROMPT

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_identity(model_path: str, adapter_path: str | None = None) -> dict:
    """What was evaluated: paths, the config's name and architectures, and a fingerprint.

    The fingerprint hashes config.json, the names and sizes of the weight files (not their
    bytes: a 7B model would take a minute) and the full bytes of the adapter's files.
    """
    identity = {"path": os.path.abspath(model_path) if os.path.isdir(model_path) else model_path,
                "adapter": os.path.abspath(adapter_path) if adapter_path else None}
    digest = hashlib.sha256()
    config_path = os.path.join(model_path, "config.json")
    if os.path.isfile(config_path):
        with open(config_path, "rb") as handle:
            config_bytes = handle.read()
        digest.update(config_bytes)
        config = json.loads(config_bytes)
        identity["name_or_path"] = config.get("_name_or_path") or None
        identity["architectures"] = config.get("architectures")
        for name in sorted(os.listdir(model_path)):
            if name.endswith((".safetensors", ".bin", ".pt")):
                digest.update(f"{name}:{os.path.getsize(os.path.join(model_path, name))}".encode())
    else:
        digest.update(model_path.encode())
    if adapter_path:
        if not os.path.isfile(os.path.join(adapter_path, "adapter_config.json")):
            raise EvalError(f"--adapter {adapter_path} is not a peft adapter directory (no adapter_config.json)")
        for name in sorted(os.listdir(adapter_path)):
            if name.startswith("adapter_"):
                digest.update(f"{name}:{_sha256_file(os.path.join(adapter_path, name))}".encode())
    identity["fingerprint"] = digest.hexdigest()
    return identity


def load_merged_model(model_path: str, adapter_path: str, dtype: str = "auto"):
    """The base model with a peft LoRA adapter merged into its weights, in memory (no copy on
    disk); the engine then takes these weights through ``sync_weights``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return PeftModel.from_pretrained(base, adapter_path).merge_and_unload().eval()


# --------------------------------------------------------------------------------------------
# 5. Evaluation: sample n per prompt per seed, grade in the pool, count, pass@k
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSampling:
    """Sampling for evaluation: the paper's public eval config (SPEC section 6) by default."""

    temperature: float = 0.3
    top_p: float = 0.95
    top_k: int = -1
    min_p: float = 0.01
    max_tokens: int = 1536


def sampling_config(sampling: EvalSampling, n: int, seed: int):
    """rollout.SamplingConfig for one seed; its checks become one-line errors here."""
    from rollout import SamplingConfig

    try:
        return SamplingConfig(n=n, seed=seed, **dataclasses.asdict(sampling))
    except ValueError as error:
        raise EvalError(str(error)) from None


@dataclass
class SeedSamples:
    """One seed's samples: per problem, per sample."""

    correct: list[list[bool]]
    texts: list[list[str]]
    token_ids: list[list[list[int]]]
    finish_reasons: list[list[str]]
    logprob_sums: list[list[float]]
    timed_out: list[list[bool]]  # graded wrong because grading ran past the per-item timeout
    generate_s: float
    grade_s: float

    @property
    def grading_timeouts(self) -> int:
        return sum(map(sum, self.timed_out))

    def seed_entry(self, n: int, ks: Sequence[int], span: slice = slice(None)) -> dict:
        """The results-file entry of one benchmark (the problems in ``span``) for this seed."""
        correct, reasons = self.correct[span], self.finish_reasons[span]
        lengths = [len(ids) for row in self.token_ids[span] for ids in row]
        return {
            "correct": [sum(row) for row in correct],
            **pass_at_k_of_counts([sum(row) for row in correct], n, ks),
            "grading_timeouts": sum(map(sum, self.timed_out[span])),
            "truncated_fraction": sum(r == "length" for row in reasons for r in row) / max(1, len(lengths)),
            "mean_completion_tokens": sum(lengths) / max(1, len(lengths)),
        }


def generate_and_grade(
    engine,
    prompts: Sequence[list[int]],
    problems: Sequence[Problem],
    *,
    n: int,
    seed: int,
    sampling: EvalSampling = EvalSampling(),
    pool: GradingPool | None = None,
    progress: bool = True,
) -> SeedSamples:
    """n samples per prompt in one seeded engine call, then pooled grading.

    One call, not several: the engine derives each prompt's seed from ``seed`` and the prompt's
    position in the call, so the same call reproduces the same samples.
    """
    if len(prompts) != len(problems):
        raise EvalError(f"{len(prompts)} prompts for {len(problems)} problems")
    started = time.perf_counter()
    outputs = engine.generate(list(prompts), sampling_config(sampling, n, seed))
    generate_s = time.perf_counter() - started
    texts = [[c.text for c in row] for row in outputs]
    pool = pool or default_pool()
    started = time.perf_counter()
    flat = pool.grade(
        [text for row in texts for text in row],
        [p.answer for p, row in zip(problems, texts) for _ in row],
        [p.grader for p, row in zip(problems, texts) for _ in row],
        progress=progress,
    )
    grade_s = time.perf_counter() - started
    timed_out_flat = [False] * len(flat)
    for index in pool.last_timeouts:
        timed_out_flat[index] = True
    correct, timed_out, offset = [], [], 0
    for row in texts:
        correct.append(flat[offset : offset + len(row)])
        timed_out.append(timed_out_flat[offset : offset + len(row)])
        offset += len(row)
    return SeedSamples(
        correct=correct,
        timed_out=timed_out,
        texts=texts,
        token_ids=[[list(c.token_ids) for c in row] for row in outputs],
        finish_reasons=[[c.finish_reason for c in row] for row in outputs],
        logprob_sums=[[float(sum(c.logprobs)) for c in row] for row in outputs],
        generate_s=generate_s,
        grade_s=grade_s,
    )


def evaluate_problems(
    engine,
    tokenizer,
    problems: Sequence[Problem],
    n: int,
    seeds: Sequence[int] = (0,),
    sampling: EvalSampling = EvalSampling(),
    ks: Sequence[int] | None = None,
    pool: GradingPool | None = None,
    progress: bool = True,
) -> dict:
    """pass@k of a rollout engine on a list of problems: the dict the CLI writes per benchmark.

    Returns {"num_problems", "ks", "seeds": {seed: {"correct": [c per problem], "pass_at_k":
    {k: value}, "pass_at_k_stderr": {k: se}, ...}}, "pass_at_k": {k: {mean, std, stderr}}}.
    """
    from tqdm import tqdm

    ks = list(ks or ks_up_to(n))
    prompts = [build_prompt_ids(tokenizer, p.problem) for p in problems]
    seeds_out = {}
    for seed in tqdm(list(seeds), desc="seeds", disable=not progress):
        samples = generate_and_grade(engine, prompts, problems, n=n, seed=seed, sampling=sampling,
                                     pool=pool, progress=progress)
        seeds_out[str(seed)] = samples.seed_entry(n, ks)
    return {
        "num_problems": len(problems),
        "ks": ks,
        "seeds": seeds_out,
        "pass_at_k": summarize_seeds(list(seeds_out.values()), ks),
    }


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w"):
    """Open a temporary file next to ``path``; on success rename it over ``path`` (readers never
    see a half-written file), with the permissions a plain ``open`` would have given."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(mode, dir=directory, prefix=".tmp-", suffix=os.path.splitext(path)[1],
                                         delete=False)
    try:
        with handle:
            yield handle
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise


def write_json_atomic(path: str, payload) -> None:
    """Write JSON atomically (``atomic_output``)."""
    with atomic_output(path) as handle:
        json.dump(payload, handle, indent=1)
        handle.write("\n")


def write_jsonl_atomic(path: str, rows) -> None:
    """Write one JSON object per line, atomically."""
    with atomic_output(path) as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def recompute_summaries(results: dict) -> dict:
    """Per-benchmark mean/std/stderr over the seeds present, and the benchmark average."""
    ks = results["ks"]
    for entry in results["benchmarks"].values():
        seeds = [entry["seeds"][s] for s in sorted(entry["seeds"], key=int)]
        entry["pass_at_k"] = summarize_seeds(seeds, ks) if seeds else {}
    complete = [e["pass_at_k"] for e in results["benchmarks"].values() if e["pass_at_k"]]
    results["average"] = {
        str(k): sum(summary[str(k)]["mean"] for summary in complete) / len(complete) for k in ks
    } if complete else {}
    return results


def _check_resumable(existing: dict, fresh: dict, out: str) -> None:
    for key in ("model", "sampling", "ks"):
        if existing.get(key) != fresh[key]:
            raise EvalError(
                f"{out} holds results for a different {key} ({existing.get(key)} != {fresh[key]}); "
                "pass another --out or delete the file"
            )
    for name, entry in fresh["benchmarks"].items():
        old = existing.get("benchmarks", {}).get(name)
        if old and old["problems_sha256"] != entry["problems_sha256"]:
            raise EvalError(f"{out}: benchmark {name!r} changed since the last run; pass another --out")


def run_evaluation(args: "EvalArgs", make_engine=None) -> dict:
    """The CLI's work: load benchmarks, skip finished (benchmark, seed) pairs of an existing
    --out, sample and grade the rest (one engine call per seed over all benchmarks), write the
    results file atomically after every seed. Returns the results dict."""
    from tqdm import tqdm

    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    if args.n < 1 or not seeds:
        raise EvalError("--n must be >= 1 and --seeds must name at least one seed")
    benchmarks = resolve_benchmarks(args.benchmarks, args.problem_key, args.answer_key, args.grader)
    if args.limit:
        benchmarks = {name: (source, problems[: args.limit]) for name, (source, problems) in benchmarks.items()}
    sampling = EvalSampling(args.temperature, args.top_p, args.top_k, args.min_p, args.max_tokens)
    sampling_config(sampling, args.n, seeds[0])  # bad settings fail now, not after loading a model
    ks = ks_up_to(args.n)
    results = {
        "format": "sage-rl/evaluate/1",
        "model": model_identity(args.model, args.adapter),
        "sampling": {"n": args.n, **dataclasses.asdict(sampling), "max_model_len": args.max_model_len,
                     "backend": args.backend, "dtype": args.dtype},
        "ks": ks,
        "benchmarks": {
            name: {"source": source, "num_problems": len(problems), "problems_sha256": problems_fingerprint(problems),
                   "seeds": {}}
            for name, (source, problems) in benchmarks.items()
        },
        "runs": [],
    }
    if os.path.exists(args.out):
        with open(args.out) as handle:
            existing = json.load(handle)
        _check_resumable(existing, results, args.out)
        for name, entry in existing["benchmarks"].items():
            if name in results["benchmarks"]:
                results["benchmarks"][name]["seeds"] = entry["seeds"]
            else:
                results["benchmarks"][name] = entry  # keep what an earlier run measured
        results["runs"] = existing.get("runs", [])
    todo = {seed: [name for name in benchmarks if str(seed) not in results["benchmarks"][name]["seeds"]]
            for seed in seeds}
    todo = {seed: names for seed, names in todo.items() if names}
    skipped = [seed for seed in seeds if seed not in todo]
    if skipped:
        print(f"[evaluate] {args.out}: seeds {skipped} already finished, skipped", file=sys.stderr)
    if todo:
        engine, tokenizer = _start_engine(args, make_engine)
        pool = GradingPool(num_workers=args.grading_workers, timeout_s=args.grade_timeout)
        prompts = {name: [build_prompt_ids(tokenizer, p.problem) for p in problems]
                   for name, (_, problems) in benchmarks.items()}
        try:
            for seed, names in tqdm(todo.items(), desc="seeds", disable=not args.progress):
                all_problems = [p for name in names for p in benchmarks[name][1]]
                all_prompts = [ids for name in names for ids in prompts[name]]
                samples = generate_and_grade(engine, all_prompts, all_problems, n=args.n, seed=seed,
                                             sampling=sampling, pool=pool, progress=args.progress)
                start = 0
                for name in names:
                    span = slice(start, start + len(benchmarks[name][1]))
                    start = span.stop
                    entry = samples.seed_entry(args.n, ks, span)
                    results["benchmarks"][name]["seeds"][str(seed)] = entry
                    if args.save_completions:
                        _save_completions(args.save_completions, name, seed, benchmarks[name][1],
                                          prompts[name], samples, span)
                results["runs"].append({
                    "seed": seed, "benchmarks": names, "generate_s": round(samples.generate_s, 3),
                    "grade_s": round(samples.grade_s, 3), "num_samples": args.n * len(all_problems),
                    "grading_timeouts": samples.grading_timeouts, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                })
                write_json_atomic(args.out, recompute_summaries(results))
        finally:
            pool.close()
    recompute_summaries(results)
    write_json_atomic(args.out, results)
    return results


def _start_engine(args: "EvalArgs", make_engine=None):
    """The rollout engine (vLLM by default) on the model, with the adapter merged in if given:
    the engine loads the base weights from disk, then takes the merged ones in place.

    No trainer shares the GPU here, so the engine takes most of it (``--gpu-memory-utilization``
    defaults to 0.9 on CUDA) and never sleeps.
    """
    import rollout
    import torch

    fraction = args.gpu_memory_utilization
    if fraction is None and torch.cuda.is_available():
        fraction = rollout.CUDA_STANDALONE_MEMORY_FRACTION
    merged = load_merged_model(args.model, args.adapter, args.dtype) if args.adapter else None
    try:
        engine = (make_engine or rollout.make_engine)(
            args.model, args.backend, max_model_len=args.max_model_len, dtype=args.dtype,
            gpu_memory_utilization=fraction, seed=0, model=merged,
            **({"enable_sleep_mode": False} if args.backend == "vllm" else {}),
        )
    except rollout.RolloutError as error:
        raise EvalError(str(error)) from None
    return engine, engine.tokenizer


def _save_completions(directory: str, name: str, seed: int, problems, prompts, samples: SeedSamples,
                      span: slice) -> None:
    """One JSONL per (benchmark, seed): a row per problem with its samples (for the analyses)."""
    rows = []
    for index, problem, prompt_ids, i in zip(range(len(problems)), problems, prompts, range(span.start, span.stop)):
        rows.append({
            "benchmark": name, "seed": seed, "problem_index": index, "problem": problem.problem,
            "answer": problem.answer, "grader": problem.grader, "prompt_ids": prompt_ids,
            "completions": [
                {"text": text, "token_ids": ids, "finish_reason": reason, "correct": ok, "logprob": lp}
                for text, ids, reason, ok, lp in zip(samples.texts[i], samples.token_ids[i],
                                                     samples.finish_reasons[i], samples.correct[i],
                                                     samples.logprob_sums[i])
            ],
        })
    write_jsonl_atomic(os.path.join(directory, f"{name}.seed{seed}.jsonl"), rows)


# --------------------------------------------------------------------------------------------
# 6. The paper's analyses: reasoning patterns (Eq. 13) and perplexity under a base model (Eq. 39)
# --------------------------------------------------------------------------------------------

# Keyword detectors of App. G, matched case-insensitively (the paper's examples, and their
# obvious inflections; symbolic variable introduction is "let" followed by a one-letter name).
REASONING_PATTERNS = {
    "constraint_setup": re.compile(r"\blet\s+(?:\$|\\\(\s*)?[a-z]\b|\bdenot(?:e|es|ed|ing)\b", re.IGNORECASE),
    "structural_reasoning": re.compile(r"\b(?:of|in) the form\b|\bdecompos(?:e|es|ed|ing|ition)\b", re.IGNORECASE),
    "proof_by_contradiction": re.compile(
        r"\b(?:for|by) (?:the sake of )?contradiction\b|\b(?:leads?|leading) to a contradiction\b", re.IGNORECASE
    ),
}


def pattern_frequencies(correct_solutions: Sequence[Sequence[str]]) -> dict[str, float]:
    """Eq. 13: F = (1/N) sum_x (1/|C_x|) sum_{y in C_x} 1[pattern(y)], over correct solutions.

    ``correct_solutions[x]`` is C_x, the correct solutions of problem x; problems with none are
    left out of N (1/|C_x| is undefined for them).

    >>> pattern_frequencies([["Let x be the side.", "Direct count."], ["Assume for contradiction ..."], []])
    {'constraint_setup': 0.25, 'structural_reasoning': 0.0, 'proof_by_contradiction': 0.5, 'num_problems': 2}
    """
    solved = [solutions for solutions in correct_solutions if solutions]
    out = {}
    for name, detector in REASONING_PATTERNS.items():
        per_problem = [sum(bool(detector.search(y)) for y in solutions) / len(solutions) for solutions in solved]
        out[name] = sum(per_problem) / len(per_problem) if per_problem else 0.0
    out["num_problems"] = len(solved)
    return out


def _split_label(entry: str) -> tuple[str, str]:
    """``LABEL=PATH`` -> (LABEL, PATH); a plain existing path -> ("", PATH)."""
    label, path = ("", entry) if os.path.isfile(entry) or "=" not in entry else entry.split("=", 1)
    if not os.path.isfile(path):
        raise EvalError(f"{path} does not exist")
    return label, path


def _labelled(entries: Sequence[str]) -> dict[str, list[str]]:
    """``[LABEL=]PATH`` arguments -> {label: [paths]}; the label defaults to the file's parent
    directory name (several files under one label are merged, e.g. several seeds)."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        label, path = _split_label(entry)
        out.setdefault(label or os.path.basename(os.path.dirname(os.path.abspath(path))), []).append(path)
    return out


def read_completions(paths: Sequence[str]) -> dict[tuple[str, int], dict]:
    """Rows of ``--save-completions`` files, merged over seeds: {(benchmark, problem_index): row}
    with every seed's completions in ``row["completions"]``."""
    merged: dict[tuple[str, int], dict] = {}
    for path in paths:
        with open(path) as handle:
            for line in handle:
                row = json.loads(line)
                key = (row["benchmark"], row["problem_index"])
                if key in merged:
                    merged[key]["completions"] += row["completions"]
                else:
                    merged[key] = row
    return merged


def completion_perplexities(model, prompts: Sequence[list[int]], completions: Sequence[list[int]],
                            batch_size: int = 8, progress: bool = True) -> list[float]:
    """Eq. 39: PPL(y | x) = exp(-(1/|y|) sum_t log pi_base(y_t | x, y_<t)) for each pair.

    The forward pass is the trainer's (sage.collate + sage.completion_logps: left-padded prompts
    with true positions, only completion positions projected to the vocabulary).
    """
    import torch
    from tqdm import tqdm

    from sage import collate, completion_logps

    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(completions[i]))
    out = [math.nan] * len(prompts)
    for start in tqdm(range(0, len(order), batch_size), desc="perplexity", disable=not progress):
        batch_rows = order[start : start + batch_size]
        batch = collate([list(prompts[i]) for i in batch_rows], [list(completions[i]) for i in batch_rows], 0, device)
        with torch.no_grad():
            logps, _ = completion_logps(model, batch, 1.0, 0.0)  # [B, C]
        mask = batch["completion_mask"]
        mean_logps = (logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        for row, i in enumerate(batch_rows):
            out[i] = math.exp(-mean_logps[row].item())
    return out


# --------------------------------------------------------------------------------------------
# 7. Plots
# --------------------------------------------------------------------------------------------


def plot_results(entries: Sequence[str], out: str) -> None:
    """The paper's Figure 3 from results files, ``[LABEL=]PATH`` each (the label defaults to
    the model's name, else its adapter's or its directory's name)."""
    labelled = {}
    for entry in entries:
        label, path = _split_label(entry)
        with open(path) as handle:
            results = json.load(handle)
        model = results.get("model", {})
        label = label or model.get("name") or os.path.basename(str(model.get("adapter") or model.get("path") or path).rstrip("/"))
        labelled[label if label not in labelled else f"{label} ({path})"] = results
    plot_pass_at_k(labelled, out)


def plot_pass_at_k(labelled_results: dict[str, dict], out: str) -> None:
    """pass@k over log2 k, one panel per benchmark, one line per model (mean +- std over
    seeds as a band), as in the paper's Figure 3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for r in labelled_results.values() for name in r["benchmarks"]))
    names = [name for name in names if any(r["benchmarks"].get(name, {}).get("pass_at_k") for r in labelled_results.values())]
    if not names:
        raise EvalError("the results files hold no finished benchmark to plot")
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names):
        for label, results in labelled_results.items():
            summary = results["benchmarks"].get(name, {}).get("pass_at_k")
            if not summary:
                continue
            ks = sorted(int(k) for k in summary)
            x = [math.log2(k) for k in ks]
            mean = [summary[str(k)]["mean"] for k in ks]
            std = [summary[str(k)]["std"] for k in ks]
            (line,) = axis.plot(x, mean, marker="o", markersize=3, label=label)
            axis.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                              color=line.get_color(), alpha=0.2)
        axis.set_title(name)
        axis.set_xlabel("log2 k")
        axis.set_ylabel("pass@k")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    _save_figure(fig, out)
    plt.close(fig)


def plot_perplexity_histogram(values: dict[str, dict[str, list[float]]], out: str) -> None:
    """Distributions of Eq. 39's perplexity per model (one panel per problem group), as in the
    paper's Figure 7. ``values[panel][label]`` holds the perplexities."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(values), figsize=(4.5 * len(values), 3.6), squeeze=False)
    for axis, (panel, by_label) in zip(axes[0], values.items()):
        finite = [v for vs in by_label.values() for v in vs if math.isfinite(v)]
        bins = 30 if not finite else [min(finite) + i * (max(finite) - min(finite) + 1e-9) / 30 for i in range(31)]
        for label, ppl in by_label.items():
            axis.hist([v for v in ppl if math.isfinite(v)], bins=bins, histtype="step", density=True,
                      linewidth=1.5, label=f"{label} (n={len(ppl)})")
        axis.set_title(panel)
        axis.set_xlabel("perplexity under the base model")
        axis.set_ylabel("density")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    _save_figure(fig, out)
    plt.close(fig)


def _save_figure(fig, out: str) -> None:
    with atomic_output(out, "wb") as handle:
        fig.savefig(handle, format=(os.path.splitext(out)[1] or ".png").lstrip("."), dpi=150)


# --------------------------------------------------------------------------------------------
# 8. Command line
# --------------------------------------------------------------------------------------------


def _arg(default=dataclasses.MISSING, help: str = "", **extra):
    """A dataclass field that is also a command-line option (its help text is the docstring)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass(kw_only=True)
class EvalArgs:
    """python evaluate.py --model PATH [--adapter PATH] --benchmarks aime,amc23,math500-l5 --n 256 ..."""

    model: str = _arg(help="model directory (or hub name) the engine loads")
    adapter: str | None = _arg(None, "peft LoRA adapter directory, merged into the weights in memory")
    benchmarks: str = _arg("aime,amc23,math500-l5",
                           f"comma-separated names ({', '.join(BENCHMARKS)}) or .jsonl/.parquet files")
    out: str = _arg("results.json", "results file (written atomically; re-running skips finished seeds)")
    n: int = _arg(256, "samples per problem and seed")
    seeds: str = _arg("0,1,2", "comma-separated seeds: one engine call each")
    temperature: float = _arg(0.3, "sampling temperature (paper's eval config)")
    top_p: float = _arg(0.95, "nucleus sampling threshold")
    top_k: int = _arg(-1, "top-k (-1: off)")
    min_p: float = _arg(0.01, "min-p (paper's config)")
    max_tokens: int = _arg(1536, "max completion tokens")
    max_model_len: int = _arg(2048, "engine context length (prompt + completion; paper: 2048)")
    problem_key: str = _arg("problem", "column holding the problem, for local files")
    answer_key: str = _arg("answer", "column holding the reference answer, for local files")
    grader: str = _arg("math", "grader for local files", choices=GRADERS)
    limit: int | None = _arg(None, "evaluate only the first LIMIT problems of each benchmark")
    backend: str = _arg("vllm", "rollout engine (hf: transformers generate, slow)", choices=("vllm", "hf"))
    dtype: str = _arg("auto", "engine dtype (auto, bfloat16, float32)")
    gpu_memory_utilization: float | None = _arg(None, "vLLM memory fraction (default: 0.9 on CUDA, the engine "
                                                "runs alone; on CPU the share of RAM for the KV cache, 0.05)")
    grade_timeout: float = _arg(GRADE_TIMEOUT_S, "per-item grading timeout in seconds")
    grading_workers: int | None = _arg(None, "grading processes (default: one per CPU core)")
    save_completions: str | None = _arg(None, "directory for per-(benchmark, seed) JSONL samples")
    progress: bool = _arg(True, "progress bars")


@dataclass(kw_only=True)
class PlotArgs:
    """python evaluate.py plot [LABEL=]A.json [LABEL=]B.json --out passk.png"""

    results: list[str] = _arg([], "results files of evaluate.py, optionally LABEL=PATH", positional=True)
    out: str = _arg("passk.png", "output image")


@dataclass(kw_only=True)
class PatternsArgs:
    """python evaluate.py patterns [LABEL=]DIR/aime.seed0.jsonl ... (files from --save-completions)"""

    completions: list[str] = _arg([], "--save-completions files, optionally LABEL=PATH", positional=True)
    out: str | None = _arg(None, "also write the frequencies as JSON here")


@dataclass(kw_only=True)
class PerplexityArgs:
    """python evaluate.py perplexity --base-model PATH [LABEL=]FILE.jsonl ... --out ppl.png

    The files' token ids are scored as they are, so the sampling models must share the base
    model's tokenizer (as the paper's fine-tunes of Qwen2.5-Math-7B do).
    """

    completions: list[str] = _arg([], "--save-completions files, optionally LABEL=PATH", positional=True)
    base_model: str = _arg(help="the model that scores the completions (pi_base of Eq. 39)")
    out: str = _arg("perplexity.png", "histogram image; the values go to the same name with .json")
    problems: str | None = _arg(None, "BENCHMARK:INDEX,... problems to plot one panel each (default: all pooled)")
    max_samples: int = _arg(64, "completions scored per problem and model (paper: 64)")
    only_correct: bool = _arg(False, "score correct completions only")
    batch_size: int = _arg(8, "sequences per forward pass")
    dtype: str = _arg("auto", "dtype of the base model")
    device: str | None = _arg(None, "torch device (default: cuda if available, else cpu)")
    progress: bool = _arg(True, "progress bars")


def _parse(kind, argv: Sequence[str], prog: str):
    parser = argparse.ArgumentParser(prog=prog, description=kind.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for item in dataclasses.fields(kind):
        flag = "--" + item.name.replace("_", "-")
        meta = dict(item.metadata)
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        base = str(item.type).replace(" | None", "")
        if meta.get("positional"):
            parser.add_argument(item.name, nargs="+", help=meta["help"])
        elif base == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=item.default, help=meta["help"])
        else:
            kind_of = {"int": int, "float": float}.get(base, str)
            parser.add_argument(flag, dest=item.name, type=kind_of, required=required, choices=meta.get("choices"),
                                default=None if required else item.default, help=meta["help"])
    return kind(**vars(parser.parse_args(list(argv))))


def _run_plot(args: PlotArgs) -> None:
    plot_results(args.results, args.out)
    print(f"[evaluate] wrote {args.out}", file=sys.stderr)


def _run_patterns(args: PatternsArgs) -> dict:
    table = {}
    for label, paths in _labelled(args.completions).items():
        rows = read_completions(paths)
        solutions = [[c["text"] for c in row["completions"] if c["correct"]] for row in rows.values()]
        table[label] = pattern_frequencies(solutions)
    names = list(REASONING_PATTERNS)
    print("model".ljust(24) + "".join(name.rjust(24) for name in names) + "problems".rjust(10))
    for label, freqs in table.items():
        print(label[:23].ljust(24) + "".join(f"{freqs[name]:24.3f}" for name in names)
              + str(freqs["num_problems"]).rjust(10))
    if args.out:
        write_json_atomic(args.out, table)
    return table


def _run_perplexity(args: PerplexityArgs) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    wanted = None
    if args.problems:
        wanted = []
        for item in args.problems.split(","):
            benchmark, _, index = item.rpartition(":")
            if not benchmark or not index.isdigit():
                raise EvalError(f"--problems entries look like aime:3, got {item!r}")
            wanted.append((benchmark, int(index)))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.base_model, dtype=torch_dtype).to(device).eval()
    values: dict[str, dict[str, list[float]]] = {}
    for label, paths in _labelled(args.completions).items():
        rows = read_completions(paths)
        keys = wanted if wanted is not None else sorted(rows)
        for key in keys:
            if key not in rows:
                raise EvalError(f"{label}: no problem {key[0]}:{key[1]} in {', '.join(paths)}")
            row = rows[key]
            chosen = [c for c in row["completions"] if c["correct"] or not args.only_correct][: args.max_samples]
            ppl = completion_perplexities(model, [row["prompt_ids"]] * len(chosen), [c["token_ids"] for c in chosen],
                                          batch_size=args.batch_size, progress=args.progress)
            panel = f"{key[0]}:{key[1]}" if wanted is not None else "all problems"
            values.setdefault(panel, {}).setdefault(label, []).extend(ppl)
    if not any(values.values()):
        raise EvalError("no completions to score (check --only-correct and the files)")
    plot_perplexity_histogram(values, args.out)
    write_json_atomic(os.path.splitext(args.out)[0] + ".json", values)
    print(f"[evaluate] wrote {args.out}", file=sys.stderr)
    return values


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plot": (PlotArgs, _run_plot), "patterns": (PatternsArgs, _run_patterns),
                "perplexity": (PerplexityArgs, _run_perplexity)}
    try:
        if argv and argv[0] in commands:
            kind, run = commands[argv[0]]
            run(_parse(kind, argv[1:], f"evaluate.py {argv[0]}"))
        else:
            args = _parse(EvalArgs, argv, "evaluate.py")
            results = run_evaluation(args)
            for name, entry in results["benchmarks"].items():
                summary = entry.get("pass_at_k") or {}
                ks = [k for k in ("1", str(max(results["ks"]))) if k in summary]
                shown = ", ".join(f"pass@{k} {summary[k]['mean']:.3f} +- {summary[k]['std']:.3f}" for k in ks)
                print(f"{name}: {shown}")
            print(f"[evaluate] wrote {args.out}", file=sys.stderr)
    except EvalError as error:
        print(f"evaluate.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
