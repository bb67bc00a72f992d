"""task/: one loader for training rows and benchmarks, the problems and the
prompt sampler; the answer format, grading against hand-decided cases (serial and pooled must
agree), and the pool's hard timeout on an input that would run for hours."""

import json
import os
import subprocess
import sys
import time

import pytest

from task import grading
from task.problems import (
    DataError,
    Problem,
    PromptSampler,
    load_rows,
    resolve_benchmarks,
    training_problems,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_without_an_answer_are_an_error():
    rows = [{"prompt": "1+1", "solution": "2"}, {"prompt": "2+2", "solution": ""}]
    with pytest.raises(DataError, match="row 1 has no answer"):
        training_problems(rows, "prompt", "solution", 0, "data.jsonl")
    with pytest.raises(DataError, match="--problem-key"):
        training_problems(rows, "question", "solution", 0, "data.jsonl")


def test_local_dataset_loads_and_missing_dataset_is_one_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"{i}+1", "solution": str(i + 1)}) for i in range(5))
    )
    problems = training_problems(load_rows(str(path)), "prompt", "solution", 3, str(path))
    assert problems == [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(3)]
    with pytest.raises(DataError, match="cannot load dataset") as error:
        load_rows("no-such-user/no-such-dataset-xyz")
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="No such file or directory") as error:
        load_rows(str(tmp_path / "missing.jsonl"))  # a local file's own line
    assert "\n" not in str(error.value) and "missing.jsonl" in str(error.value)


def test_prompt_sampler_resumes_exactly():
    sampler = PromptSampler(10, seed=0)
    first = sampler.take(7)
    state = sampler.state_dict()
    rest = sampler.take(9)
    resumed = PromptSampler(10, seed=0)
    resumed.load_state_dict(state)
    assert resumed.take(9) == rest
    assert sorted(first + rest[:3]) == list(range(10))  # one epoch is a permutation


TINY_PROBLEMS = [
    {"question": f"What is {a} + {b}?", "solution": str(a + b)} for a, b in [(2, 3), (4, 4), (1, 7)]
]


def test_a_benchmark_row_without_an_answer_or_a_second_file_of_one_name_is_one_line(tmp_path):
    """A null answer was graded as the text "None" (a completion answering None scored), an
    empty one never matched; two files of one stem kept the second alone, without a word."""
    rows = [{"problem": "1 + 1", "answer": "2"}, {"problem": "2 + 2", "answer": None}]
    with pytest.raises(DataError, match="row 1 has no answer in field 'answer'"):
        resolve_benchmarks(write_jsonl(tmp_path / "nulls.jsonl", rows))
    rows[1]["answer"] = " "
    with pytest.raises(DataError, match="row 1 has no answer in field 'answer'"):
        resolve_benchmarks(write_jsonl(tmp_path / "blanks.jsonl", rows))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_jsonl(tmp_path / "a" / "test.jsonl", rows[:1])
    second = write_jsonl(tmp_path / "b" / "test.jsonl", rows[:1])
    for twice in (f"{first},{second}", f"{first},{first}"):
        with pytest.raises(DataError, match="--benchmarks has 'test' twice: give a file once"):
            resolve_benchmarks(twice)


def test_local_jsonl_parquet_and_csv_benchmarks_load_with_custom_keys(tmp_path):
    """The files are written with pyarrow and the csv module, not through an in-memory
    datasets.Dataset: only the reading is the project's."""
    import csv

    import pyarrow
    import pyarrow.parquet

    jsonl = write_jsonl(tmp_path / "tiny.jsonl", TINY_PROBLEMS)
    parquet, csv_path = str(tmp_path / "tiny2.parquet"), str(tmp_path / "tiny3.csv")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(TINY_PROBLEMS), parquet)
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["question", "solution"])
        writer.writeheader()
        writer.writerows(TINY_PROBLEMS)
    expected = [Problem(row["question"], row["solution"]) for row in TINY_PROBLEMS]
    resolved = resolve_benchmarks(f"{jsonl},{parquet},{csv_path}", "question", "solution")
    assert list(resolved) == ["tiny", "tiny2", "tiny3"]
    assert all(problems == expected for _, problems in resolved.values())
    with pytest.raises(
        DataError, match="has no field 'problem' .*question, solution.*--problem-key"
    ):
        resolve_benchmarks(jsonl)
    (tmp_path / "tiny.txt").write_text("1 + 1")
    with pytest.raises(DataError, match="unknown file type '.txt'"):
        load_rows(str(tmp_path / "tiny.txt"))


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


