"""evaluate.py's results file and what it records: the model, the file's layout, resume, samples.

1. The model: what was evaluated (paths and a fingerprint), and the engine on it, a LoRA
   adapter merged into its weights in memory.
2. The results file: its layout before any sample (``new_results``), and resume: an existing file
   for the same model, sampling and problems gives its finished seeds (``merge_existing``), and
   the seeds still to sample (``pending_seeds``).
3. A seed's samples into the file (``record_seed``), and saved per (benchmark, seed) for the
   analyses (``--save-completions``).

A problem with the model or the file raises ``DataError`` (task/problems.py), one starting the
engine ``rollout.RolloutError``: evaluate.py prints either as one line. Like all of machinery/,
this module imports no chapter: it reads what it needs off the objects evaluate.py passes
(``EvalArgs``, ``EvalSampling``, ``SeedSamples``, the engine's maker).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time

import torch

from machinery.runs import write_jsonl_atomic
from task.problems import DataError

# --------------------------------------------------------------------------------------------
# 1. The model: what was evaluated, and the engine on it (an adapter merged in memory)
# --------------------------------------------------------------------------------------------


def model_identity(model_path: str, adapter_path: str | None = None) -> dict:
    """What was evaluated: paths, the config's name and architectures, and a fingerprint.

    The fingerprint hashes config.json, the names and sizes of the weight files (not their
    bytes: a 7B model would take a minute) and the full bytes of the adapter's files.

    >>> model_identity("org/hub-model")["path"]
    'org/hub-model'
    """
    identity = {
        "path": os.path.abspath(model_path) if os.path.isdir(model_path) else model_path,
        "adapter": os.path.abspath(adapter_path) if adapter_path else None,
    }
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
            raise DataError(
                f"--adapter {adapter_path} is not a peft adapter directory (no adapter_config.json)"
            )
        for name in sorted(os.listdir(adapter_path)):
            if name.startswith("adapter_"):
                with open(os.path.join(adapter_path, name), "rb") as handle:
                    file_sha256 = hashlib.file_digest(handle, "sha256").hexdigest()
                digest.update(f"{name}:{file_sha256}".encode())
    identity["fingerprint"] = digest.hexdigest()
    return identity


def load_merged_model(model_path: str, adapter_path: str | None, dtype: str):
    """The model evaluated: the base, with a peft LoRA adapter (if given) merged into its weights
    in memory (no copy on disk); the engine takes merged weights through ``sync_weights``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    if not adapter_path:
        return base
    return PeftModel.from_pretrained(base, adapter_path).merge_and_unload().eval()


def start_engine(args, make_engine, cuda_fraction: float):
    """The rollout engine that ``make_engine`` (``rollout.make_engine``, or for --backend hf that
    of extras/hf_engine.py) starts on the model of evaluate.EvalArgs ``args``, with the adapter
    merged in if given: the engine loads the base weights from disk, then takes the merged ones
    in place.

    No trainer shares the GPU here, so the engine takes most of it (``--gpu-memory-utilization``
    defaults to ``cuda_fraction`` on CUDA) and never sleeps.
    """
    fraction = args.gpu_memory_utilization
    if fraction is None and torch.cuda.is_available():
        fraction = cuda_fraction
    merged = load_merged_model(args.model, args.adapter, args.dtype) if args.adapter else None
    return make_engine(
        args.model,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        gpu_memory_utilization=fraction,
        seed=0,
        model=merged,
        **({"enable_sleep_mode": False} if args.backend == "vllm" else {}),
    )


# --------------------------------------------------------------------------------------------
# 2. The results file: its layout, and resume from an existing one
# --------------------------------------------------------------------------------------------


def new_results(args, benchmarks: dict, sampling, ks: list[int]) -> dict:
    """The results file of a run (evaluate.EvalArgs ``args``, {name: (source, problems)},
    evaluate.EvalSampling) before any sample: what is evaluated, how, and where."""
    return {
        "format": "sage-rl/evaluate/1",
        "model": model_identity(args.model, args.adapter),
        "sampling": {
            "n": args.n,
            **dataclasses.asdict(sampling),
            "max_model_len": args.max_model_len,
            "backend": args.backend,
            "dtype": args.dtype,
        },
        "ks": ks,
        "benchmarks": {
            name: {
                "source": source,
                "num_problems": len(problems),
                "problems_sha256": problems_fingerprint(problems),
                "seeds": {},
            }
            for name, (source, problems) in benchmarks.items()
        },
        "runs": [],
    }


