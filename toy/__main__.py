"""``python -m toy [--json] [--only TEXT]``: the exact checks as a table; exit 1 if any fails.

The table has one row per claim: its name, the measured error (or gap, for the separation rows
marked ">"), the tolerance it is held to, pass/FAIL, and what was measured. ``--json`` prints the
same rows as a JSON list of objects (name, section, quantity, max_abs_error, tolerance, relation,
passed) and nothing else on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from toy import table
from toy.checks import CHECKS, Result, run_checks


def format_table(results: list[Result], seconds: float) -> str:
    """The rows as aligned text, with a legend and a one-line summary."""
    width = max(len(r.name) for r in results)
    lines = [
        f"{'sec':<3}  {'check':<{width}}  {'max abs error':>13}  {'tolerance':<11}  "
        f"{'pass':<4}  quantity"
    ]
    lines.append("-" * len(lines[0]))
    for r in results:
        tolerance = f"{r.relation} {r.tolerance:.0e}" if r.tolerance else f"{r.relation} 0"
        lines.append(
            f"{r.section:<3}  {r.name:<{width}}  {r.max_abs_error:>13.3e}  {tolerance:<11}  "
            f"{'ok' if r.passed else 'FAIL':<4}  {r.quantity}"
        )
    failed = [r.name for r in results if not r.passed]
    lines.append("")
    lines.append(
        "'<=' rows are equalities (error <= tolerance); '>' rows are separations "
        "(the column holds a gap, which must exceed the margin)."
    )
    summary = f"{len(results) - len(failed)}/{len(results)} checks passed in {seconds:.1f} s"
    lines.append(summary + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None, checks=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m toy",
        description="Run toy/'s exact checks, print a table, exit 1 if any fails.",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the rows as a JSON list instead of a table"
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help=(
            "print pi(y2) at each estimator's fixed point on the App. C tree (toy/table.py) "
            "and exit"
        ),
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="TEXT",
        help="run only the check functions whose name contains TEXT",
    )
    args = parser.parse_args(argv)
    if args.table:
        print(table.format_table(table.estimator_table()))
        return 0
    selected = list(CHECKS if checks is None else checks)
    if args.only:
        selected = [c for c in selected if args.only in c.__name__]
        if not selected:
            names = ", ".join(c.__name__ for c in CHECKS)
            parser.error(f"no check function matches --only {args.only!r}; the checks are: {names}")
    start = time.perf_counter()
    results = run_checks(selected)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        print(format_table(results, seconds))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