FORMAT = "<start_working_out> working <end_working_out><SOLUTION> {} </SOLUTION>"


GRADING_CASES = [
    # the same half, written three ways, each way as reference and as answer
    (FORMAT.format("1/2"), "0.5", True),
    (FORMAT.format("0.5"), "\\frac{1}{2}", True),
    (FORMAT.format("\\frac{1}{2}"), "1/2", True),
    (FORMAT.format("\\dfrac12"), "0.5", True),
    # boxed, inside the block and in free text (no block: math-verify reads the whole text)
    (FORMAT.format("\\boxed{42}"), "42", True),
    ("We conclude that the answer is $\\boxed{\\frac{3}{4}}$.", "0.75", True),
    # sets and intervals (bare LaTeX inside the block is read as LaTeX)
    (FORMAT.format("\\{3, 1, 2\\}"), "\\{1,2,3\\}", True),
    (FORMAT.format("\\{1, 2\\}"), "\\{1,2,3\\}", False),
    (FORMAT.format("(1, 2]"), "(1,2]", True),
    (FORMAT.format("[1, 2)"), "(1,2]", False),
    (FORMAT.format("[0, \\infty)"), "[0,\\infty)", True),
    # e-notation is a power of ten, in the reference and in the answer (not 7.5 times Euler's e,
    # minus 8: then the right answers failed and "7.5 e - 8" passed)
    (FORMAT.format("7.5 \\times 10^{-8}"), "7.5e-8", True),
    (FORMAT.format("7.5 e - 8"), "7.5e-8", False),
    (FORMAT.format("6.02e23"), "6.02 \\times 10^{23}", True),
    (FORMAT.format("2E3"), "2000", True),
    (FORMAT.format("2e4"), "2000", False),
    # the same, in $...$, \\boxed{} and free text (math-verify's own extraction)
    ("The answer is \\boxed{7.5e-8}.", "7.5e-8", True),
    (FORMAT.format("$7.5e-8$"), "0.000000075", True),
    (FORMAT.format("\\boxed{2e3}"), "2e3", True),
    ("so the answer is $6.02e23$", "6.02 \\times 10^{23}", True),
    # the block wins over numbers in the working out
    ("<start_working_out> 12 <end_working_out><SOLUTION> 7 </SOLUTION>", "12", False),
    # wrong, empty and garbage
    (FORMAT.format("13"), "12", False),
    (FORMAT.format(""), "12", False),
    ("", "12", False),
    (FORMAT.format("}}{{$$\\frac{"), "12", False),
    ("\x00\x01 no answer at all", "12", False),
    (FORMAT.format("12"), "", False),  # an empty reference is never matched
]


@pytest.mark.parametrize("completion,answer,expected", GRADING_CASES)
def test_grade_decides_hand_checked_cases(completion, answer, expected):
    assert grading.grade(completion, answer) is expected


def test_extract_solution_takes_the_last_block():
    assert grading.extract_solution("<SOLUTION>1</SOLUTION> then <SOLUTION> 2 </SOLUTION>") == "2"
    assert grading.extract_solution("<SOLUTION> truncated") is None


def test_knights_and_knaves_grader_matches_every_role():
    reference = "(1) Zoey is a knave\n(2) Oliver is a knight"
    assert grading.grade(
        "<SOLUTION> (1) Zoey is a knave (2) Oliver is a knight </SOLUTION>",
        reference,
        "knights_knaves",
    )
    assert not grading.grade(
        "<SOLUTION> Zoey is a knight, Oliver is a knight </SOLUTION>", reference, "knights_knaves"
    )
    assert not grading.grade("<SOLUTION> Zoey is a knave </SOLUTION>", reference, "knights_knaves")
    # without a block, the last role stated for each person counts
    assert grading.grade(
        "Suppose Zoey is a knight ... no. Zoey is a knave and Oliver is a knight.",
        reference,
        "knights_knaves",
    )


