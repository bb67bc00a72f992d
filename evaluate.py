"""Evaluation: unbiased pass@k of a model on benchmarks, sampled with vLLM (section 5.1, Table 1).

Read top to bottom, this is an evaluation run:

1. pass@k (Chen et al. 2021): the unbiased estimator 1 - C(n-c, k) / C(n, k), computed as the
   stable product 1 - prod_{i=n-c+1..n} (1 - k/i), for every k = 1, 2, 4, ..., n; its sampling
   variance for standard errors; mean, std and standard error over seeds.
2. Sampling: one engine call per seed with n samples per prompt (the paper's evaluation config:
   temperature 0.3, top-p 0.95, min-p 0.01), then grading in a pool with hard timeouts
   (task/grading.py), per-problem correct counts, pass@k. The trainer's --eval-every
   (``EvalConfig``, ``training_evaluation``) calls ``evaluation_rows`` on its own engine.
3. Support: the exact log pi(y*|x) of a known solution y*, teacher-forced at the sampler's
   temperature and min-p (``support_probe``, Theorem 4.3), and the trainer's guide map along y*.
4. The command line, ``python evaluate.py --model PATH ...`` (``run_evaluation``): benchmarks by
   name or a local file, an adapter merged in memory, a results file written atomically after
   every seed, resume (machinery/results.py); the subcommands ``plot``, ``patterns`` and
   ``perplexity`` of extras/analysis.py.
Where this differs from the authors' evaluation: docs/deviations.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import guides
import loss
import rollout
from machinery import cli, fast_logprobs, models
from machinery.runs import write_json_atomic
from task.grading import GRADERS, default_pool, grade_batch, grading_pool
from task.problems import DataError, build_prompt_ids, resolve_benchmarks, sft_completion


class EvalError(cli.UsageError):
    """A user-facing problem (bad input, missing data): the CLI prints it as one line."""


# ---- 1. pass@k: the unbiased estimator, its variance, summaries over problems and seeds --------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples (Chen et al. 2021).

    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k/i) , and
    1.0 when n - c < k (every k-subset holds a correct sample).

    >>> pass_at_k(4, 1, 2)  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    0.5
    >>> pass_at_k(256, 0, 256), pass_at_k(256, 1, 256), round(pass_at_k(10, 3, 1), 12)  # c/n
    (0.0, 1.0, 0.3)
    """
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise EvalError(
            f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}"
        )
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@functools.cache
def _overlap_probabilities(n: int, k: int) -> tuple[float, ...]:
    # P(two independent random k-subsets of n share j elements), j = 0..k (hypergeometric).
    total = math.comb(n, k)
    return tuple(math.comb(k, j) * math.comb(n - k, k - j) / total for j in range(k + 1))


def pass_at_k_variance(n: int, p: float, k: int) -> float:
    """Variance of the pass@k estimator when c ~ Binomial(n, p).

    Var = C(n,k)^-1 sum_{j=1..k} C(k,j) C(n-k,k-j) [(1-p)^(2k-j) - (1-p)^(2k)]: the estimator's
    square is the chance that two random k-subsets both miss, and they overlap in j samples.

    >>> pass_at_k_variance(1, 0.5, 1)  # one Bernoulli(1/2) sample: p (1 - p)
    0.25
    """
    if not (0.0 <= p <= 1.0 and 1 <= k <= n):
        raise EvalError(
            f"pass_at_k_variance needs 0 <= p <= 1 and 1 <= k <= n; got p={p}, k={k}, n={n}"
        )
    q = 1.0 - p
    weights = _overlap_probabilities(n, k)
    return sum(weights[j] * (q ** (2 * k - j) - q ** (2 * k)) for j in range(1, k + 1))


def ks_up_to(n: int) -> list[int]:
    """k = 1, 2, 4, ..., and n itself (every power of two up to n, as the paper's plots).

    >>> ks_up_to(256)[-3:], ks_up_to(12)
    ([64, 128, 256], [1, 2, 4, 8, 12])
    """
    ks = [2**e for e in range(n.bit_length()) if 2**e <= n]
    return ks if ks[-1] == n else ks + [n]


