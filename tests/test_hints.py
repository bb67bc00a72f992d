"""extras/hints.py, reached from sage.collect_rollouts with --self-hints: all-wrong groups get a
policy-written hint from the reference solution, are sampled again on prompt + hint and graded
against the original answer."""

import json
from types import SimpleNamespace

import torch

import sage
from extras import demo, hints
from machinery import runs
from task.problems import PromptSampler, build_prompt_ids


def test_replies_become_hint_levels_and_leaks_are_counted_not_dropped():
    reply = (
        'Here you go:\n```json\n{"level_1": "Think about carrying.", '
        '"level_2": "The answer is 12.", "level_3": ""}\n```'
    )
    assert hints.parse_hint_levels(reply) == {
        "level_1": "Think about carrying.",
        "level_2": "The answer is 12.",
    }
    assert hints.parse_hint_levels('{"level_1": ') == {
        "level_1": '{"level_1":'
    }  # not JSON: one plain hint
    assert hints.parse_hint_levels("   ") == {}
    assert hints.leaks_answer("The answer is 12.", "12") and not hints.leaks_answer(
        "7 + 5 = 1 ten and 2", "12"
    )
    assert not hints.leaks_answer("It is 120.", "12")
    assert len(hints.parse_hint_levels("x" * 5000)["level_1"]) == hints.MAX_HINT_CHARS


def test_replies_are_read_like_the_authors_parser_with_latex_kept():
    # LaTeX with single backslashes: "\sqrt" is no JSON escape, "\frac", "\theta" would become
    # control characters
    reply = (
        '```json\n{"level_1": "Use \\sqrt{x}.", "level_2": "Write \\frac{a}{b} with \\theta.",'
        ' "level_3": "\\beta"}\n```'
    )
    assert hints.parse_hint_levels(reply) == {
        "level_1": r"Use \sqrt{x}.",
        "level_2": r"Write \frac{a}{b} with \theta.",
        "level_3": r"\beta",
    }
    # properly escaped JSON is read as it is; a real newline stays a newline
    assert hints.parse_hint_levels(r'{"level_1": "a \\sqrt{2}\nthen b"}') == {
        "level_1": "a \\sqrt{2}\nthen b"
    }
    # the fenced object wins over braces in the text around it, and a thinking preamble is skipped
    reply = '<think>try {x}</think>Hints:\n```json\n{"level_1": "Pair terms."}\n```\nSet {y} aside.'
    assert hints.parse_hint_levels(reply) == {"level_1": "Pair terms."}
    # a reply cut by the token budget keeps its complete levels, not the whole JSON as one hint
    assert hints.parse_hint_levels(
        '{"level_1": "Halve it.", "level_2": "Then \\sqrt{2}", "level_3": "Multi'
    ) == {"level_1": "Halve it.", "level_2": r"Then \sqrt{2}"}
    # only strings are hints (as the authors); an object with no level is plain text
    assert hints.parse_hint_levels('{"level_1": ["a"], "level_2": "b"}') == {"level_2": "b"}
    assert hints.parse_hint_levels('{"hint": "b"}') == {"level_1": '{"hint": "b"}'}


def test_leaks_are_whole_answers_not_parts_of_other_numbers():
    leak = hints.leaks_answer
    assert leak("So the total is 12.", "12") and leak("x = -12 here", "-12")
    assert leak(r"get \frac{1}{2} at last", r"\frac{1}{2}")
    assert not any(
        leak(hint, "12")
        for hint in ["120 apples", "1/12 of it", "12^2 = 144", "x12", "12.5", "-12", ""]
    )
    assert not leak("anything", "  ")  # no answer, no leak


def test_hint_writing_and_hinted_prompts():
    messages = hints.hint_request_messages("Add 7 and 5.", "7+5=12")
    assert (
        messages[0]["role"] == "system"
        and "Never reveal the final answer" in messages[0]["content"]
    )
    assert all(level in messages[0]["content"] for level in hints.LEVELS)
    assert messages[1] == {
        "role": "user",
        "content": "Question:\nAdd 7 and 5.\n\nSolution:\n7+5=12",
    }
    assert hints.hinted_problem("Add 7 and 5.", "Carry.").startswith(
        "Add 7 and 5.\n\nHere is a hint to help you:\n"
    )


def test_step_metrics_leave_out_means_of_nothing():
    stats = hints.HintStats(
        prompts=8,
        prompts_with_signal=2,
        groups_needing_hint=5,
        groups_hinted=3,
        hint_chars=[10, 20],
        reward_with_hints=[1.0, 0.0],
        reward_without_hints=[],
    )
    record = stats.record()
    assert record["hints/prompt_usage_rate"] == 0.25 and record["hints/mean_hint_chars"] == 15
    assert record["hints/reward_with_hints"] == 0.5 and "hints/reward_without_hints" not in record
    assert hints.HintStats().record()["hints/prompt_usage_rate"] == 0.0