@pytest.fixture(scope="module")
def pool():
    with grading.grading_pool(num_workers=2, timeout_s=60.0) as grading_pool:
        yield grading_pool


def test_pooled_grading_agrees_with_serial_grading_in_input_order(pool):
    completions = [c for c, _, _ in GRADING_CASES] * 3
    answers = [a for _, a, _ in GRADING_CASES] * 3
    expected = [e for _, _, e in GRADING_CASES] * 3
    assert grading.grade_batch(completions, answers, pool=pool) == expected
    assert grading.grade_batch(completions[:4], answers[:4], pool=pool) == expected[:4]
    assert grading.grade_batch([], [], pool=pool) == []
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        grading.grade_batch(["a", "b"], ["1"], pool=pool)


def test_pool_replaces_a_worker_that_died_between_calls(pool):
    pool._workers[0].process.kill()
    pool._workers[0].process.wait()
    completions, answers = [FORMAT.format(i) for i in range(20)], [str(i) for i in range(20)]
    assert grading.grade_batch(completions, answers, pool=pool) == [True] * 20


@pytest.mark.slow
def test_an_answer_that_hangs_the_parser_times_out_is_graded_wrong_and_counted():
    # 9^(9^9) has 370 million digits: math-verify would compute for hours.
    hanging = FORMAT.format("9^{9^{9}}")
    completions = [FORMAT.format("4"), hanging, FORMAT.format("5"), FORMAT.format("4")]
    with grading.grading_pool(num_workers=1, timeout_s=3.0) as short:
        grading.grade_batch(completions[:1], ["4"], pool=short)  # started and warm
        started = time.monotonic()
        results = grading.grade_batch(completions, ["4", "4", "4", "4"], pool=short)
        elapsed = time.monotonic() - started
        assert results == [True, False, False, True]
        assert short.stats["timeouts"] == 1 and short.last_timeouts == [1]
        assert (
            elapsed < 3.0 + 30.0
        )  # the timeout plus a replacement worker's start, even under load
        assert grading.grade_batch(completions[:1], ["4"], pool=short) == [
            True
        ]  # and the pool still works


# ---- plug-in rewards (--reward) ----


def write_module(tmp_path, source):
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    return str(path)


def test_a_plug_in_reward_is_loaded_from_a_file_and_called_with_the_batch(tmp_path):
    path = write_module(
        tmp_path,
        "def length(completions, problems, answers):\n"
        "    return [len(c) + len(p) + len(a) "
        "for c, p, a in zip(completions, problems, answers)]\n",
    )
    reward = grading.load_reward_function(f"{path}:length")
    assert reward(["ab", "c"], ["p", "pp"], ["1", "22"]) == [4.0, 5.0]
    assert grading.load_reward_function("") is grading.math_reward


@pytest.mark.parametrize(
    "source, spec, message",
    [
        ("", "no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("raise RuntimeError('boom')\n", "FILE:f", "cannot import .*RuntimeError: boom"),
        ("def f(a, b, c): return []\n", "FILE:g", "has no function 'g'"),
        (
            "def f(completions): return []\n",
            "FILE:f",
            r"a reward takes \(completions, problems, answers\)",
        ),
        ("def f(a, b, c): return [1.0]\n", "FILE", "write module:function"),
    ],
)
def test_a_bad_plug_in_reward_is_one_line_naming_the_fix(tmp_path, source, spec, message):
    path = write_module(tmp_path, source)
    with pytest.raises(grading.RewardError, match=message) as error:
        grading.load_reward_function(spec.replace("FILE", path))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "body, message",
    [
        ("return [1.0]", "returned 1 values for 2 completions"),
        ("return [1.0, float('nan')]", "returned nan for completion 1: rewards must be finite"),
        ("return 'ab'", "returned str ab; it must return one float per completion"),
    ],
)
def test_a_plug_in_reward_that_returns_the_wrong_thing_is_stopped(tmp_path, body, message):
    path = write_module(tmp_path, f"def f(completions, problems, answers):\n    {body}\n")
    reward = grading.load_reward_function(f"{path}:f")
    with pytest.raises(grading.RewardError, match=message):
        reward(["a", "b"], ["p", "q"], ["1", "2"])
