"""Evaluation: unbiased pass@k of a model on benchmarks, sampled with vLLM (section 5.1, Table 1).

Read top to bottom, this is an evaluation run:

1. pass@k (Chen et al. 2021): the unbiased estimator 1 - C(n-c, k) / C(n, k), computed as the
   stable product 1 - prod_{i=n-c+1..n} (1 - k/i), for every k = 1, 2, 4, ..., n; its sampling
   variance for standard errors; mean, std and standard error over seeds.
2. Sampling: one engine call per seed with n samples per prompt (the paper's evaluation config:
   temperature 0.3, top-p 0.95, min-p 0.01), then grading in a pool with hard timeouts
   (task.py), per-problem correct counts, pass@k.
3. The model's identity (paths and a fingerprint) and a LoRA adapter merged in memory.
4. ``run_evaluation``: several benchmarks (data.py: by name or a local file), an atomic results
   file written after every seed, and resume (finished seeds are skipped).
5. The command line: ``python evaluate.py --model PATH ...``, and the subcommands ``plot``,
   ``patterns`` and ``perplexity`` of analysis.py.

Where this differs from the authors' evaluation: their pass@1 used the last problem's responses
only, they reported pass@k at k = n only, and they sampled with HF generate. Here every problem
counts, every power of two k is reported with a standard error, and sampling runs on vLLM, one
call per seed over all benchmarks (n = 256 on ~500 problems keeps a few GB of token ids and
log-probs in host memory for the duration of a call).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from peft import PeftModel
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import analysis
import cli
import rollout
from data import DataError, Problem, problems_fingerprint, resolve_benchmarks
from grading_pool import GradingPool
from runs import write_json_atomic, write_jsonl_atomic
from task import GRADE_TIMEOUT_S, build_prompt_ids, default_pool, grade_batch, grading_pool


class EvalError(ValueError):
    """A user-facing problem (bad input, missing data): the CLI prints it as one line."""


# --------------------------------------------------------------------------------------------
# 1. pass@k: the unbiased estimator, its variance, summaries over problems and seeds
# --------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples (Chen et al. 2021).

    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k/i) , and
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
    """Variance of the pass@k estimator when c ~ Binomial(n, p).

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
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        stderr = math.sqrt(sum(e * e for e in errors)) / len(errors)
        summary[k] = {"mean": mean, "std": std, "stderr": stderr, "num_seeds": len(values)}
    return summary