def score_counts(counts: Sequence[int], n: int, ks: Sequence[int]) -> dict:
    """Benchmark pass@k (mean over problems) and its standard error, for one seed.

    The standard error is that of sampling: sqrt(sum_x Var_x) / P with Var_x the estimator's
    variance at the plug-in p = c_x / n (problems held fixed).

    >>> score_counts([0, 2, 4], n=4, ks=[1, 4])["pass_at_k"]
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
        spread = sum((v - mean) ** 2 for v in values)
        std = math.sqrt(spread / (len(values) - 1)) if len(values) > 1 else 0.0
        stderr = math.sqrt(sum(e * e for e in errors)) / len(errors)
        summary[k] = {"mean": mean, "std": std, "stderr": stderr, "num_seeds": len(values)}
    return summary


def recompute_summaries(results: dict) -> dict:
    """Per-benchmark mean/std/stderr over the seeds present, and the benchmark average."""
    ks = results["ks"]
    for entry in results["benchmarks"].values():
        seeds = [entry["seeds"][s] for s in sorted(entry["seeds"], key=int)]
        entry["pass_at_k"] = summarize_seeds(seeds, ks) if seeds else {}
    complete = [e["pass_at_k"] for e in results["benchmarks"].values() if e["pass_at_k"]]
    results["average"] = (
        {str(k): sum(summary[str(k)]["mean"] for summary in complete) / len(complete) for k in ks}
        if complete
        else {}
    )
    return results


# ---- 2. Sampling and grading: one engine call per seed, graded in the pool ---------------------


@dataclass(frozen=True)
class EvalSampling:
    """Sampling for evaluation: the paper's evaluation config by default (section 5.1)."""

    temperature: float = 0.3
    top_p: float = 0.95
    top_k: int = -1
    min_p: float = 0.01
    max_tokens: int = 1536


# What a reference solution's field holds (``solution_completion_ids``): a worked solution to put
# in the paper's answer format, or a completion prefix as it is.
SOLUTION_FORMATS = ("paper", "prefix")


@dataclass
class EvalConfig:
    """pass@k during training (--eval-every), through the training engine."""

    eval_every: int = field(default=0, metadata={"range": ">= 0"})
    """Evaluate pass@k before the first step, every N steps and after the last, through the
    training engine, one step's batch at a time (0: off); rows go to <run>/eval.jsonl."""
    eval_benchmarks: str = ""
    """Benchmarks of --eval-every: names (aime, amc23, math500-l5, ...) or local files with
    problem/answer fields; the demo: its held-out problems."""
    eval_n: int = field(default=8, metadata={"range": ">= 1"})
    """Samples per problem of --eval-every (pass@k for k = 1, 2, 4, ..., n)."""
    # the paper's evaluation sampling (EvalSampling)
    eval_temperature: float = field(default=0.3, metadata={"range": "> 0"})
    """Sampling temperature of --eval-every (the paper's evaluation config)."""
    eval_top_p: float = field(default=0.95, metadata={"range": "in (0, 1]"})
    """Top-p of --eval-every (the paper's evaluation config)."""
    eval_solution_key: str = ""
    """Field of the --eval-benchmarks files that holds a reference solution y*: each evaluation
    then also runs the support probe, log pi(y*|x) at the training temperature and min-p."""
    eval_group_key: str = ""
    """Field of the --eval-benchmarks files that groups the problems (e.g. easy / hard) for the
    support probe's summaries."""
    eval_solution_format: str = field(default="paper", metadata={"choices": SOLUTION_FORMATS})
    """paper | prefix: y* is the solution in the paper's answer format and EOS, or the field's
    text as a completion prefix (the probe then measures log pi of that prefix)."""


def sampling_config(sampling: EvalSampling, n: int, seed: int):
    """rollout.SamplingConfig for one seed; its checks become one-line errors here."""
    try:
        return rollout.SamplingConfig(n=n, seed=seed, **dataclasses.asdict(sampling))
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

    def seed_entry(self, n: int, ks: Sequence[int], span: slice = slice(None)) -> dict:
        """The results-file entry of one benchmark (the problems in ``span``) for this seed."""
        correct, reasons = self.correct[span], self.finish_reasons[span]
        lengths = [len(ids) for row in self.token_ids[span] for ids in row]
        truncated = sum(r == "length" for row in reasons for r in row)
        return {
            "correct": [sum(row) for row in correct],
            **score_counts([sum(row) for row in correct], n, ks),
            "grading_timeouts": sum(map(sum, self.timed_out[span])),
            "truncated_fraction": truncated / max(1, len(lengths)),
            "mean_completion_tokens": sum(lengths) / max(1, len(lengths)),
        }


