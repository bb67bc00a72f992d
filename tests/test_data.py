"""data.py: one loader for training rows, SFT rows and benchmarks; the problems, the prompt sampler,
and SFT examples that are never cut."""

import json
import os
import subprocess
import sys

import pytest

from machinery import data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_without_an_answer_are_an_error():
    rows = [{"prompt": "1+1", "solution": "2"}, {"prompt": "2+2", "solution": ""}]
    with pytest.raises(data.DataError, match="row 1 has no answer"):
        data.training_problems(rows, "prompt", "solution", 0, "data.jsonl")
    with pytest.raises(data.DataError, match="--problem-key"):
        data.training_problems(rows, "question", "solution", 0, "data.jsonl")


def test_local_dataset_loads_and_missing_dataset_is_one_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"{i}+1", "solution": str(i + 1)}) for i in range(5))
    )
    problems = data.training_problems(data.load_rows(str(path)), "prompt", "solution", 3, str(path))
    assert problems == [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(3)]
    with pytest.raises(data.DataError, match="cannot load dataset") as error:
        data.load_rows("no-such-user/no-such-dataset-xyz")
    assert "\n" not in str(error.value)


def test_prompt_sampler_resumes_exactly():
    sampler = data.PromptSampler(10, seed=0)
    first = sampler.take(7)
    state = sampler.state_dict()
    rest = sampler.take(9)
    resumed = data.PromptSampler(10, seed=0)
    resumed.load_state_dict(state)
    assert resumed.take(9) == rest
    assert sorted(first + rest[:3]) == list(range(10))  # one epoch is a permutation


def test_sft_examples_are_never_cut_and_keep_the_closing_format(tmp_path, tiny):
    """OpenMathReasoning rows run to thousands of tokens: a cut example would lose </SOLUTION> and
    EOS and teach the model not to close the format. Long rows are dropped whole instead."""
    _, tokenizer = tiny
    rows = [
        {
            "problem": "What is 2 + 2?",
            "generated_solution": "<think>\n2+2=4\n</think>\nSo it is 4.",
            "expected_answer": "4",
        },
        {
            "problem": "What is 3 + 4?",
            "generated_solution": "<think>" + "3+4 " * 200 + "</think>",
            "expected_answer": "7",
        },
        {
            "problem": "Name the sum.",
            "generated_solution": "It is seven.",
            "expected_answer": "seven",
        },
        {"problem": "What is 1 + 5?", "generated_solution": "1+5=6", "expected_answer": "6"},
    ]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    examples, not_numeric = data.sft_examples(
        data.load_rows(path), "problem", "generated_solution", "expected_answer", path
    )
    assert not_numeric == 1 and len(examples) == 3
    pairs, stats = data.tokenize_sft_examples(tokenizer, examples, max_tokens=128)
    assert stats["kept"] == 2 and stats["dropped_too_long"] == 1 and stats["max_tokens"] == 128
    closing = tokenizer("</SOLUTION>", add_special_tokens=False)["input_ids"]
    for prompt, completion in pairs:
        assert len(prompt) + len(completion) <= 128
        assert completion[-1] == tokenizer.eos_token_id
        assert completion[-1 - len(closing) : -1] == closing
        assert "think>" not in tokenizer.decode(completion)
    assert tokenizer.decode(pairs[0][1][:-1]).startswith("<start_working_out>2+2=4")
    first, _ = data.tokenize_sft_examples(tokenizer, examples, max_tokens=128, max_samples=1)
    assert first == pairs[:1]
    with pytest.raises(data.DataError, match="no SFT example fits in 10 tokens"):
        data.tokenize_sft_examples(tokenizer, examples, max_tokens=10)


TINY_PROBLEMS = [
    {"question": f"What is {a} + {b}?", "solution": str(a + b)} for a, b in [(2, 3), (4, 4), (1, 7)]
]


def test_local_jsonl_parquet_and_csv_benchmarks_load_with_custom_keys(tmp_path):
    import datasets

    jsonl = write_jsonl(tmp_path / "tiny.jsonl", TINY_PROBLEMS)
    parquet, csv = str(tmp_path / "tiny2.parquet"), str(tmp_path / "tiny3.csv")
    datasets.Dataset.from_list(TINY_PROBLEMS).to_parquet(parquet)
    datasets.Dataset.from_list(TINY_PROBLEMS).to_csv(csv, index=False)
    expected = [data.Problem(row["question"], row["solution"]) for row in TINY_PROBLEMS]
    resolved = data.resolve_benchmarks(f"{jsonl},{parquet},{csv}", "question", "solution")
    assert list(resolved) == ["tiny", "tiny2", "tiny3"]
    assert all(problems == expected for _, problems in resolved.values())
    with pytest.raises(
        data.DataError, match="has no field 'problem' .*question, solution.*--problem-key"
    ):
        data.resolve_benchmarks(jsonl)
    (tmp_path / "tiny.txt").write_text("1 + 1")
    with pytest.raises(data.DataError, match="unknown file type '.txt'"):
        data.load_rows(str(tmp_path / "tiny.txt"))


def test_hub_benchmark_offline_and_not_cached_fails_with_one_line_naming_the_fix(tmp_path):
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf")
    )
    result = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            "--model",
            str(tmp_path),
            "--benchmarks",
            "aime",
            "--out",
            str(tmp_path / "r.json"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "benchmark 'aime'" in lines[0] and "--problem-key" in lines[0] and "internet" in lines[0]
    assert lines[0].startswith("evaluate.py: error:")
