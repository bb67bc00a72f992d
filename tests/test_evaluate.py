"""Claims about evaluate.py (and machinery/results.py, its results file), each checked against an
independent computation.

pass@k against brute-force enumeration of subsets and exact binomials; its variance against
exact enumeration of c ~ Binomial(n, p); grading against hand-decided cases (serial and pooled
must agree); the pool's hard timeout on an input that would run for hours; benchmarks from
local files and the one-line offline error; the whole evaluation loop (resume included) with a
scripted engine whose correct counts are known; perplexity (Eq. 39) against a per-sample loop;
and, marked slow, the CLI end to end on a tiny model with vLLM on CPU.
"""

import contextlib
import dataclasses
import doctest
import itertools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest

import evaluate
import machinery.results
import rollout
from extras import analysis, demo
from task import grading
from task.problems import DataError, Problem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_doctests_pass():
    assert doctest.testmod(evaluate).failed == 0
    assert doctest.testmod(machinery.results).failed == 0


def test_defaults_kept_beside_their_source_agree_with_it():
    assert evaluate.EvalArgs.grade_timeout == grading.GRADE_TIMEOUT_S
    assert set(evaluate.ANALYSES) == set(analysis.SUBCOMMANDS)
    config, sampling = evaluate.EvalConfig(), evaluate.EvalSampling()
    assert (config.eval_temperature, config.eval_top_p) == (sampling.temperature, sampling.top_p)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_fraction_of_subsets_holding_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_equals_exact_binomial_formula_for_random_n_c_k():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 300)
        c, k = rng.randint(0, n), rng.randint(1, n)
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert evaluate.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12), (
            n,
            c,
            k,
        )


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_inputs(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        evaluate.pass_at_k(n, c, k)


@pytest.mark.parametrize("n,k", [(1, 1), (4, 1), (4, 2), (6, 3), (8, 8), (10, 4)])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.93])
def test_pass_at_k_variance_equals_exact_enumeration_over_binomial_counts(n, k, p):
    weights = [math.comb(n, c) * p**c * (1 - p) ** (n - c) for c in range(n + 1)]
    values = [evaluate.pass_at_k(n, c, k) for c in range(n + 1)]
    mean = sum(w * v for w, v in zip(weights, values))
    variance = sum(w * (v - mean) ** 2 for w, v in zip(weights, values))
    assert mean == pytest.approx(1 - (1 - p) ** k, abs=1e-12)  # the estimator is unbiased
    assert evaluate.pass_at_k_variance(n, p, k) == pytest.approx(variance, abs=1e-12)


def test_benchmark_scores_and_seed_summary_match_direct_computation():
    n, ks = 8, evaluate.ks_up_to(8)
    per_seed = [[0, 3, 8, 1], [1, 2, 8, 0], [0, 4, 7, 2]]
    entries = [evaluate.score_counts(counts, n, ks) for counts in per_seed]
    for counts, entry in zip(per_seed, entries):
        for k in ks:
            expected = statistics.fmean(evaluate.pass_at_k(n, c, k) for c in counts)
            variance = sum(evaluate.pass_at_k_variance(n, c / n, k) for c in counts)
            assert entry["pass_at_k"][str(k)] == pytest.approx(expected)
            stderr = math.sqrt(variance) / len(counts)
            assert entry["pass_at_k_stderr"][str(k)] == pytest.approx(stderr)
    summary = evaluate.summarize_seeds(entries, ks)
    for k in ks:
        values = [e["pass_at_k"][str(k)] for e in entries]
        assert summary[str(k)]["mean"] == pytest.approx(statistics.fmean(values))
        assert summary[str(k)]["std"] == pytest.approx(statistics.stdev(values))
    assert evaluate.ks_up_to(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


FORMAT = "<start_working_out> working <end_working_out><SOLUTION> {} </SOLUTION>"


TINY_PROBLEMS = [
    {"question": f"What is {a} + {b}?", "solution": str(a + b)} for a, b in [(2, 3), (4, 4), (1, 7)]
]


def write_jsonl(path, rows):
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def pool():
    with grading.grading_pool(num_workers=2, timeout_s=60.0) as grading_pool:
        yield grading_pool


def scripted_count(a: int, seed: int, n: int) -> int:
    return (a + 2 * seed) % (n + 1)


class ScriptedEngine:
    """Answers "What is a + b?" correctly in the first (a + 2 seed) mod (n + 1) samples."""

    def __init__(self):
        self.tokenizer = demo.build_tiny_tokenizer()
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling.n, sampling.seed))
        out = []
        for prompt in prompts:
            question = self.tokenizer.decode(prompt)
            a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", question).groups())
            correct = scripted_count(a, sampling.seed, sampling.n)
            texts = [FORMAT.format(a + b if i < correct else a + b + 1) for i in range(sampling.n)]
            out.append(
                [
                    SimpleNamespace(
                        text=t, token_ids=[1, 2, 3], finish_reason="stop", logprobs=[-0.5] * 3
                    )
                    for t in texts
                ]
            )
        return out