def generate_and_grade(
    engine, prompts, problems, sampling, pool=None, progress=True
) -> SeedSamples:
    """``sampling.n`` samples per prompt (token ids) in one seeded engine call (``sampling``: a
    rollout.SamplingConfig), then grading against the
    problems (task.problems.Problem) in ``pool`` (a GradingPool; default: the shared one).

    One call, not several: the engine derives each prompt's seed from ``sampling.seed`` and the
    prompt's position in the call, so the same call reproduces the same samples.
    """

    if len(prompts) != len(problems):
        raise EvalError(f"{len(prompts)} prompts for {len(problems)} problems")
    started = time.perf_counter()
    outputs = engine.generate(list(prompts), sampling)
    generate_s = time.perf_counter() - started
    texts = [[c.text for c in row] for row in outputs]
    pool = pool or default_pool()
    started = time.perf_counter()
    answers = [p.answer for p, row in zip(problems, texts) for _ in row]
    graders = [p.grader for p, row in zip(problems, texts) for _ in row]
    flat = grade_batch(
        [text for row in texts for text in row], answers, graders, pool=pool, progress=progress
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
    engine, tokenizer, problems, n: int, seeds=(0,), sampling=EvalSampling(), pool=None
) -> dict:
    """pass@k (k = 1, 2, 4, ..., n) of a rollout engine on a list of problems, quietly (no
    progress bars): the dict the CLI writes per benchmark.

    Returns {"num_problems", "ks", "seeds": {seed: {"correct": [c per problem], "pass_at_k":
    {k: value}, "pass_at_k_stderr": {k: se}, ...}}, "pass_at_k": {k: {mean, std, stderr}}}.
    """

    ks = ks_up_to(n)
    prompts = [build_prompt_ids(tokenizer, p.problem) for p in problems]
    seeds_out = {}
    for seed in seeds:
        config = sampling_config(sampling, n, seed)
        samples = generate_and_grade(
            engine, prompts, problems=problems, sampling=config, pool=pool, progress=False
        )
        seeds_out[str(seed)] = samples.seed_entry(n, ks)
    summary = summarize_seeds(list(seeds_out.values()), ks)
    return {"num_problems": len(problems), "ks": ks, "seeds": seeds_out, "pass_at_k": summary}


def evaluation_rows(engine, tokenizer, benchmarks: dict, n: int, seed: int, sampling, step: int):
    """pass@k of whatever the engine holds, one row per benchmark (the trainer's --eval-every):
    {step, benchmark, num_problems, n, pass@1, pass@2, ..., pass@n, pass_at_k: {k: mean, std,
    stderr}}."""
    rows = []
    for name, problems in benchmarks.items():
        results = evaluate_problems(
            engine, tokenizer, problems=problems, n=n, seeds=(seed,), sampling=sampling
        )
        means = {f"pass@{k}": value["mean"] for k, value in results["pass_at_k"].items()}
        row = {"step": step, "benchmark": name, "num_problems": len(problems), "n": n}
        rows.append({**row, **means, "pass_at_k": results["pass_at_k"]})
    return rows


def training_benchmarks(config) -> dict:
    """What a sage.py run's --eval-every evaluates, when it is on: {name: [Problem]}
    (cli.check_config insists on benchmarks then), the support probe's fields checked
    (``check_probe_fields``). Loaded before the model and the run directory, so a bad file or
    field costs no model load and leaves nothing behind."""
    evaluation = config.eval
    resolved = resolve_benchmarks(
        evaluation.eval_benchmarks,
        solution_key=evaluation.eval_solution_key,
        group_key=evaluation.eval_group_key,
    )
    benchmarks = {name: problems for name, (_, problems) in resolved.items()}
    check_probe_fields(
        benchmarks, evaluation.eval_solution_key, evaluation.eval_group_key, flags="--eval-"
    )
    return benchmarks


def due(config, benchmarks: dict, updates: int) -> bool:
    """Whether a sage.py run evaluates after ``updates`` optimizer steps: before the first, every
    --eval-every steps and after the last, when it has benchmarks.

    >>> from types import SimpleNamespace as Config
    >>> config = Config(eval=Config(eval_every=50), steps=120)
    >>> [due(config, {"aime": []}, updates) for updates in (0, 49, 50, 120)]
    [True, False, True, True]
    """
    every = config.eval.eval_every
    return bool(benchmarks) and every > 0 and (updates % every == 0 or updates == config.steps)