class ScriptedEngine:
    """Answers prompts by what they hold: a hint request gets hint levels (level 1 unhelpful,
    level 2 leaking the answer); a hinted prompt at level 2 gets right answers; anything else
    wrong."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, sampling):
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.calls.append(texts)
        out = []
        for text in texts:
            if "Solution:" in text:
                reply = json.dumps(
                    {"level_1": "Look at the numbers.", "level_2": "It is 12, carry the ten."}
                )
            elif "carry the ten" in text:
                reply = "<SOLUTION>12</SOLUTION>"
            else:
                reply = "<SOLUTION>2</SOLUTION>"
            out.append(
                [
                    SimpleNamespace(
                        text=reply, token_ids=[5, 6], finish_reason="stop", logprobs=[-1.0, -1.0]
                    )
                    for _ in range(sampling.n)
                ]
            )
        return out


def run_collect(self_hints: bool, answers=("12", "18")):
    tokenizer = demo.build_tiny_tokenizer()
    engine = ScriptedEngine(tokenizer)
    problems = [
        {"problem": "Add 7 and 5.", "answer": answers[0], "solution": "7+5=12"},
        {"problem": "Add 9 and 9.", "answer": answers[1], "solution": ""},
    ]
    problems = [{**p, "prompt_ids": build_prompt_ids(tokenizer, p["problem"])} for p in problems]
    config = sage.parse_config(
        [
            "--model",
            "m",
            "--rollouts",
            "2",
            "--prompts-per-step",
            "2",
            "--max-seq-len",
            "1200",
            "--max-prompt-len",
            "1000",
            *(["--self-hints", "--solution-key", "solution"] if self_hints else []),
        ]
    )
    graded = []

    def reward(completions, problem_texts, answers):
        graded.append((list(problem_texts), list(answers)))
        return [float(c == "<SOLUTION>" + a + "</SOLUTION>") for c, a in zip(completions, answers)]

    sampler = PromptSampler(2, seed=0)
    sampler.take = lambda count: [0, 1]
    drawn_from = sage.Task(problems, sampler=sampler, reward_function=reward)
    result = sage.collect_rollouts(engine, drawn_from, config, 0, runs.PhaseTimer())
    return engine, tokenizer, result, graded, result[2]


def test_a_hinted_group_is_sampled_on_prompt_plus_hint_and_graded_against_the_original_answer():
    engine, tokenizer, (rollouts, rewards, _), graded, record = run_collect(self_hints=True)
    # both groups all wrong; only the first has a reference solution: one hint request
    assert sum("Solution:" in text for call in engine.calls for text in call) == 1
    hinted_prompt = tokenizer.decode(rollouts.prompt_ids[0])
    assert (
        "Here is a hint to help you:\nIt is 12, carry the ten." in hinted_prompt
    )  # level 1 failed, level 2 solved it
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # all right, all wrong: no signal either
    assert record["frac_zero_signal_groups"] == 1.0
    assert all(
        problems == ["Add 7 and 5.", "Add 7 and 5."] and answers == ["12", "12"]
        for problems, answers in graded[1:]
    )  # hinted rollouts: the original problem and answer
    assert record["hints/groups_needing_hint"] == 2 and record["hints/missing_solution"] == 1
    assert record["hints/groups_hinted"] == 1 and record["hints/groups_solved_by_hint"] == 1
    assert record["hints/leaked"] == 1  # level 2 states the answer: used all the same, counted
    assert record["hints/mean_hint_chars"] == len(
        "It is 12, carry the ten."
    )  # the hint kept, not level 1 too
    assert (
        record["hints/prompt_usage_rate"] == 0.0
    )  # prompts whose group carried signal: neither (all 1s, all 0s)


def test_with_hints_off_the_step_is_the_plain_one():
    engine, tokenizer, (rollouts, rewards, record), _, _ = run_collect(self_hints=False)
    assert not any(key.startswith("hints/") for key in record)
    assert len(engine.calls) == 1 and rewards.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert all("hint" not in tokenizer.decode(ids) for ids in rollouts.prompt_ids)
    assert isinstance(rewards, torch.Tensor)


def test_with_hints_on_and_no_all_wrong_group_the_step_is_the_plain_one_bit_for_bit():
    """Every group has a right rollout (the engine answers 2): nothing is hinted, and the engine's
    calls, the rollouts and the rewards are exactly those of a step with hints off."""
    plain = run_collect(self_hints=False, answers=("2", "2"))
    hinted = run_collect(self_hints=True, answers=("2", "2"))
    assert hinted[0].calls == plain[0].calls and len(plain[0].calls) == 1
    (rollouts, rewards, record), (plain_rollouts, plain_rewards, plain_record) = hinted[2], plain[2]
    assert torch.equal(rewards, plain_rewards)
    assert record["frac_zero_signal_groups"] == plain_record["frac_zero_signal_groups"]
    assert rollouts == plain_rollouts
    assert record["hints/groups_needing_hint"] == 0