# --------------------------------------------------------------------------------------------
# 2. Sampling and grading: one engine call per seed, graded in the pool
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSampling:
    """Sampling for evaluation: the paper's evaluation config by default (section 5.1)."""

    temperature: float = 0.3
    top_p: float = 0.95
    top_k: int = -1
    min_p: float = 0.01
    max_tokens: int = 1536


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

    @property
    def grading_timeouts(self) -> int:
        return sum(map(sum, self.timed_out))

    def seed_entry(self, n: int, ks: Sequence[int], span: slice = slice(None)) -> dict:
        """The results-file entry of one benchmark (the problems in ``span``) for this seed."""
        correct, reasons = self.correct[span], self.finish_reasons[span]
        lengths = [len(ids) for row in self.token_ids[span] for ids in row]
        return {
            "correct": [sum(row) for row in correct],
            **score_counts([sum(row) for row in correct], n, ks),
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
    flat = grade_batch(
        [text for row in texts for text in row],
        [p.answer for p, row in zip(problems, texts) for _ in row],
        [p.grader for p, row in zip(problems, texts) for _ in row],
        pool=pool,
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


def evaluation_rows(engine, tokenizer, benchmarks: dict[str, Sequence[Problem]], n: int, seed: int,
                    sampling: EvalSampling, step: int) -> list[dict]:
    """pass@k of whatever the engine holds, one row per benchmark (the trainer's --eval-every):
    {step, benchmark, num_problems, n, pass@1, pass@2, ..., pass@n, pass_at_k: {k: mean, std, stderr}}."""
    rows = []
    for name, problems in benchmarks.items():
        results = evaluate_problems(engine, tokenizer, problems, n=n, seeds=(seed,), sampling=sampling, progress=False)
        rows.append({"step": step, "benchmark": name, "num_problems": len(problems), "n": n,
                     **{f"pass@{k}": value["mean"] for k, value in results["pass_at_k"].items()},
                     "pass_at_k": results["pass_at_k"]})
    return rows


# --------------------------------------------------------------------------------------------
# 3. The model: what was evaluated, and an adapter merged in memory
# --------------------------------------------------------------------------------------------


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
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return PeftModel.from_pretrained(base, adapter_path).merge_and_unload().eval()


# --------------------------------------------------------------------------------------------
# 4. A run over benchmarks: atomic results, resume
# --------------------------------------------------------------------------------------------


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


def _start_engine(args: "EvalArgs", make_engine=None):
    """The rollout engine (vLLM by default) on the model, with the adapter merged in if given:
    the engine loads the base weights from disk, then takes the merged ones in place.

    No trainer shares the GPU here, so the engine takes most of it (``--gpu-memory-utilization``
    defaults to 0.9 on CUDA) and never sleeps.
    """
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


def new_results(args: "EvalArgs", benchmarks: dict, sampling: EvalSampling, ks: list[int]) -> dict:
    """The results file of this run before any sample: what is evaluated, how, and where."""
    return {
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


def merge_existing(results: dict, out: str) -> None:
    """Take the finished seeds of an existing results file (same model, sampling and problems)."""
    if not os.path.exists(out):
        return
    with open(out) as handle:
        existing = json.load(handle)
    _check_resumable(existing, results, out)
    for name, entry in existing["benchmarks"].items():
        if name in results["benchmarks"]:
            results["benchmarks"][name]["seeds"] = entry["seeds"]
        else:
            results["benchmarks"][name] = entry  # keep what an earlier run measured
    results["runs"] = existing.get("runs", [])


def evaluate_seed(engine, pool, args: "EvalArgs", seed: int, names: list[str], benchmarks: dict, prompts: dict,
                  sampling: EvalSampling, results: dict) -> None:
    """One engine call over the benchmarks ``names`` still missing ``seed``; their entries go into
    ``results``, and the samples to --save-completions."""
    all_problems = [p for name in names for p in benchmarks[name][1]]
    all_prompts = [ids for name in names for ids in prompts[name]]
    samples = generate_and_grade(engine, all_prompts, all_problems, n=args.n, seed=seed, sampling=sampling,
                                 pool=pool, progress=args.progress)
    start = 0
    for name in names:
        span = slice(start, start + len(benchmarks[name][1]))
        start = span.stop
        results["benchmarks"][name]["seeds"][str(seed)] = samples.seed_entry(args.n, results["ks"], span)
        if args.save_completions:
            _save_completions(args.save_completions, name, seed, benchmarks[name][1], prompts[name], samples, span)
    results["runs"].append({
        "seed": seed, "benchmarks": names, "generate_s": round(samples.generate_s, 3),
        "grade_s": round(samples.grade_s, 3), "num_samples": args.n * len(all_problems),
        "grading_timeouts": samples.grading_timeouts, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })


def run_evaluation(args: "EvalArgs", make_engine=None) -> dict:
    """The CLI's work: load benchmarks, skip finished (benchmark, seed) pairs of an existing
    --out, sample and grade the rest (one engine call per seed over all benchmarks), write the
    results file atomically after every seed. Returns the results dict."""
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    if args.n < 1 or not seeds:
        raise EvalError("--n must be >= 1 and --seeds must name at least one seed")
    if args.backend not in rollout.BACKENDS:
        raise EvalError(f"unknown --backend {args.backend!r}: choose one of {', '.join(rollout.BACKENDS)}")
    benchmarks = resolve_benchmarks(args.benchmarks, args.problem_key, args.answer_key, args.grader)
    if args.limit:
        benchmarks = {name: (source, problems[: args.limit]) for name, (source, problems) in benchmarks.items()}
    sampling = EvalSampling(args.temperature, args.top_p, args.top_k, args.min_p, args.max_tokens)
    sampling_config(sampling, args.n, seeds[0])  # bad settings fail now, not after loading a model
    results = new_results(args, benchmarks, sampling, ks_up_to(args.n))
    merge_existing(results, args.out)
    todo = {seed: [name for name in benchmarks if str(seed) not in results["benchmarks"][name]["seeds"]]
            for seed in seeds}
    todo = {seed: names for seed, names in todo.items() if names}
    skipped = [seed for seed in seeds if seed not in todo]
    if skipped:
        print(f"[evaluate] {args.out}: seeds {skipped} already finished, skipped", file=sys.stderr)
    if todo:
        engine, tokenizer = _start_engine(args, make_engine)
        prompts = {name: [build_prompt_ids(tokenizer, p.problem) for p in problems]
                   for name, (_, problems) in benchmarks.items()}
        with grading_pool(num_workers=args.grading_workers, timeout_s=args.grade_timeout) as pool:
            for seed, names in tqdm(todo.items(), desc="seeds", disable=not args.progress):
                evaluate_seed(engine, pool, args, seed, names, benchmarks, prompts, sampling, results)
                write_json_atomic(args.out, recompute_summaries(results))
    recompute_summaries(results)
    write_json_atomic(args.out, results)
    return results


# --------------------------------------------------------------------------------------------
# 5. The command line
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EvalArgs:
    """python evaluate.py --model PATH [--adapter PATH] --benchmarks aime,amc23,math500-l5 --n 256 ...

    Subcommands: plot (pass@k curves), patterns (Eq. 13), perplexity (Eq. 39); `evaluate.py plot -h`.
    """

    model: str
    """Model directory (or hub name) the engine loads."""
    adapter: str | None = None
    """peft LoRA adapter directory, merged into the weights in memory."""
    benchmarks: str = "aime,amc23,math500-l5"
    """Comma-separated names (aime, amc23, math500-l5, minerva, knights-and-knaves) or .jsonl/.parquet files."""
    out: str = "results.json"
    """Results file (written atomically; re-running skips finished seeds)."""
    n: int = 256
    """Samples per problem and seed (paper: 256)."""
    seeds: str = "0,1,2"
    """Comma-separated seeds: one engine call each (paper: three)."""
    temperature: float = EvalSampling.temperature
    """Sampling temperature (the paper's evaluation config)."""
    top_p: float = EvalSampling.top_p
    """Nucleus sampling threshold."""
    top_k: int = EvalSampling.top_k
    """Top-k (-1: off)."""
    min_p: float = EvalSampling.min_p
    """Min-p."""
    max_tokens: int = EvalSampling.max_tokens
    """Max completion tokens."""
    max_model_len: int = 2048
    """Engine context length, prompt + completion (paper: 2048)."""
    problem_key: str = "problem"
    """Column holding the problem, for local files."""
    answer_key: str = "answer"
    """Column holding the reference answer, for local files."""
    grader: str = "math"
    """Grader for local files: math | knights_knaves."""
    limit: int | None = None
    """Evaluate only the first LIMIT problems of each benchmark."""
    backend: str = "vllm"
    """Rollout engine: vllm | hf (transformers generate, slow)."""
    dtype: str = "auto"
    """Engine dtype (auto, bfloat16, float32)."""
    gpu_memory_utilization: float | None = None
    """vLLM memory fraction (default: 0.9 on CUDA, the engine runs alone; on CPU the share of RAM for the KV cache, 0.05)."""
    grade_timeout: float = GRADE_TIMEOUT_S
    """Per-item grading timeout in seconds."""
    grading_workers: int | None = None
    """Grading processes (default: one per CPU core)."""
    save_completions: str | None = None
    """Directory for per-(benchmark, seed) JSONL samples (input of patterns and perplexity)."""
    progress: bool = True
    """Progress bars."""


def parse_args(kind, argv: Sequence[str], prog: str):
    """A dataclass of ``kind`` from the command line: given values over the field defaults."""
    given, _ = cli.parse(kind, argv, prog, description=kind.__doc__)
    return kind(**given)


def print_summary(results: dict) -> None:
    for name, entry in results["benchmarks"].items():
        summary = entry.get("pass_at_k") or {}
        ks = [k for k in ("1", str(max(results["ks"]))) if k in summary]
        print(f"{name}: " + ", ".join(f"pass@{k} {summary[k]['mean']:.3f} +- {summary[k]['std']:.3f}" for k in ks))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in analysis.SUBCOMMANDS:
            kind, run = analysis.SUBCOMMANDS[argv[0]]
            run(parse_args(kind, argv[1:], f"evaluate.py {argv[0]}"))
        else:
            args = parse_args(EvalArgs, argv, "evaluate.py")
            print_summary(run_evaluation(args))
            print(f"[evaluate] wrote {args.out}", file=sys.stderr)
    except (EvalError, DataError, analysis.AnalysisError, rollout.RolloutError) as error:
        print(f"evaluate.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
