"""Pooled grading vs a serial loop, and the hard timeout on adversarial answers.

1. Speed: the same 2,000 completions (250 problems x 8 rollouts, a training step's shape scaled
   up) are graded once by a serial loop of ``grading.grade`` in this process and once by a
   ``GradingPool`` (one worker per core, at most 32), taking turns on blocks of 500 so that both
   meet the same background load. Both sides are warmed first on the same other completions
   (math-verify imported, its regexes and LaTeX parser caches built, the pool's workers
   started), so the timing is of grading alone; the pool's start-up is reported on its own.
   The completions follow the paper's format (App. E.4) with answers written in varied but
   equivalent forms, wrong answers, answers with no <SOLUTION> block, truncated and garbage
   completions.
2. Adversarial: answers that keep math-verify busy far past any sane budget (towers of powers,
   deep nesting) are mixed into normal ones and graded with a short per-item timeout. Each must
   come back False within its timeout (plus the worker's restart), be counted, and leave the
   normal items' grades unchanged.

Prints one JSON object: pooled_over_serial_speedup (goal >= 1.7 on 2 cores) and
adversarial_within_timeout (true), with the raw numbers. On a shared machine the speedup is
capped by the cores other processes leave free: ``free_cores_measured`` (how many cores as many
plain busy loops as workers get, right after the timing) and the run-queue wait fractions of
both sides say how much of the machine the run had; CPU seconds on both sides show the pool's
own overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from task import grading  # noqa: E402

# (reference, equivalent ways to write it, a wrong answer)
ANSWERS = [
    ("\\frac{1}{2}", ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac{1}{2}", "$\\frac12$"], "\\frac{1}{3}"),
    ("3\\sqrt{2}", ["3\\sqrt{2}", "\\sqrt{18}", "3 \\sqrt 2"], "2\\sqrt{3}"),
    ("(1, 2]", ["(1, 2]", "(1,2]"], "[1, 2)"),
    ("\\{1, 2, 3\\}", ["\\{1,2,3\\}", "\\{3, 2, 1\\}"], "\\{1, 2\\}"),
    ("[0, \\infty)", ["[0,\\infty)", "[0, \\infty)"], "(0, \\infty)"),
    ("\\frac{\\pi}{4}", ["\\frac{\\pi}{4}", "\\pi/4"], "\\frac{\\pi}{2}"),
    ("2x + 1", ["2x+1", "1 + 2x"], "2x - 1"),
    ("(3, -1)", ["(3, -1)", "(3,-1)"], "(-1, 3)"),
]
FILLER = [
    "We start from the given conditions and simplify step by step.",
    "Let $x$ denote the unknown, so that $x^2 - 5x + 6 = 0$ and hence $x \\in \\{2, 3\\}$.",
    "Substituting back, the constraint $a + b = 10$ gives $b = 10 - a$.",
    "Checking the boundary case $n = 0$ separately, the formula still holds.",
    "By symmetry the two halves contribute equally, which halves the work.",
    "The sum telescopes: $\\sum_{k=1}^{n} (k+1)^2 - k^2 = (n+1)^2 - 1$.",
]


def make_completions(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``count`` completions and references: 8 rollouts per problem, mixed quality."""
    rng = random.Random(seed)
    completions, references = [], []
    for problem in range(count // 8):
        kind = problem % (len(ANSWERS) + 4)
        if kind < len(ANSWERS):
            reference, forms, wrong = ANSWERS[kind]
        else:  # integer answers, as in AIME (a different one per problem)
            value = rng.randint(1, 999)
            reference, forms, wrong = (
                str(value),
                [str(value), f"{value}.0", f"\\boxed{{{value}}}"],
                str(value + 1),
            )
        for _ in range(8):
            working = " ".join(rng.choice(FILLER) for _ in range(rng.randint(2, 8)))
            roll = rng.random()
            if roll < 0.55:
                body = f"<SOLUTION> {rng.choice(forms)} </SOLUTION>"
            elif roll < 0.80:
                body = f"<SOLUTION> {wrong} </SOLUTION>"
            elif roll < 0.90:  # no block: math-verify reads the whole text
                body = f"So the final answer is $\\boxed{{{rng.choice(forms)}}}$."
            elif roll < 0.95:  # truncated before the answer
                body = ""
            else:  # garbage
                body = (
                    "<SOLUTION> "
                    + "".join(rng.choice("{}[]()$\\^_xyz0123") for _ in range(40))
                    + " </SOLUTION>"
                )
            completions.append(f"<start_working_out> {working} <end_working_out>{body}")
            references.append(reference)
    return completions, references


def runqueue_wait_s(pid: int | str = "self") -> float:
    """Seconds this process has waited for a CPU while runnable (Linux schedstat)."""
    with open(f"/proc/{pid}/schedstat") as handle:
        return int(handle.read().split()[1]) / 1e9


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes ``pids`` have used so far."""
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def free_cores(count: int, seconds: float = 2.0) -> float:
    """How many cores ``count`` busy-looping processes actually get here (a control for the
    speedup on a shared machine: on an idle one it equals ``count`` up to the core count)."""
    import subprocess

    loop = f"import time\nt = time.time()\nwhile time.time() - t < {seconds + 0.5}: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]
    before = [runqueue_wait_s(p.pid) for p in spinners]
    time.sleep(seconds)
    waited = [runqueue_wait_s(p.pid) - b for p, b in zip(spinners, before)]
    for spinner in spinners:
        spinner.wait()
    return sum(1.0 - w / seconds for w in waited)


ADVERSARIAL = [
    ("<SOLUTION> 9^{9^{9}} </SOLUTION>", "4"),
    ("<SOLUTION> 10^{10^{9}} + 1 </SOLUTION>", "4"),
    ("<SOLUTION> 2^{2^{2^{30}}} </SOLUTION>", "4"),
    ("<SOLUTION> $" + "(" * 3000 + "1" + ")" * 3000 + "$ </SOLUTION>", "1"),
    ("<SOLUTION> (10^{10^{8}})! </SOLUTION>", "4"),
    ("<SOLUTION> \\left\\{" + ",".join(map(str, range(3000))) + "\\right\\} </SOLUTION>", "4"),
]


def serial_vs_pooled(
    completions, references, warm_c, warm_r, workers: int | None, block: int
) -> dict:
    """Serial and pooled grading take turns on blocks of the same completions, so that both see the
    same background load (this machine may be shared); each side grades all of them exactly once."""
    started = time.perf_counter()
    pool = grading.grading_pool(num_workers=workers, timeout_s=30.0)
    grading.grade_batch(warm_c, warm_r, pool=pool)
    pool_startup_s = time.perf_counter() - started
    serial, pooled, serial_s, pooled_s = [], [], 0.0, 0.0
    serial_cpu_s = pooled_cpu_s = serial_wait_s = pooled_wait_s = 0.0
    pids = [worker.process.pid for worker in pool._workers]
    for start in range(0, len(completions), block):
        block_c, block_r = completions[start : start + block], references[start : start + block]
        started, cpu, wait = time.perf_counter(), time.process_time(), runqueue_wait_s()
        serial += [grading.grade(c, r) for c, r in zip(block_c, block_r)]
        serial_s += time.perf_counter() - started
        serial_cpu_s += time.process_time() - cpu
        serial_wait_s += runqueue_wait_s() - wait
        started, cpu = time.perf_counter(), cpu_seconds(pids) + time.process_time()
        wait = sum(map(runqueue_wait_s, pids))
        pooled += grading.grade_batch(block_c, block_r, pool=pool)
        pooled_s += time.perf_counter() - started
        pooled_cpu_s += cpu_seconds(pids) + time.process_time() - cpu
        pooled_wait_s += sum(map(runqueue_wait_s, pids)) - wait
    pool.close()
    return {
        "serial": serial,
        "pooled": pooled,
        "serial_s": serial_s,
        "pooled_s": pooled_s,
        "serial_cpu_s": serial_cpu_s,
        "pooled_cpu_s": pooled_cpu_s,
        "serial_wait_s": serial_wait_s,
        "pooled_wait_s": pooled_wait_s,
        "pool_startup_s": pool_startup_s,
        "num_workers": pool.num_workers,
    }


def adversarial_run(
    completions, references, warm_c, warm_r, workers: int | None, timeout: float
) -> dict:
    """Adversarial items among normal ones, with a short per-item timeout."""
    normal_c, normal_r = completions[:100], references[:100]
    mixed_c = normal_c[:50] + [c for c, _ in ADVERSARIAL] + normal_c[50:]
    mixed_r = normal_r[:50] + [r for _, r in ADVERSARIAL] + normal_r[50:]
    pool = grading.grading_pool(num_workers=workers, timeout_s=timeout)
    grading.grade_batch(warm_c[:8], warm_r[:8], pool=pool)
    started = time.perf_counter()
    mixed = grading.grade_batch(mixed_c, mixed_r, pool=pool)
    adversarial_s = time.perf_counter() - started
    after = grading.grade_batch(normal_c[:20], normal_r[:20], pool=pool)  # still usable
    stats = dict(pool.stats)
    pool.close()
    return {
        "adversarial": mixed[50 : 50 + len(ADVERSARIAL)],
        "normal": mixed[:50] + mixed[50 + len(ADVERSARIAL) :],
        "seconds": adversarial_s,
        "after": after,
        "timeouts": stats["timeouts"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="completions graded by both sides")
    parser.add_argument(
        "--workers", type=int, default=None, help="pool size (default: one per core, at most 32)"
    )
    parser.add_argument("--block", type=int, default=500, help="completions per serial/pooled turn")
    parser.add_argument(
        "--adversarial-timeout", type=float, default=2.0, help="per-item timeout (s)"
    )
    args = parser.parse_args()

    completions, references = make_completions(args.count)
    # Warm both sides on the same other items (imports, regex compilation, the LaTeX parser's
    # caches, worker start-up).
    warm_c, warm_r = make_completions(256, seed=1)
    for completion, reference in zip(warm_c, warm_r):
        grading.grade(completion, reference)
    speed = serial_vs_pooled(completions, references, warm_c, warm_r, args.workers, args.block)
    serial, serial_s, pooled_s = speed["serial"], speed["serial_s"], speed["pooled_s"]
    hard = adversarial_run(
        completions, references, warm_c, warm_r, args.workers, args.adversarial_timeout
    )
    # Worst case: every adversarial item runs to its timeout, one after another, plus a worker
    # restart (a fresh interpreter importing math-verify, about a second) each.
    bound_s = len(ADVERSARIAL) * (args.adversarial_timeout + 3.0) + 10.0
    cores_free = free_cores(speed["num_workers"])
    print(
        json.dumps(
            {
                "num_completions": len(completions),
                # Cores that as many plain busy loops as workers obtain on this machine right now:
                # the ceiling of any speedup here (2.0 on an idle 2-core machine).
                "free_cores_measured": round(cores_free, 2),
                "load_average_1min": round(os.getloadavg()[0], 2),
                "num_workers": speed["num_workers"],
                "cpu_cores": len(os.sched_getaffinity(0)),
                "serial_s": round(serial_s, 3),
                "pooled_s": round(pooled_s, 3),
                "pooled_over_serial_speedup": round(serial_s / pooled_s, 3),
                "serial_ms_per_item": round(1e3 * serial_s / len(completions), 3),
                # CPU seconds spent (pooled: workers + this process): equal values mean no pool
                # overhead, so on an idle machine the speedup would approach the number of workers.
                "serial_cpu_s": round(speed["serial_cpu_s"], 3),
                "pooled_cpu_s": round(speed["pooled_cpu_s"], 3),
                # Time runnable but waiting for a CPU held by other processes (a shared machine):
                # the serial loop's share of its wall time, and the workers' mean share of theirs.
                "serial_cpu_wait_fraction": round(speed["serial_wait_s"] / serial_s, 3),
                "pooled_workers_cpu_wait_fraction": round(
                    speed["pooled_wait_s"] / speed["num_workers"] / pooled_s, 3
                ),
                "pool_startup_s": round(speed["pool_startup_s"], 3),
                "results_agree": serial == speed["pooled"],
                "fraction_correct": round(sum(serial) / len(serial), 3),
                "adversarial_items": len(ADVERSARIAL),
                "adversarial_timeout_s": args.adversarial_timeout,
                "adversarial_batch_s": round(hard["seconds"], 3),
                "adversarial_batch_bound_s": bound_s,
                "adversarial_timeouts_counted": hard["timeouts"],
                "adversarial_all_wrong": not any(hard["adversarial"]),
                "adversarial_normal_items_unchanged": hard["normal"] == serial[:100],
                "adversarial_within_timeout": (
                    not any(hard["adversarial"])
                    and hard["normal"] == serial[:100]
                    and hard["seconds"] <= bound_s
                    and hard["timeouts"] >= 1
                    and hard["after"] == serial[:20]
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
