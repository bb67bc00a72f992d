"""analysis.py: Eq. 13's pattern frequencies by hand, Eq. 39's perplexity against a per-sample loop,
and the plot / patterns / perplexity subcommands of evaluate.py on saved files."""

import json
import math
import random

import pytest

import analysis
import demo
import evaluate


def write_jsonl(path, rows):
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def test_patterns_and_plot_subcommands_on_saved_results(tmp_path):
    samples = tmp_path / "base"
    samples.mkdir()
    rows = [
        {"benchmark": "b", "seed": 0, "problem_index": 0, "problem": "p", "answer": "1", "prompt_ids": [1],
         "completions": [{"text": "Let x be 1.", "correct": True}, {"text": "Direct.", "correct": True},
                         {"text": "Let y be 2.", "correct": False}]},
        {"benchmark": "b", "seed": 0, "problem_index": 1, "problem": "q", "answer": "2", "prompt_ids": [1],
         "completions": [{"text": "Assume for contradiction that ...", "correct": True}]},
    ]
    path = write_jsonl(samples / "b.seed0.jsonl", rows)
    assert evaluate.main(["patterns", f"base={path}", "--out", str(tmp_path / "patterns.json")]) == 0
    with open(tmp_path / "patterns.json") as handle:
        table = json.load(handle)
    # Eq. 13 by hand: constraint setup (1/2 + 0) / 2, contradiction (0 + 1) / 2.
    assert table["base"] == {"constraint_setup": 0.25, "structural_reasoning": 0.0,
                             "proof_by_contradiction": 0.5, "num_problems": 2}

    results = {"model": {"path": "/m/base", "adapter": None}, "ks": [1, 2],
               "benchmarks": {"b": {"pass_at_k": {"1": {"mean": 0.2, "std": 0.01}, "2": {"mean": 0.3, "std": 0.02}}}}}
    for name in ("a.json", "b.json"):
        with open(tmp_path / name, "w") as handle:
            json.dump(results, handle)
    out = tmp_path / "passk.png"
    assert evaluate.main(["plot", f"GRPO={tmp_path / 'a.json'}", str(tmp_path / "b.json"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perplexity_equals_a_per_sample_log_softmax_loop():
    import torch

    tokenizer = demo.build_tiny_tokenizer()
    model = demo.build_tiny_model(tokenizer, seed=3).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 9))] for _ in range(5)]
    completions = [[rng.randrange(256) for _ in range(rng.randint(1, 7))] for _ in range(5)]
    got = analysis.completion_perplexities(model, prompts, completions, batch_size=2, progress=False)
    for prompt, completion, value in zip(prompts, completions, got):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0].double()
        logps = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(completion)[:, None])
        assert value == pytest.approx(math.exp(-logps.mean().item()), rel=1e-5)


def test_perplexity_subcommand_scores_saved_completions_under_the_base_model(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    paths = {}
    for label in ("grpo", "branch"):
        rows = [{"benchmark": "b", "seed": 0, "problem_index": index, "problem": "p", "answer": "1",
                 "prompt_ids": [rng.randrange(256) for _ in range(6)],
                 "completions": [{"token_ids": [rng.randrange(256) for _ in range(rng.randint(2, 9))],
                                  "correct": i % 2 == 0, "text": ""} for i in range(4)]}
                for index in range(2)]
        paths[label] = write_jsonl(tmp_path / f"{label}.jsonl", rows)
    out = tmp_path / "ppl.png"
    command = ["perplexity", "--base-model", tiny_model_dir, "--problems", "b:1", "--only-correct",
               "--out", str(out), "--no-progress"] + [f"{label}={path}" for label, path in paths.items()]
    assert evaluate.main(command) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "ppl.json") as handle:
        values = json.load(handle)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for label, path in paths.items():
        row = [json.loads(line) for line in open(path)][1]
        correct = [c["token_ids"] for c in row["completions"] if c["correct"]]
        expected = analysis.completion_perplexities(model, [row["prompt_ids"]] * 2, correct, progress=False)
        assert values["b:1"][label] == pytest.approx(expected, rel=1e-5)