def training_evaluation(
    engine, tokenizer, benchmarks: dict, config, updates: int, policy=None
) -> list[dict]:
    """The rows of a sage.py run's --eval-every after ``updates`` optimizer steps
    (``evaluation_rows`` at the evaluation's sampling); with --eval-solution-key, each also holds
    the support probe and the guide map of ``policy`` (``support_and_guide_map``)."""
    sampling = EvalSampling(
        temperature=config.eval.eval_temperature,
        top_p=config.eval.eval_top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        max_tokens=config.max_seq_len - config.max_prompt_len,
    )
    rows = evaluation_rows(
        engine,
        tokenizer,
        benchmarks,
        n=config.eval.eval_n,
        seed=config.seed,
        sampling=sampling,
        step=updates,
    )
    for row in rows:
        if policy is not None and config.eval.eval_solution_key:
            problems = benchmarks[row["benchmark"]]
            probe = support_and_guide_map(
                policy, tokenizer, problems=problems, config=config, updates=updates
            )
            row.update(probe)
    return rows


# ---- 3. Support: the exact probability of a known solution (Theorem 4.3) ---------------------

# supp_delta is the fraction of problems whose reference solution has pi(y*|x) >= delta
SUPPORT_DELTAS = (1e-1, 1e-2, 1e-3, 1e-4)


def supp_key(delta: float) -> str:
    """The name of supp_delta in summaries and files.

    >>> [supp_key(delta) for delta in SUPPORT_DELTAS]
    ['supp@0.1', 'supp@0.01', 'supp@0.001', 'supp@0.0001']
    """
    return f"supp@{delta:g}"


def solution_completion_ids(
    tokenizer, solution: str, answer: str, solution_format: str = "paper"
) -> list[int]:
    """y*: with solution_format "paper", a reference solution in the paper's answer format (App.
    E.4) and the EOS that ends it, tokenized as SFT tokenizes its targets (extras/sft.py);
    with "prefix", the field's text as it is, a completion prefix (no format, no EOS): the probe
    then measures log pi of that prefix, such as a first token.

    >>> from extras.demo import build_tiny_tokenizer
    >>> tokenizer = build_tiny_tokenizer()
    >>> tokenizer.decode(solution_completion_ids(tokenizer, "7+5=12", "12"))
    '<start_working_out>7+5=12<end_working_out><SOLUTION>12</SOLUTION><|im_end|>'
    >>> tokenizer.decode(solution_completion_ids(tokenizer, "7+5", "12", solution_format="prefix"))
    '7+5'
    """
    if solution_format == "prefix":
        return tokenizer(solution, add_special_tokens=False)["input_ids"]
    text = sft_completion(solution, answer)
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def min_p_keeps(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, min_p: float):
    """[...] bool: whether min-p keeps each token, pi_T(y_t) >= min_p * max_v pi_T(v), the rule
    ``loss.token_logps_and_entropies`` replays (there the sampled token always counts as kept).

    >>> min_p_keeps(torch.tensor([[0.0, -5.0]]), torch.tensor([1]), 1.0, 0.01).tolist()  # e^-5
    [False]
    """
    log_probs = (logits.float() / temperature).log_softmax(dim=-1)  # [..., V]
    token_log_probs = log_probs.gather(-1, token_ids[..., None]).squeeze(-1)  # [...]
    if min_p <= 0.0:
        return torch.ones_like(token_log_probs, dtype=torch.bool)
    return token_log_probs >= math.log(min_p) + log_probs.amax(dim=-1)


@dataclass
class SolutionLogps:
    """Teacher-forced y* of one problem under one policy, per token [C] (C = len(y*))."""

    token_logps: list[float]  # log pi(y*_t | x, y*_<t), temperature and min-p replayed
    token_logps_full: list[float]  # the same at temperature T without min-p (always finite)
    entropies: list[float]  # H_t of pi_T's full softmax (Eq. 12)
    entropies_kept: list[float]  # H_t of its min-p truncation (what the sampler draws from)
    kept: list[bool]  # min-p keeps y*_t; one False puts y* outside the sampler's support

    @property
    def log_kept_mass(self) -> list[float]:
        """log M_t <= 0 per token: the log of pi_T's mass that min-p keeps at y*'s position t
        (log pi_T(y*_t) - log of its truncation's)."""
        return [full - kept for full, kept in zip(self.token_logps_full, self.token_logps)]

    @property
    def logp(self) -> float:
        """log pi(y*|x) under the sampler's distribution; -inf when min-p removes a token."""
        return sum(self.token_logps) if all(self.kept) else -math.inf