def problems_fingerprint(problems) -> str:
    """sha256 of the problems, answers and graders (a resumed run must see the same ones)."""
    payload = json.dumps([(p.problem, p.answer, p.grader) for p in problems], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def merge_existing(results: dict, out: str) -> None:
    """Take the finished seeds of an existing results file, which resumes only the same model,
    sampling, ks and problems."""
    if not os.path.exists(out):
        return
    with open(out) as handle:
        try:
            existing = json.load(handle)
        except ValueError:  # (JSONDecodeError, UnicodeDecodeError)
            existing = None
    if not isinstance(existing, dict) or not isinstance(existing.get("benchmarks"), dict):
        raise DataError(f"--out {out} is not a results file of evaluate.py; pass another --out")
    for key in ("model", "sampling", "ks"):
        if existing.get(key) != results[key]:
            raise DataError(
                f"{out} holds results for a different {key} ({existing.get(key)} != "
                f"{results[key]}); pass another --out or delete the file"
            )
    for name, entry in results["benchmarks"].items():
        old = existing.get("benchmarks", {}).get(name)
        if old and old["problems_sha256"] != entry["problems_sha256"]:
            raise DataError(
                f"{out}: benchmark {name!r} changed since the last run; pass another --out"
            )
    for name, entry in existing["benchmarks"].items():
        if name in results["benchmarks"]:
            results["benchmarks"][name]["seeds"] = entry["seeds"]
            for key in ("support", "probe"):  # the support probe and the fields it read
                if key in entry:
                    results["benchmarks"][name][key] = entry[key]
        else:
            results["benchmarks"][name] = entry  # keep what an earlier run measured
    results["runs"] = existing.get("runs", [])


def pending_seeds(results: dict, seeds: list[int], names: list[str], out: str) -> dict:
    """{seed: the benchmarks of ``names`` still missing it}, seeds with none left out (and said
    so on stderr).

    >>> results = {"benchmarks": {"aime": {"seeds": {"0": {}}}, "amc23": {"seeds": {}}}}
    >>> pending_seeds(results, [0, 1], ["aime"], "results.json")
    {1: ['aime']}
    """
    todo = {
        seed: [name for name in names if str(seed) not in results["benchmarks"][name]["seeds"]]
        for seed in seeds
    }
    todo = {seed: names for seed, names in todo.items() if names}
    skipped = [seed for seed in seeds if seed not in todo]
    if skipped:
        print(f"[evaluate] {out}: seeds {skipped} already finished, skipped", file=sys.stderr)
    return todo


# --------------------------------------------------------------------------------------------
# 3. A seed's samples: into the results file, and saved for the analyses
# --------------------------------------------------------------------------------------------


def save_completions(
    directory: str, name: str, seed: int, problems, prompts, samples, span: slice
) -> None:
    """One JSONL per (benchmark, seed): a row per problem with its samples (evaluate.SeedSamples
    ``samples``, the problems of this benchmark at ``span``)."""
    fields = {
        "text": samples.texts,
        "token_ids": samples.token_ids,
        "finish_reason": samples.finish_reasons,
        "correct": samples.correct,
        "logprob": samples.logprob_sums,
    }
    rows = []
    for index, (problem, prompt_ids) in enumerate(zip(problems, prompts)):
        columns = [values[span.start + index] for values in fields.values()]
        rows.append(
            {
                "benchmark": name,
                "seed": seed,
                "problem_index": index,
                "problem": problem.problem,
                "answer": problem.answer,
                "grader": problem.grader,
                "prompt_ids": prompt_ids,
                "completions": [dict(zip(fields, values)) for values in zip(*columns)],
            }
        )
    write_jsonl_atomic(os.path.join(directory, f"{name}.seed{seed}.jsonl"), rows)


def record_seed(results: dict, args, seed: int, benchmarks: dict, samples) -> None:
    """One seed's samples (evaluate.SeedSamples over ``benchmarks`` {name: (problems,
    prompts)}, one after the other) into ``results``: an entry per benchmark, the samples to
    --save-completions, and a record of the engine call."""
    start = 0
    for name, (problems, prompts) in benchmarks.items():
        span = slice(start, start + len(problems))
        start = span.stop
        results["benchmarks"][name]["seeds"][str(seed)] = samples.seed_entry(
            args.n, results["ks"], span
        )
        if args.save_completions:
            save_completions(args.save_completions, name, seed, problems, prompts, samples, span)
    results["runs"].append(
        {
            "seed": seed,
            "benchmarks": list(benchmarks),
            "generate_s": round(samples.generate_s, 3),
            "grade_s": round(samples.grade_s, 3),
            "num_samples": args.n * start,
            "grading_timeouts": sum(map(sum, samples.timed_out)),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    )
