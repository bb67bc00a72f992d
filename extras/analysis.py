"""The paper's analyses of trained models, and their plots.

1. Reasoning patterns (Eq. 13, App. G): how often correct solutions set up variables ("let x",
   "denote"), reason about structure ("of the form", "decompose") or argue by contradiction,
   averaged per problem over its correct solutions, then over problems.
2. Perplexity under the base model (Eq. 39, Figure 7): how far a trained model's completions are
   from what the base model would write, scored with the trainer's own forward pass.
3. Plots: pass@k curves (Figure 3) and perplexity histograms (Figure 7).
4. The ``plot``, ``patterns`` and ``perplexity`` subcommands of evaluate.py, which read the files
   that evaluate.py writes (results, and completions saved with --save-completions).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from loss import attend_somewhere_under_sdpa, collate, completion_logps
from machinery import cli
from machinery.runs import atomic_output, read_jsonl, write_json_atomic

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class AnalysisError(ValueError):
    """Bad input to an analysis (a missing file, nothing to plot); the message names the fix."""


# --------------------------------------------------------------------------------------------
# Reasoning patterns (Eq. 13)
# --------------------------------------------------------------------------------------------

REASONING_PATTERNS = {
    "constraint_setup": re.compile(
        r"\blet\s+(?:\$|\\\(\s*)?[a-z](?![a-z])|\bdenot(?:e|es|ed|ing)\b", re.IGNORECASE
    ),
    "structural_reasoning": re.compile(
        r"\b(?:of|in) the form\b|\bdecompos(?:e|es|ed|ing|ition)\b", re.IGNORECASE
    ),
    "proof_by_contradiction": re.compile(
        r"\b(?:for|by) (?:the sake of )?contradiction\b|\b(?:leads?|leading) to a contradiction\b",
        re.IGNORECASE,
    ),
}


def pattern_frequencies(correct_solutions: Sequence[Sequence[str]]) -> dict[str, float]:
    """Eq. 13: F = (1/N) sum_x (1/|C_x|) sum_{y in C_x} 1[pattern(y)], over correct solutions.

    ``correct_solutions[x]`` is C_x, the correct solutions of problem x; problems with none are
    left out of N (1/|C_x| is undefined for them).

    >>> pattern_frequencies(
    ...     [["Let x be the side.", "Direct count."], ["Assume for contradiction ..."], []]
    ... )  # doctest: +NORMALIZE_WHITESPACE
    {'constraint_setup': 0.25, 'structural_reasoning': 0.0, 'proof_by_contradiction': 0.5,
     'num_problems': 2}
    """
    solved = [solutions for solutions in correct_solutions if solutions]
    out = {}
    for name, detector in REASONING_PATTERNS.items():
        per_problem = [
            sum(bool(detector.search(y)) for y in solutions) / len(solutions)
            for solutions in solved
        ]
        out[name] = sum(per_problem) / len(per_problem) if per_problem else 0.0
    out["num_problems"] = len(solved)
    return out


# --------------------------------------------------------------------------------------------
# Saved completions (evaluate.py --save-completions) and perplexity under a base model (Eq. 39)
# --------------------------------------------------------------------------------------------


def _split_label(entry: str) -> tuple[str, str]:
    """``LABEL=PATH`` -> (LABEL, PATH); a plain existing path -> ("", PATH)."""
    label, path = ("", entry) if os.path.isfile(entry) or "=" not in entry else entry.split("=", 1)
    if not os.path.isfile(path):
        raise AnalysisError(f"{path} does not exist")
    return label, path


def _labelled(entries: Sequence[str]) -> dict[str, list[str]]:
    """``[LABEL=]PATH`` arguments -> {label: [paths]}; the label defaults to the file's parent
    directory name (several files under one label are merged, e.g. several seeds)."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        label, path = _split_label(entry)
        out.setdefault(
            label or os.path.basename(os.path.dirname(os.path.abspath(path))), []
        ).append(path)
    return out


