"""Grading in worker processes with a hard per-item timeout: the machinery behind the reward.

Math-Verify's parser can run for hours on an adversarial answer (``9^{9^{9}}`` has 370 million
digits) and its own timeouts rely on signals, which work only in a main thread. A trainer that
grades 64 completions per step, or an evaluation that grades 60,000, cannot stall on one item.
So grading runs in a pool of fresh interpreters, each item under a deadline: an item that runs
past it has its worker killed, is graded wrong and counted, and a new worker takes the rest of
the queue. The pool knows nothing about what it grades: ``grading.py`` gives it its function.
"""

from __future__ import annotations

import importlib
import os
import resource
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

DEFAULT_TIMEOUT_S = 5.0  # per item: generous (a normal answer takes 1 to 20 ms)
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
    function = getattr(importlib.import_module(module), name)  # the import is most of a start-up
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
        self, target: str, num_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ):
        self.target, self.timeout_s = target, timeout_s
        self.num_workers = num_workers or min(32, len(os.sched_getaffinity(0)))
        self.stats = {"timeouts": 0, "crashes": 0}
        self.last_timeouts: list[int] = []  # indices of the last call's items that timed out
        self._workers: list[_Worker] = []

    def _start_worker(self) -> _Worker:
        to_worker, from_worker = os.pipe(), os.pipe()
        code = (
            f"import sys; sys.path.insert(0, {REPOSITORY!r}); from task import grading_pool; "
            f"grading_pool._worker_main({self.target!r}, {to_worker[0]}, {from_worker[1]})"
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