def eval_args(**overrides):
    fields = {
        f.name: f.default
        for f in dataclasses.fields(evaluate.EvalArgs)
        if f.default is not dataclasses.MISSING
    }
    return evaluate.EvalArgs(**{**fields, "model": "scripted", "progress": False, **overrides})


def test_unknown_backend_or_no_seed_is_one_line_before_anything_loads(capsys):
    """EvalArgs checks its fields' ranges and choices when built, in code as on the command line;
    the command line also refuses seeds that name no seed."""
    with pytest.raises(ValueError, match="unknown --backend 'sglang': choose one of vllm, hf"):
        eval_args(benchmarks="aime", backend="sglang")
    for argv, said in (
        (["--backend", "sglang"], "argument --backend: invalid choice: 'sglang'"),
        (["--seeds", " , "], "--seeds  , : write comma-separated integers >= 0 such as 0,1,2"),
        (["--seeds", "0,x"], "--seeds 0,x: write comma-separated integers >= 0 such as 0,1,2"),
    ):
        with contextlib.suppress(SystemExit):  # argparse's own refusal exits 2
            assert evaluate.main(["--model", "no/such-model", *argv]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert error[-1].startswith(f"evaluate.py: error: {said}")


def test_evaluate_problems_counts_correct_samples_per_problem_and_seed(pool):
    engine = ScriptedEngine()
    problems = [Problem(row["question"], row["solution"]) for row in TINY_PROBLEMS]
    n = 4
    out = evaluate.evaluate_problems(
        engine, engine.tokenizer, problems, n=n, seeds=[0, 1], pool=pool
    )
    assert engine.calls == [(3, 4, 0), (3, 4, 1)]  # one call per seed, n samples per prompt
    for seed in (0, 1):
        counts = [scripted_count(int(row["question"].split()[2]), seed, n) for row in TINY_PROBLEMS]
        assert out["seeds"][str(seed)]["correct"] == counts
        expected = evaluate.score_counts(counts, n, [1, 2, 4])["pass_at_k"]
        assert out["seeds"][str(seed)]["pass_at_k"] == expected


def test_a_resumed_files_support_probe_is_made_again_when_the_fields_it_read_change(
    tmp_path, monkeypatch
):
    """A results file's support probe is kept on resume only if it read the same fields: another
    --solution-format (or --solution-key, --group-key) probes again, and a run that probes
    nothing keeps what an earlier run measured."""
    rows = [{**row, "working": row["question"][8:-1]} for row in TINY_PROBLEMS]
    bench = write_jsonl(tmp_path / "sums.jsonl", rows)
    out = str(tmp_path / "results.json")
    probed = []

    def probe(args, benchmarks, results):
        probed.append(args.solution_format)
        for name in benchmarks:
            results["benchmarks"][name]["support"] = {"made with": args.solution_format}

    monkeypatch.setattr(evaluate, "probe_benchmarks", probe)
    for solution_key, solution_format in [
        ("working", "paper"),
        ("working", "paper"),  # the same fields: kept
        ("working", "prefix"),  # another format: probed again
        ("", "paper"),  # no probe asked: the last one kept
    ]:
        args = eval_args(
            benchmarks=bench,
            problem_key="question",
            answer_key="solution",
            solution_key=solution_key,
            solution_format=solution_format,
            n=2,
            seeds="0",
            out=out,
            grading_workers=1,
        )
        evaluate.run_evaluation(args, make_engine=lambda *args, **kwargs: ScriptedEngine())
    assert probed == ["paper", "prefix"]
    with open(out) as handle:
        entry = json.load(handle)["benchmarks"]["sums"]
    assert entry["support"] == {"made with": "prefix"}
    assert entry["probe"] == {
        "solution_key": "working",
        "group_key": "",
        "solution_format": "prefix",
    }


@pytest.mark.parametrize("text", ["notes\n", "[1, 2]\n", '{"model": "m"}\n', "\x80\x81"])
def test_an_out_that_is_not_a_results_file_is_one_line(tmp_path, text):
    """--out naming a file evaluate.py did not write (text, a JSON list, a dict without
    benchmarks, bytes that are not UTF-8): one line, before any work (it was a traceback)."""
    path = tmp_path / "notes.txt"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(DataError, match=r"notes.txt is not a results file of evaluate.py; pass"):
        machinery.results.merge_existing({}, str(path))
    assert path.read_bytes() == text.encode("latin-1")  # left as it was


def test_run_evaluation_writes_recomputable_results_and_resumes_only_missing_seeds(tmp_path):
    bench = write_jsonl(tmp_path / "sums.jsonl", TINY_PROBLEMS)
    more = write_jsonl(
        tmp_path / "more.jsonl",
        [
            {"question": "What is 3 + 1?", "solution": "4"},
            {"question": "What is 0 + 5?", "solution": "5"},
        ],
    )
    out = str(tmp_path / "results.json")
    engines = []

    def make_engine(*args, **kwargs):
        engines.append(ScriptedEngine())
        return engines[-1]

    args = eval_args(
        benchmarks=f"{bench},{more}",
        problem_key="question",
        answer_key="solution",
        n=4,
        seeds="0,1",
        out=out,
        grading_workers=1,
        save_completions=str(tmp_path / "samples"),
    )
    evaluate.run_evaluation(args, make_engine=make_engine)
    with open(out) as handle:
        results = json.load(handle)
    entry = results["benchmarks"]["sums"]
    assert results["ks"] == [1, 2, 4] and sorted(entry["seeds"]) == ["0", "1"]
    for name, firsts in (("sums", (2, 4, 1)), ("more", (3, 0))):
        for seed, seed_entry in results["benchmarks"][name]["seeds"].items():
            assert seed_entry["correct"] == [scripted_count(a, int(seed), 4) for a in firsts]
            for k in results["ks"]:  # pass@k values equal a recomputation from the stored counts
                recomputed = statistics.fmean(
                    evaluate.pass_at_k(4, c, k) for c in seed_entry["correct"]
                )
                assert seed_entry["pass_at_k"][str(k)] == pytest.approx(recomputed, abs=1e-15)
    assert results["average"]["4"] == pytest.approx(
        statistics.fmean(
            results["benchmarks"][name]["pass_at_k"]["4"]["mean"] for name in ("sums", "more")
        )
    )
    assert results["sampling"] == {
        "n": 4,
        "temperature": 0.3,
        "top_p": 0.95,
        "top_k": -1,
        "min_p": 0.01,
        "max_tokens": 1536,
        "max_model_len": 2048,
        "backend": "vllm",
        "dtype": "auto",
    }
    # one call per seed, both files
    assert len(engines) == 1 and engines[0].calls == [(5, 4, 0), (5, 4, 1)]
    assert [run["num_samples"] for run in results["runs"]] == [20, 20]
    saved = [json.loads(line) for line in open(tmp_path / "samples" / "more.seed1.jsonl")]
    assert [row["problem"] for row in saved] == ["What is 3 + 1?", "What is 0 + 5?"]
    assert [sum(c["correct"] for c in row["completions"]) for row in saved] == [
        scripted_count(a, 1, 4) for a in (3, 0)
    ]  # the second benchmark's own samples
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp-")]  # atomic writes

    # Same --out, one more seed: only seed 2 is sampled; with nothing left, no engine starts.
    evaluate.run_evaluation(dataclasses.replace(args, seeds="0,1,2"), make_engine=make_engine)
    assert len(engines) == 2 and [call[2] for call in engines[1].calls] == [2]
    evaluate.run_evaluation(dataclasses.replace(args, seeds="0,1,2"), make_engine=make_engine)
    assert len(engines) == 2
    with open(out) as handle:
        resumed = json.load(handle)
    assert resumed["benchmarks"]["sums"]["seeds"]["0"] == entry["seeds"]["0"]
    assert resumed["benchmarks"]["sums"]["pass_at_k"]["1"]["num_seeds"] == 3

    # Other sampling settings may not be mixed into the same file.
    with pytest.raises(ValueError, match="different sampling.*another --out"):
        evaluate.run_evaluation(dataclasses.replace(args, temperature=1.0), make_engine=make_engine)


def test_model_identity_hashes_the_adapters_bytes_and_the_weights_sizes(tmp_path):
    model, adapter = tmp_path / "model", tmp_path / "adapter"
    model.mkdir()
    adapter.mkdir()
    (model / "config.json").write_text('{"architectures": ["Toy"]}')
    (model / "model.safetensors").write_bytes(b"weights")
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"a")
    identity = machinery.results.model_identity
    first = identity(str(model), str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"b")  # same size, other bytes
    second = identity(str(model), str(adapter))
    assert first["architectures"] == ["Toy"] and first["fingerprint"] != second["fingerprint"]
    (model / "model.safetensors").write_bytes(b"other!!")  # same size: weights' bytes are not read
    assert identity(str(model), str(adapter))["fingerprint"] == second["fingerprint"]
    with pytest.raises(DataError, match="not a peft adapter directory"):
        identity(str(model), str(model))