def read_completions(paths: Sequence[str]) -> dict[tuple[str, int], dict]:
    """Rows of ``--save-completions`` files, merged over seeds: {(benchmark, problem_index): row}
    with every seed's completions in ``row["completions"]``."""
    merged: dict[tuple[str, int], dict] = {}
    for path in paths:
        with open(path) as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    row = json.loads(line)
                    key = (row["benchmark"], row["problem_index"])
                except (ValueError, KeyError, TypeError):  # (JSONDecodeError is a ValueError)
                    raise AnalysisError(
                        f"{path} line {number} is not a row of evaluate.py --save-completions; "
                        "pass the files it wrote"
                    ) from None
                if key in merged:
                    merged[key]["completions"] += row["completions"]
                else:
                    merged[key] = row
    return merged


def completion_perplexities(
    model,
    prompts: Sequence[list[int]],
    completions: Sequence[list[int]],
    batch_size: int = 8,
    progress: bool = True,
) -> list[float]:
    """Eq. 39: PPL(y | x) = exp(-(1/|y|) sum_t log pi_base(y_t | x, y_<t)) for each pair.

    The forward pass is the trainer's (loss.collate + loss.completion_logps:
    left-padded prompts with true positions, only completion positions projected to the
    vocabulary).
    """
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(completions[i]))
    out = [math.nan] * len(prompts)
    for start in tqdm(range(0, len(order), batch_size), desc="perplexity", disable=not progress):
        batch_rows = order[start : start + batch_size]
        batch = collate(
            [list(prompts[i]) for i in batch_rows],
            [list(completions[i]) for i in batch_rows],
            0,
            device,
        )
        with torch.no_grad():
            logps, _ = completion_logps(model, batch, 1.0, 0.0)  # [B, C]
        mask = batch["completion_mask"]
        mean_logps = (logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        for row, i in enumerate(batch_rows):
            out[i] = math.exp(-mean_logps[row].item())
    return out


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def plot_results(entries: Sequence[str], out: str) -> None:
    """The paper's Figure 3 from results files, ``[LABEL=]PATH`` each (the label defaults to
    the name of the model's adapter, else of its directory)."""
    labelled = {}
    for entry in entries:
        label, path = _split_label(entry)
        with open(path) as handle:
            try:
                results = json.load(handle)
            except ValueError:
                results = None
        if not isinstance(results, dict) or "benchmarks" not in results:
            raise AnalysisError(
                f"{path} is not a results file of evaluate.py; pass the --out of an evaluation"
            )
        model = results.get("model", {})
        label = label or os.path.basename(
            str(model.get("adapter") or model.get("path") or path).rstrip("/")
        )
        labelled[label if label not in labelled else f"{label} ({path})"] = results
    plot_pass_at_k(labelled, out)


def plot_pass_at_k(labelled_results: dict[str, dict], out: str) -> None:
    """pass@k against k (1, 2, 4, ... on a log axis), one panel per benchmark, one line per model,
    with the standard error of each point as an error bar, as in the paper's Figure 3."""
    names = list(dict.fromkeys(name for r in labelled_results.values() for name in r["benchmarks"]))
    names = [
        name
        for name in names
        if any(r["benchmarks"].get(name, {}).get("pass_at_k") for r in labelled_results.values())
    ]
    if not names:
        raise AnalysisError("the results files hold no finished benchmark to plot")
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names):
        all_ks = set()
        for label, results in labelled_results.items():
            summary = results["benchmarks"].get(name, {}).get("pass_at_k")
            if not summary:
                continue
            ks = sorted(int(k) for k in summary)
            all_ks.update(ks)
            errors = [summary[str(k)].get("stderr", 0.0) for k in ks]
            axis.errorbar(
                ks,
                [summary[str(k)]["mean"] for k in ks],
                yerr=errors,
                marker="o",
                markersize=3,
                capsize=3,
                label=label,
            )
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted(all_ks), [str(k) for k in sorted(all_ks)])
        axis.minorticks_off()
        axis.set_title(name)
        axis.set_xlabel("k")
        axis.set_ylabel("pass@k")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    _save_figure(fig, out)
    plt.close(fig)


