"""Grading in worker processes with a hard per-item timeout: the machinery behind the reward.

Math-Verify's parser can run for hours on an adversarial answer (``9^{9^{9}}`` has 370 million
digits) and its own timeouts rely on signals, which work only in a main thread. A trainer that
grades 64 completions per step, or an evaluation that grades 60,000, cannot stall on one item.
So grading runs in a pool of fresh interpreters, each item under a deadline: an item that runs
past it has its worker killed, is graded wrong and counted, and a new worker takes the rest of
the queue. The pool knows nothing about what it grades: ``task.py`` gives it its function.
"""

from __future__ import annotations

import importlib
import os
import resource
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

DEFAULT_TIMEOUT_S = 5.0  # per item: generous (a normal answer takes 1 to 20 ms)
WORKER_MEMORY_LIMIT = 4 * 2**30  # address-space cap of a worker: a blow-up becomes a MemoryError


def _worker_main(target: str, read_fd: int, write_fd: int, memory_limit: int | None) -> None:
    """A grading worker (its own interpreter): imports ``target`` ("module:function"), receives
    chunks of (index, args) and sends back (index, bool(function(*args))) after each item, so the
    parent always knows which item is running."""
    if memory_limit:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_limit if hard == resource.RLIM_INFINITY else min(memory_limit, hard)
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
        if chunk is None:
            return
        for index, args in chunk:
            try:
                correct = bool(function(*args))
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
    """Worker processes that grade items with a hard per-item timeout.

    ``target`` names the grading function, "module:function", called as ``function(*item)`` and
    returning a bool. Each worker gets a chunk of items and answers item by item; an item that
    runs past ``timeout_s`` gets its worker killed (SIGKILL: it works even inside C code), is
    graded wrong and counted in ``stats["timeouts"]``, and the rest of its chunk goes back in the
    queue. Workers are fresh interpreters (``python -c "from machinery import grading_pool;
    ..."``) talking over pipes, so none inherits the caller's threads, CUDA context or vLLM
    engine, and none re-imports the caller's ``__main__`` (as multiprocessing's spawn and
    forkserver would). A worker starts in about a second, which only a timeout costs again. Reuse
    one pool across calls (the trainer grades every step); ``close()`` ends it.
    """

    def __init__(
        self,
        target: str,
        num_workers: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_size: int = 16,
        memory_limit: int | None = WORKER_MEMORY_LIMIT,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if target.count(":") != 1:
            raise ValueError(f"target must be 'module:function', got {target!r}")
        self.target = target
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
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
        code = (
            f"import sys; sys.path.insert(0, {here!r}); from machinery import grading_pool; "
            f"grading_pool._worker_main({self.target!r}, {to_worker_r}, {from_worker_w}, "
            f"{self.memory_limit!r})"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=(to_worker_r, from_worker_w),
            stdin=subprocess.DEVNULL,
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

    def map(self, items: Sequence[tuple], progress: bool = False) -> list[bool]:
        """``function(*item)`` for each item, in input order; an item past the timeout, or whose
        worker crashed, is False."""
        items = [(index, tuple(args)) for index, args in enumerate(items)]
        if not items:
            return []
        with self._lock:
            if self._closed:
                raise ValueError("this GradingPool is closed; create a new one")
            while len(self._workers) < self.num_workers:
                self._workers.append(self._start_worker())
            # Chunks shrink for small batches so that every worker gets some.
            size = max(1, min(self.chunk_size, len(items) // (4 * self.num_workers)))
            queue = deque(items[i : i + size] for i in range(0, len(items), size))
            results: list[bool | None] = [None] * len(items)
            self.last_timeouts = []
            with tqdm(
                total=len(items), desc="grading", unit="item", disable=not progress, leave=False
            ) as bar:
                self._run(queue, items, results, bar)
            self.stats["graded"] += len(items)
        return [bool(r) for r in results]

    def _run(self, queue: deque, items: list, results: list, bar) -> None:
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
                    f"check that `import {self.target.split(':')[0]}` works in a fresh interpreter"
                )
            self._replace(worker)

        while remaining:
            for worker in list(self._workers):
                dispatch(worker)
            waiting = [worker for worker in self._workers if worker.pending or not worker.ready]
            if not waiting:
                raise RuntimeError(
                    f"grading stalled with {remaining} items left and no worker busy"
                )
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

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
