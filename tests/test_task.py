"""task.py and grading_pool.py: the answer format, grading against hand-decided cases (serial and
pooled must agree), and the pool's hard timeout on an input that would run for hours."""

import time

import pytest

import task


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
    assert task.grade(completion, answer) is expected


def test_extract_solution_takes_the_last_block():
    assert task.extract_solution("<SOLUTION>1</SOLUTION> then <SOLUTION> 2 </SOLUTION>") == "2"
    assert task.extract_solution("<SOLUTION> truncated") is None


def test_knights_and_knaves_grader_matches_every_role():
    reference = "(1) Zoey is a knave\n(2) Oliver is a knight"
    assert task.grade("<SOLUTION> (1) Zoey is a knave (2) Oliver is a knight </SOLUTION>", reference,
                          "knights_knaves")
    assert not task.grade("<SOLUTION> Zoey is a knight, Oliver is a knight </SOLUTION>", reference,
                              "knights_knaves")
    assert not task.grade("<SOLUTION> Zoey is a knave </SOLUTION>", reference, "knights_knaves")
    # without a block, the last role stated for each person counts
    assert task.grade("Suppose Zoey is a knight ... no. Zoey is a knave and Oliver is a knight.", reference,
                          "knights_knaves")


@pytest.fixture(scope="module")
def pool():
    with task.grading_pool(num_workers=2, timeout_s=60.0) as grading_pool:
        yield grading_pool


def test_pooled_grading_agrees_with_serial_grading_in_input_order(pool):
    completions = [c for c, _, _ in GRADING_CASES] * 3
    answers = [a for _, a, _ in GRADING_CASES] * 3
    expected = [e for _, _, e in GRADING_CASES] * 3
    assert task.grade_batch(completions, answers, pool=pool) == expected
    assert task.grade_batch(completions[:4], answers[:4], pool=pool) == expected[:4]
    assert task.grade_batch([], [], pool=pool) == []
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        task.grade_batch(["a", "b"], ["1"], pool=pool)


def test_pool_replaces_a_worker_that_died_between_calls(pool):
    pool._workers[0].process.kill()
    pool._workers[0].process.wait()
    completions, answers = [FORMAT.format(i) for i in range(20)], [str(i) for i in range(20)]
    assert task.grade_batch(completions, answers, pool=pool) == [True] * 20


@pytest.mark.slow
def test_an_answer_that_hangs_the_parser_times_out_is_graded_wrong_and_counted():
    # 9^(9^9) has 370 million digits: math-verify would compute for hours.
    hanging = FORMAT.format("9^{9^{9}}")
    completions = [FORMAT.format("4"), hanging, FORMAT.format("5"), FORMAT.format("4")]
    with task.grading_pool(num_workers=1, timeout_s=3.0) as short:
        task.grade_batch(completions[:1], ["4"], pool=short)  # started and warm
        started = time.monotonic()
        results = task.grade_batch(completions, ["4", "4", "4", "4"], pool=short)
        elapsed = time.monotonic() - started
        assert results == [True, False, False, True]
        assert short.stats["timeouts"] == 1 and short.last_timeouts == [1]
        assert elapsed < 3.0 + 30.0  # the timeout plus a replacement worker's start, even under load
        assert task.grade_batch(completions[:1], ["4"], pool=short) == [True]  # and the pool still works