# What a run's curves show, panel by panel: (title, metrics.jsonl keys).
RUN_PANELS = (
    ("reward", ("reward", "accuracy")),
    ("KL estimates", ("kl/ref_k3", "kl/anchor_k3")),
    ("entropy (nats)", ("entropy",)),
    ("guide q", ("q/mean", "q/min", "q/max")),
    ("response length (tokens)", ("response_length",)),
)


def plot_run(run_dirs: Sequence[str], out: str) -> None:
    """A run's training curves against the step, one PNG: reward, KL, entropy, the guide's q,
    the response length (metrics.jsonl) and pass@k of --eval-every (eval.jsonl); several runs
    overlay."""
    fig, axes = plt.subplots(2, 4, figsize=(18, 7))
    for run_dir in run_dirs:
        metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        if not metrics:
            raise AnalysisError(f"{run_dir} has no metrics.jsonl: pass a run directory of sage.py")
        label = os.path.basename(os.path.abspath(run_dir))
        for axis, (title, keys) in zip(axes.flat, RUN_PANELS):
            for key in keys:
                points = [(row["step"], row[key]) for row in metrics if key in row]
                if points:
                    axis.plot(
                        *zip(*points),
                        label=f"{label} {key}" if len(run_dirs) > 1 else key,
                        linewidth=1,
                    )
            axis.set_title(title)
        evaluations = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
        for benchmark in sorted({row["benchmark"] for row in evaluations}):
            rows = [row for row in evaluations if row["benchmark"] == benchmark]
            for key in ("pass@1", f"pass@{rows[0]['n']}"):
                name = f"{benchmark} {key}" if len(run_dirs) == 1 else f"{label} {benchmark} {key}"
                axes.flat[5].plot(
                    [row["step"] for row in rows],
                    [row[key] for row in rows],
                    marker="o",
                    markersize=3,
                    label=name,
                )
        plot_support_curves(evaluations, axes.flat[6], axes.flat[7], len(run_dirs), label)
    axes.flat[5].set_title("pass@k (--eval-every)")
    axes.flat[6].set_title("support probe: mean log pi(y*)")
    axes.flat[7].set_title("support probe: supp_0.01, P(pi(y*) >= 0.01)")
    for axis in axes.flat:
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    fig.tight_layout()
    _save_figure(fig, out)
    plt.close(fig)


def plot_support_curves(evaluations: list[dict], logp_axis, supp_axis, runs: int, label: str):
    """The support probe against the step (eval.jsonl rows that carry one): per group of
    problems, the mean log pi(y*) (min-p not replayed, finite for every problem) and supp_0.01."""
    probed = [row for row in evaluations if row.get("support")]
    for benchmark in sorted({row["benchmark"] for row in probed}):
        rows = [row for row in probed if row["benchmark"] == benchmark]
        for group in rows[0]["support"]:
            name = f"{benchmark} {group}" if runs == 1 else f"{label} {benchmark} {group}"
            steps = [row["step"] for row in rows]
            for axis, key in ((logp_axis, "mean_logp_full"), (supp_axis, "supp@0.01")):
                values = [row["support"][group][key] for row in rows]
                axis.plot(steps, values, marker="o", markersize=3, label=name)