@torch.no_grad()
def solution_logps(
    model,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float,
    min_p: float,
    pad_id: int,
    batch_size: int = 8,
) -> list[SolutionLogps]:
    """One teacher-forced forward pass per batch of (prompt, y*) pairs: per token, log pi(y*_t)
    as the sampler draws (``loss.token_logps_and_entropies``, the definition, with temperature
    and min-p), the same without min-p, the entropy H_t, and whether min-p keeps y*_t. No samples
    are drawn, so the numbers are exact, not estimates."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()  # no dropout: the probe is deterministic
    results = []
    for start in range(0, len(prompts), batch_size):
        rows = slice(start, start + batch_size)
        batch = loss.collate(prompts[rows], completions[rows], pad_id, device)
        completion_ids, mask = batch["completion_ids"], batch["completion_mask"]  # [B, C]
        logits = fast_logprobs.completion_logits(model, batch)  # [B, C, V]
        logps, entropies_kept = loss.token_logps_and_entropies(
            logits, completion_ids, temperature, min_p
        )
        logps_full, entropies = loss.token_logps_and_entropies(logits, completion_ids, temperature)
        kept = min_p_keeps(logits, completion_ids, temperature, min_p)
        for row, length in enumerate(mask.sum(dim=1).long().tolist()):
            results.append(
                SolutionLogps(
                    token_logps=logps[row, :length].tolist(),
                    token_logps_full=logps_full[row, :length].tolist(),
                    entropies=entropies[row, :length].tolist(),
                    entropies_kept=entropies_kept[row, :length].tolist(),
                    kept=kept[row, :length].tolist(),
                )
            )
    model.train(was_training)
    return results


def support_summary(probes: Sequence[SolutionLogps], groups: Sequence[str]) -> dict:
    """Per group of problems (and "all"): the mean log pi(y*) over the problems inside the
    sampler's support, the mean without min-p over every problem, supp_delta for each delta of
    ``SUPPORT_DELTAS`` (a problem outside the support counts as pi(y*) = 0) and the fraction
    outside min-p's support.

    >>> inside = SolutionLogps([-0.5, -1.0], [-0.6, -1.1], [0.1, 0.2], [0.1, 0.2], [True, True])
    >>> outside = SolutionLogps([-0.1, -9.0], [-0.1, -9.0], [0.1, 2.0], [0.1, 0.0], [True, False])
    >>> summary = support_summary([inside, outside], ["easy", "hard"])
    >>> summary["all"]["supp@0.1"], summary["hard"]["outside"], summary["all"]["mean_logp"]
    (0.5, 1.0, -1.5)
    """
    by_group: dict[str, list[SolutionLogps]] = {"all": list(probes)}
    for probe, group in zip(probes, groups):
        if group:
            by_group.setdefault(group, []).append(probe)
    summary = {}
    for group, members in by_group.items():
        logps = [probe.logp for probe in members]
        inside = [logp for logp in logps if logp > -math.inf]
        entry = {
            "problems": len(members),
            "mean_logp": sum(inside) / len(inside) if inside else None,
            "mean_logp_full": sum(sum(p.token_logps_full) for p in members) / len(members),
            "outside": 1.0 - len(inside) / len(members),
        }
        for delta in SUPPORT_DELTAS:
            entry[supp_key(delta)] = sum(logp >= math.log(delta) for logp in logps) / len(logps)
        summary[group] = entry
    return summary


def support_probe(
    model,
    tokenizer,
    problems,
    temperature: float,
    min_p: float,
    batch_size: int = 8,
    solution_format: str = "paper",
) -> tuple[dict, list[SolutionLogps]] | None:
    """The support probe of a policy on the problems that have a reference solution: its
    ``support_summary`` with, per problem, log pi(y*|x) (None for -inf: outside the support),
    and the per-token ``SolutionLogps``. None when no problem has a reference solution."""
    with_solution = [p for p in problems if p.solution]
    if not with_solution:
        return None
    prompts = [build_prompt_ids(tokenizer, p.problem) for p in with_solution]
    completions = [
        solution_completion_ids(tokenizer, p.solution, p.answer, solution_format=solution_format)
        for p in with_solution
    ]
    probes = solution_logps(
        model,
        prompts,
        completions,
        temperature=temperature,
        min_p=min_p,
        pad_id=tokenizer.pad_token_id,
        batch_size=batch_size,
    )
    summary = support_summary(probes, [p.group for p in with_solution])
    summary["per_problem_logp"] = [None if p.logp == -math.inf else p.logp for p in probes]
    return summary, probes


GUIDE_MAP_PROBLEMS = 3  # problems whose y* the guide map draws


def support_and_guide_map(policy, tokenizer, problems, config, updates: int) -> dict:
    """A sage.py run's support probe: {"support": the probe's summary per group, "guide_map": per
    token of y*, for the first ``GUIDE_MAP_PROBLEMS`` problems of the "hard" group (or the first
    problems): the tokens, H_t of the distribution the loss reads (and of both: the full
    softmax's and its min-p truncation's), the branch guide's q_t and log M_t, the log of the
    mass min-p keeps, at this policy after ``updates`` steps}; {} when no problem has y*."""
    probed = support_probe(
        policy,
        tokenizer,
        problems,
        temperature=config.temperature,
        min_p=config.min_p,
        batch_size=config.micro_batch_size,
        solution_format=config.eval.eval_solution_format,
    )
    if probed is None:
        return {}
    summary, probes = probed
    summary.pop("per_problem_logp")
    with_solution = [p for p in problems if p.solution]
    shown = [i for i, p in enumerate(with_solution) if p.group == "hard"] or list(
        range(len(with_solution))
    )
    branch = dataclasses.replace(config.guide, name="branch")
    guide_map = []
    for index in shown[:GUIDE_MAP_PROBLEMS]:
        probe, problem = probes[index], with_solution[index]
        # H_t of the distribution the run's loss and guide read (--loss-distribution)
        read = probe.entropies_kept if config.loss.distribution == "min_p" else probe.entropies
        entropies = torch.tensor([read])  # [1, C]
        log_q = guides.compute_log_q(
            branch,
            logps=torch.tensor([probe.token_logps]),
            entropies=entropies,
            completion_mask=torch.ones_like(entropies),
            step=updates,
            total_steps=config.steps,
        )
        ids = solution_completion_ids(
            tokenizer,
            problem.solution,
            problem.answer,
            solution_format=config.eval.eval_solution_format,
        )
        guide_map.append(
            {
                "problem": problem.problem,
                "tokens": [tokenizer.decode([token]) for token in ids],
                "entropy": read,
                "entropy_full": probe.entropies,
                "entropy_kept": probe.entropies_kept,
                "log_kept_mass": probe.log_kept_mass,
                "q": log_q.exp()[0].tolist(),
                "logp": probe.token_logps_full,
                "kept": probe.kept,
            }
        )
    return {"support": summary, "guide_map": guide_map}


# ---- 4. The command line: a run over benchmarks, atomic results, resume ----------------------


def engine_maker(backend: str):
    """The ``make_engine`` of --backend: ``rollout.make_engine`` (vLLM), or for "hf" that of
    extras/hf_engine.py (transformers ``generate``), imported only then."""
    if backend != "hf":
        return rollout.make_engine
    from extras import hf_engine

    return hf_engine.make_engine


def run_evaluation(args: EvalArgs, make_engine=None) -> dict:
    """The CLI's work: load benchmarks, skip finished (benchmark, seed) pairs of an existing
    --out, sample and grade the rest (one engine call per seed over all benchmarks), write the
    results file atomically after every seed. Returns the results dict."""
    from machinery import results as files  # the CLI's results file (sage.py never loads it)

    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    benchmarks = resolve_benchmarks(
        args.benchmarks,
        problem_key=args.problem_key,
        answer_key=args.answer_key,
        grader=args.grader,
        solution_key=args.solution_key,
        group_key=args.group_key,
    )
    if args.limit:
        benchmarks = {
            name: (source, problems[: args.limit])
            for name, (source, problems) in benchmarks.items()
        }
    sampling = EvalSampling(args.temperature, args.top_p, args.top_k, args.min_p, args.max_tokens)
    sampling_config(sampling, args.n, seeds[0])  # bad settings fail now, not after loading a model
    results = files.new_results(args, benchmarks, sampling, ks_up_to(args.n))
    files.merge_existing(results, args.out)
    # the support probe, before the engine takes the memory; a resumed file's is kept if it was
    # made with these fields (its temperature and min-p are the sampling's, checked on resume)
    probe = {key: getattr(args, key) for key in ("solution_key", "group_key", "solution_format")}
    unprobed = [name for name in benchmarks if results["benchmarks"][name].get("probe") != probe]
    if args.solution_key and unprobed:
        probe_benchmarks(args, {name: benchmarks[name][1] for name in unprobed}, results)
        for name in unprobed:
            results["benchmarks"][name]["probe"] = probe
        write_json_atomic(args.out, results)
    todo = files.pending_seeds(results, seeds, list(benchmarks), args.out)
    if todo:
        engine = files.start_engine(
            args,
            make_engine=make_engine or engine_maker(args.backend),
            cuda_fraction=rollout.CUDA_STANDALONE_MEMORY_FRACTION,
        )
        prompts = {
            name: [build_prompt_ids(engine.tokenizer, p.problem) for p in problems]
            for name, (_, problems) in benchmarks.items()
        }
        with grading_pool(num_workers=args.grading_workers, timeout_s=args.grade_timeout) as pool:
            for seed, names in tqdm(todo.items(), desc="seeds", disable=not args.progress):
                # one engine call over the benchmarks still missing this seed, one after the other
                problems = [p for name in names for p in benchmarks[name][1]]
                batch = [ids for name in names for ids in prompts[name]]
                config = sampling_config(sampling, args.n, seed)
                samples = generate_and_grade(
                    engine,
                    batch,
                    problems=problems,
                    sampling=config,
                    pool=pool,
                    progress=args.progress,
                )
                done = {name: (benchmarks[name][1], prompts[name]) for name in names}
                files.record_seed(results, args, seed, done, samples)
                write_json_atomic(args.out, recompute_summaries(results))
    recompute_summaries(results)
    write_json_atomic(args.out, results)
    return results


def check_probe_fields(benchmarks: dict, solution_key: str, group_key: str, flags="--") -> None:
    """The support probe's fields, where named: every benchmark of {name: problems} must hold a
    reference solution in ``solution_key`` (the probe's input), and some problem a group in
    ``group_key`` (its summaries); else one line naming the flag (``flags``: "--eval-" for
    sage.py's, "--" for evaluate.py's)."""
    for name, problems in benchmarks.items():
        if solution_key and not any(problem.solution for problem in problems):
            raise EvalError(
                f"{flags}solution-key {solution_key}: no problem of {name} has a reference "
                "solution in that field; name the field that holds one"
            )
    every = [problem for problems in benchmarks.values() for problem in problems]
    if group_key and not any(problem.group for problem in every):
        raise EvalError(
            f"{flags}group-key {group_key}: no problem has a group in that field; name the field "
            "that holds one"
        )


def probe_benchmarks(args: EvalArgs, benchmarks: dict, results: dict) -> None:
    """The support probe (section 3) of the model (its adapter merged) on each benchmark of
    {name: problems}, at the evaluation's temperature and min-p, into ``results``."""
    from transformers import AutoTokenizer

    from machinery import results as files

    check_probe_fields(benchmarks, args.solution_key, args.group_key)  # before the model loads
    loss.attend_somewhere_under_sdpa()  # the probe's batches are left-padded
    model = files.load_merged_model(args.model, args.adapter, args.dtype)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    for name, problems in benchmarks.items():
        summary, _ = support_probe(
            model,
            tokenizer,
            problems,
            temperature=args.temperature,
            min_p=args.min_p,
            solution_format=args.solution_format,
        )
        results["benchmarks"][name]["support"] = summary
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


ANALYSES = ("plot", "patterns", "perplexity")  # subcommands of extras/analysis.py


@dataclass(kw_only=True)
class EvalArgs:
    """python evaluate.py --model PATH [--adapter PATH] --benchmarks aime,amc23,math500-l5
    --n 256 ...

    Subcommands: plot (pass@k curves), patterns (Eq. 13), perplexity (Eq. 39); `evaluate.py plot
    -h`.
    """

    model: str
    """Model directory, hub name (org/name) or short name (Qwen2.5-Math-7B) the engine loads."""
    adapter: str | None = None
    """peft LoRA adapter directory, merged into the weights in memory."""
    benchmarks: str = "aime,amc23,math500-l5"
    """Comma-separated names (aime, amc23, math500-l5, minerva, knights-and-knaves) or
    .jsonl/.parquet files."""
    out: str = "results.json"
    """Results file (written atomically; re-running skips finished seeds)."""
    n: int = field(default=256, metadata={"range": ">= 1"})
    """Samples per problem and seed (paper: 256)."""
    seeds: str = "0,1,2"
    """Comma-separated seeds: one engine call each (paper: three)."""
    temperature: float = field(default=EvalSampling.temperature, metadata={"range": ">= 0"})
    """Sampling temperature (the paper's evaluation config)."""
    top_p: float = field(default=EvalSampling.top_p, metadata={"range": "in (0, 1]"})
    """Nucleus sampling threshold."""
    top_k: int = field(default=EvalSampling.top_k, metadata={"range": ">= -1"})
    """Top-k (-1: off)."""
    min_p: float = field(default=EvalSampling.min_p, metadata={"range": "in [0, 1)"})
    """Min-p."""
    max_tokens: int = field(default=EvalSampling.max_tokens, metadata={"range": ">= 1"})
    """Max completion tokens."""
    max_model_len: int = field(default=2048, metadata={"range": ">= 2"})
    """Engine context length, prompt + completion (paper: 2048)."""
    problem_key: str = "problem"
    """Column holding the problem, for local files."""
    answer_key: str = "answer"
    """Column holding the reference answer, for local files."""
    grader: str = field(default="math", metadata={"choices": GRADERS})
    """Grader for local files: math | knights_knaves."""
    solution_key: str = ""
    """Column holding a reference solution (local files, or a named benchmark's own column such
    as MATH-500's solution): the support probe, log pi(y*|x) teacher-forced at --temperature
    and --min-p, goes into the results file."""
    group_key: str = ""
    """Column grouping the problems (e.g. easy / hard, MATH-500's level) for the support probe's
    summaries."""
    solution_format: str = field(default="paper", metadata={"choices": SOLUTION_FORMATS})
    """paper | prefix: y* is the solution in the paper's answer format and EOS, or the column's
    text as a completion prefix (log pi of that prefix)."""
    limit: int | None = field(default=None, metadata={"range": ">= 1"})
    """Evaluate only the first LIMIT problems of each benchmark."""
    backend: str = field(default="vllm", metadata={"choices": rollout.BACKENDS})
    """Rollout engine: vllm | hf (transformers generate, slow)."""
    dtype: str = "auto"
    """Engine dtype (auto, bfloat16, float32)."""
    gpu_memory_utilization: float | None = field(default=None, metadata={"range": "in (0, 1]"})
    """vLLM memory fraction (default: 0.9 on CUDA, the engine runs alone; on CPU the share of
    RAM for the KV cache, 0.05)."""
    # task.grading.GRADE_TIMEOUT_S (a test holds them equal)
    grade_timeout: float = field(default=5.0, metadata={"range": "> 0"})
    """Per-item grading timeout in seconds."""
    grading_workers: int | None = field(default=None, metadata={"range": ">= 1"})
    """Grading processes (default: one per CPU core, at most 32)."""
    save_completions: str | None = None
    """Directory for per-(benchmark, seed) JSONL samples (input of patterns and perplexity)."""
    progress: bool = True
    """Progress bars."""

    def __post_init__(self):
        """One line, naming the flag, for a field out of its range or choices (an instance built
        in code is checked as the command line's is)."""
        if (problem := cli.field_problem(self)) is not None:
            raise ValueError(problem)
        if self.solution_key and self.temperature == 0:  # logits / 0: every log-prob NaN
            raise ValueError(
                "--solution-key with --temperature 0: the support probe reads log-probs at the "
                "sampling temperature, and greedy decoding has none; pass --temperature > 0"
            )


def evaluate_and_report(args: EvalArgs) -> None:
    """The evaluation, then pass@1 and pass@n (mean +- std over seeds) per benchmark."""
    results = run_evaluation(args)
    for name, entry in results["benchmarks"].items():
        summary = entry.get("pass_at_k") or {}
        ks = [k for k in ("1", str(max(results["ks"]))) if k in summary]
        scores = (f"pass@{k} {summary[k]['mean']:.3f} +- {summary[k]['std']:.3f}" for k in ks)
        print(f"{name}: " + ", ".join(scores))
    print(f"[evaluate] wrote {args.out}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    errors = (EvalError, DataError, models.ModelError, rollout.RolloutError)  # one line each
    if argv and argv[0] in ANALYSES:  # figures and tables from saved files
        from extras import analysis

        kind, work = analysis.SUBCOMMANDS[argv[0]]
        argv, prog, errors = argv[1:], f"evaluate.py {argv[0]}", errors + (analysis.AnalysisError,)
    else:
        kind, work, prog = EvalArgs, evaluate_and_report, "evaluate.py"
    try:
        args, _, _ = cli.parse_config(kind, argv, prog=prog, description=kind.__doc__)
        if kind is EvalArgs:
            if problem := cli.check_eval_args(args):
                raise EvalError(problem)  # before any model or benchmark loads
            args.model = models.resolve_model(args.model)  # a short name -> org/name
        elif args.out and (problem := cli.unwritable("--out", args.out)):  # its one file
            raise EvalError(problem)
        work(args)
    except errors as error:
        print(f"evaluate.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