@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_model_with_an_adapter(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(base, lora)
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)  # a visible change of the weights
    adapter = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter)
    # One-digit answers: the random model writes digits now and then, so a few samples score
    # (math-verify reads the last number of the text when there is no <SOLUTION> block).
    bench = write_jsonl(
        tmp_path / "digits.jsonl", [{"problem": f"Say {d}.", "answer": str(d)} for d in range(10)]
    )
    out, samples = str(tmp_path / "results.json"), str(tmp_path / "samples")
    command = [
        sys.executable,
        "evaluate.py",
        "--model",
        tiny_model_dir,
        "--adapter",
        adapter,
        "--benchmarks",
        bench,
        "--n",
        "32",
        "--seeds",
        "0,1",
        "--max-tokens",
        "128",
        "--temperature",
        "1.0",
        "--top-p",
        "1.0",
        "--min-p",
        "0",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--save-completions",
        samples,
        "--out",
        out,
        "--no-progress",
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out) as handle:
        results = json.load(handle)
    assert results["model"]["adapter"] == os.path.abspath(adapter)
    assert results["ks"] == [1, 2, 4, 8, 16, 32]
    entry = results["benchmarks"]["digits"]
    for seed in ("0", "1"):
        rows = [
            json.loads(line) for line in open(os.path.join(samples, f"digits.seed{seed}.jsonl"))
        ]
        regraded = [
            sum(grading.grade(c["text"], row["answer"]) for c in row["completions"]) for row in rows
        ]
        # counts = a serial regrade of the samples
        assert entry["seeds"][seed]["correct"] == regraded
        for k in results["ks"]:  # pass@k = a recomputation from the file's own counts
            recomputed = statistics.fmean(
                evaluate.pass_at_k(32, c, k) for c in entry["seeds"][seed]["correct"]
            )
            assert entry["seeds"][seed]["pass_at_k"][str(k)] == pytest.approx(recomputed, abs=1e-15)
    # About 1% of random samples score: ~8 expected of 640, so that no sample scoring has a chance
    # of about e^-8 on any device's sample stream (at 320 samples it was e^-4, 2%, on a stream
    # other than the CPU's): the checks above are not 0 == 0.
    assert sum(sum(entry["seeds"][seed]["correct"]) for seed in ("0", "1")) > 0, "no sample scored"

    # The engine sampled from the merged weights: its log-probs match the merged model, not the
    # base.
    merged = machinery.results.load_merged_model(tiny_model_dir, adapter, "float32")
    completions = [
        (row["prompt_ids"], c) for row in rows for c in row["completions"] if c["token_ids"]
    ][:6]

    def total_logprob(model, prompt_ids, token_ids):
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].double()
        logps = logits.log_softmax(-1)[len(prompt_ids) - 1 : -1]
        return logps.gather(-1, torch.tensor(token_ids)[:, None]).sum().item()

    for prompt_ids, completion in completions:
        engine = completion["logprob"]
        expected = total_logprob(merged, prompt_ids, completion["token_ids"])
        assert engine == pytest.approx(expected, abs=1e-2)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gaps = [abs(c["logprob"] - total_logprob(plain, p, c["token_ids"])) for p, c in completions]
    assert max(gaps) > 0.1

    # Re-running with the same --out skips the finished seeds without starting an engine.
    def no_engine(*args, **kwargs):
        raise AssertionError("the rerun started an engine")

    monkeypatch.setattr(rollout, "make_engine", no_engine)
    capsys.readouterr()
    assert evaluate.main([str(arg) for arg in command[2:]]) == 0
    assert f"{out}: seeds [0, 1] already finished, skipped" in capsys.readouterr().err
    with open(out) as handle:
        assert json.load(handle)["benchmarks"]["digits"]["seeds"] == entry["seeds"]