def plot_guide_map(evaluations: list[dict], tau: float, out: str) -> None:
    """Where the branch guide acts (Eq. 11): for the problems of the guide map (eval.jsonl), y*'s
    tokens with the policy's entropy H_t (bars, of the distribution the loss reads), the branch
    guide's q_t (line) and -log M_t, the tail min-p cuts (dashes), at the first evaluation and at
    the last. q_t > 1 only where H_t > tau: the anchor p~ = pi_ref * q is
    raised at the forks where the policy hesitates, and nowhere else."""
    mapped = [row for row in evaluations if row.get("guide_map")]
    if not mapped:
        raise AnalysisError("no evaluation holds a guide map: run with --eval-solution-key")
    first, last = mapped[0], mapped[-1]
    count = len(first["guide_map"])
    fig, axes = plt.subplots(count, 1, figsize=(12, 2.8 * count), squeeze=False)
    for axis, start, end in zip(axes[:, 0], first["guide_map"], last["guide_map"]):
        positions = list(range(len(start["tokens"])))
        width = 0.4
        axis.bar(
            [p - width / 2 for p in positions],
            start["entropy"],
            width,
            color="C0",
            alpha=0.45,
            label=f"H_t after {first['step']} steps",
        )
        axis.bar(
            [p + width / 2 for p in positions],
            end["entropy"],
            width,
            color="C0",
            label=f"H_t after {last['step']} steps",
        )
        if "log_kept_mass" in end:  # the tail min-p cuts: -log M_t, in nats like H_t
            axis.plot(
                positions,
                [-mass for mass in end["log_kept_mass"]],
                color="black",
                linestyle="none",
                marker="_",
                markersize=9,
                label=f"-log M_t after {last['step']} steps (cut by min-p)",
            )
        axis.axhline(tau, color="gray", linestyle=":", linewidth=1, label=f"tau = {tau:g}")
        axis.set_ylabel("entropy H_t (nats)")
        axis.set_xticks(
            positions,
            [token.replace("$", r"\$") for token in start["tokens"]],
            rotation=60,
            fontsize=7,
        )
        twin = axis.twinx()
        twin.plot(
            positions,
            start["q"],
            color="C3",
            linestyle="--",
            marker=".",
            label=f"q_t after {first['step']} steps",
        )
        twin.plot(
            positions,
            end["q"],
            color="C3",
            marker="o",
            markersize=3,
            label=f"q_t after {last['step']} steps",
        )
        twin.set_ylabel("branch guide q_t")
        twin.set_ylim(0.95, max(1.45, max(start["q"] + end["q"]) + 0.05))
        logp_start, logp_end = sum(start["logp"]), sum(end["logp"])
        axis.set_title(
            f"{start['problem']}   log pi(y*): {logp_start:.2f} -> {logp_end:.2f}", fontsize=9
        )
    handles, labels = axes[0, 0].get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    fig.legend(handles + twin_handles, labels + twin_labels, loc="upper center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (2.8 * count)))
    _save_figure(fig, out)
    plt.close(fig)


def plot_perplexity_histogram(values: dict[str, dict[str, list[float]]], out: str) -> None:
    """Distributions of Eq. 39's perplexity per model (one panel per problem group), as in the
    paper's Figure 7. ``values[panel][label]`` holds the perplexities."""
    fig, axes = plt.subplots(1, len(values), figsize=(4.5 * len(values), 3.6), squeeze=False)
    for axis, (panel, by_label) in zip(axes[0], values.items()):
        finite = [v for vs in by_label.values() for v in vs if math.isfinite(v)]
        bins = (
            30
            if not finite
            else [min(finite) + i * (max(finite) - min(finite) + 1e-9) / 30 for i in range(31)]
        )
        for label, ppl in by_label.items():
            axis.hist(
                [v for v in ppl if math.isfinite(v)],
                bins=bins,
                histtype="step",
                density=True,
                linewidth=1.5,
                label=f"{label} (n={len(ppl)})",
            )
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
# The subcommands of evaluate.py: plot, patterns, perplexity
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PlotArgs:
    """python evaluate.py plot [LABEL=]A.json [LABEL=]B.json --out passk.png: pass@k curves
    (Figure 3). python evaluate.py plot runs/NAME [runs/OTHER]: a run's training curves
    (runs/NAME/curves.png)."""

    results: list[str] = cli.positional()
    """Results files of evaluate.py (optionally LABEL=PATH), or run directories of sage.py."""
    out: str = ""
    """Output image (default: passk.png, or curves.png in the first run directory)."""


@dataclass(kw_only=True)
class PatternsArgs:
    """python evaluate.py patterns [LABEL=]DIR/aime.seed0.jsonl ...
    (files from --save-completions)"""

    completions: list[str] = cli.positional()
    """--save-completions files, optionally LABEL=PATH."""
    out: str | None = None
    """Also write the frequencies as JSON here."""


@dataclass(kw_only=True)
class PerplexityArgs:
    """python evaluate.py perplexity --base-model PATH [LABEL=]FILE.jsonl ... --out ppl.png

    The files' token ids are scored as they are, so the sampling models must share the base
    model's tokenizer (as the paper's fine-tunes of Qwen2.5-Math-7B do).
    """

    completions: list[str] = cli.positional()
    """--save-completions files, optionally LABEL=PATH."""
    base_model: str
    """The model that scores the completions (pi_base of Eq. 39)."""
    out: str = "perplexity.png"
    """Histogram image; the values go to the same name with .json."""
    problems: str | None = None
    """BENCHMARK:INDEX,... problems to plot one panel each (default: all pooled)."""
    max_samples: int = 64
    """Completions scored per problem and model (paper: 64)."""
    only_correct: bool = False
    """Score correct completions only."""
    batch_size: int = 8
    """Sequences per forward pass."""
    dtype: str = "auto"
    """Dtype of the base model."""
    device: str | None = None
    """Torch device (default: cuda if available, else cpu)."""
    progress: bool = True
    """Progress bars."""


def run_plot(args: PlotArgs) -> None:
    if all(os.path.isdir(entry) for entry in args.results):
        out = args.out or os.path.join(args.results[0], "curves.png")
        plot_run(args.results, out)
    elif any(os.path.isdir(entry) for entry in args.results):
        raise AnalysisError("plot takes either results files or run directories, not both")
    else:
        out = args.out or "passk.png"
        plot_results(args.results, out)
    print(f"[evaluate] wrote {out}", file=sys.stderr)


def run_patterns(args: PatternsArgs) -> dict:
    table = {}
    for label, paths in _labelled(args.completions).items():
        rows = read_completions(paths)
        solutions = [
            [c["text"] for c in row["completions"] if c["correct"]] for row in rows.values()
        ]
        table[label] = pattern_frequencies(solutions)
    names = list(REASONING_PATTERNS)
    print("model".ljust(24) + "".join(name.rjust(24) for name in names) + "problems".rjust(10))
    for label, freqs in table.items():
        print(
            label[:23].ljust(24)
            + "".join(f"{freqs[name]:24.3f}" for name in names)
            + str(freqs["num_problems"]).rjust(10)
        )
    if args.out:
        write_json_atomic(args.out, table)
    return table


def run_perplexity(args: PerplexityArgs) -> dict:
    wanted = None
    if args.problems:
        wanted = []
        for item in args.problems.split(","):
            benchmark, _, index = item.rpartition(":")
            if not benchmark or not index.isdigit():
                raise AnalysisError(f"--problems entries look like aime:3, got {item!r}")
            wanted.append((benchmark, int(index)))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    attend_somewhere_under_sdpa()  # its batches are left-padded
    model = (
        AutoModelForCausalLM.from_pretrained(args.base_model, dtype=torch_dtype).to(device).eval()
    )
    values: dict[str, dict[str, list[float]]] = {}
    for label, paths in _labelled(args.completions).items():
        rows = read_completions(paths)
        keys = wanted if wanted is not None else sorted(rows)
        for key in keys:
            if key not in rows:
                raise AnalysisError(f"{label}: no problem {key[0]}:{key[1]} in {', '.join(paths)}")
            row = rows[key]
            chosen = [c for c in row["completions"] if c["correct"] or not args.only_correct][
                : args.max_samples
            ]
            ppl = completion_perplexities(
                model,
                [row["prompt_ids"]] * len(chosen),
                [c["token_ids"] for c in chosen],
                batch_size=args.batch_size,
                progress=args.progress,
            )
            panel = f"{key[0]}:{key[1]}" if wanted is not None else "all problems"
            values.setdefault(panel, {}).setdefault(label, []).extend(ppl)
    if not any(values.values()):
        raise AnalysisError("no completions to score (check --only-correct and the files)")
    plot_perplexity_histogram(values, args.out)
    write_json_atomic(os.path.splitext(args.out)[0] + ".json", values)
    print(f"[evaluate] wrote {args.out}", file=sys.stderr)
    return values


SUBCOMMANDS = {
    "plot": (PlotArgs, run_plot),
    "patterns": (PatternsArgs, run_patterns),
    "perplexity": (PerplexityArgs, run_perplexity),
}
