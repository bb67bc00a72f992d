"""demo.py: the embedded task's split and answers, and its tiny tokenizer's format tokens."""

from extras import demo


def test_demo_split_is_disjoint_and_answers_are_right():
    train, held_out = demo.demo_problems(seed=3407, num_held_out=100)
    assert len(train) == 300 and len(held_out) == 100
    assert not {p["problem"] for p in train} & {p["problem"] for p in held_out}
    for problem in train + held_out:
        a, b = problem["working"].split("=")[0].split("+")
        assert int(a) + int(b) == int(problem["answer"])
