"""Self-hints for groups with no signal ("Self-Hinting Language Models Enhance Reinforcement
Learning", Liao et al., arXiv 2602.03143): the other method called SAGE, composed with ours.

When every one of a prompt's G rollouts is wrong, GRPO's advantages are all zero and the prompt
teaches nothing. Self-hinting gives such a prompt a second chance within the same step. The
procedure, as the authors' code runs it (its "sage" method, the on-policy one):

1. **When.** After the step's rollouts are graded, every prompt none of whose G rollouts earned a
   reward (an all-wrong group; all-correct groups are left alone) asks for a hint. Training only:
   evaluation never sees a hint.
2. **Who writes it, from what.** The policy itself, with its current weights, in the same step,
   prompted as a tutor: a system prompt asking for three progressive hints that never reveal the
   final answer, as JSON {"level_1", "level_2", "level_3"}, and the user message "Question: ...
   Solution: ..." holding the problem and its *reference solution*. A reply that does not parse is
   asked for again, up to 3 times; then the prompt goes without a hint.
3. **How long.** Nothing but the generation budget bounds a hint (three levels in one reply, from
   a minimal pointer to detailed guidance).
4. **The hinted prompt.** The question followed by "Here is a hint to help you:" and the hint. The
   group is sampled again, G rollouts, from the policy conditioned on prompt + hint, graded by the
   same reward against the *original* answer, and replaces the unhinted group. Levels are tried
   in order, 1 then 2 then 3, each only for the prompts still all-wrong.
5. **Which log-probs.** The hinted rollouts enter the batch with their hinted prompt: old,
   reference and current log-probs are all computed on prompt + hint, so the update is on-policy
   for the context that produced the samples (the authors' "on-policy" claim), the reference
   anchors the same context, and here the guide's entropies come from that same pass. Nothing
   re-scores them without the hint.
6. **Leaks.** The authors rely on the instruction "never reveal the final answer"; their code has
   no check. A hint that leaks is used as it is. Here it is used too, and counted
   (``hints/leaked``) so that a run can see how often it happens.

7. **What is kept.** A group is replaced whole (hinted and unhinted rollouts never mix in a group);
   the last level tried is kept even if still all wrong (it then has zero advantage). Levels start
   again from 1 at every step.

Where this differs from the authors' code: their hint replies are decoded greedily (their
evaluation sampling), here sampled at ``--eval-temperature`` / ``--eval-top-p``; a reply that is
not JSON but plain text is taken as a single level-1 hint rather than asked for again (small
models, the CPU demo's, rarely write JSON); a reply cut short keeps its complete levels, and LaTeX
written with single backslashes inside the JSON strings keeps them (their lenient JSON5 parser
drops the backslash of "\\sqrt" and turns "\\frac" into a form feed); the hinted prompt keeps the
task's own system prompt, as theirs keeps their RL system prompt. Their verl trainer also balances
the batch across GPUs before the rewards are computed, after which it addresses groups by position;
here groups are always the G consecutive rows of a prompt. With DAPO's dynamic sampling, hints
apply to a step's first round. Composition with anchor shaping is direct: the guide q and the KL
anchor act on whatever rollouts the batch holds, hinted or not, each on its own context.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

HINT_SYSTEM_PROMPT = (
    "You are a tutor. Given a problem and its solution, write three hints that lead a student to "
    "solve it on their own, each more detailed than the last: level 1 names the key idea, level 2 "
    "gives the method or a first step, level 3 guides closely without completing the solution. "
    "Never reveal the final answer. Reply with JSON only: "
    '{"level_1": "...", "level_2": "...", "level_3": "..."}'
)
LEVELS = ("level_1", "level_2", "level_3")
MAX_HINT_CHARS = 2000  # a runaway reply is cut here (the authors bound it by the generation budget)


def hint_request_messages(problem: str, solution: str) -> list[dict[str, str]]:
    """The chat messages that ask the policy for hints (step 2).

    >>> [m["role"] for m in hint_request_messages("What is 7 + 5?", "7+5=12")]
    ['system', 'user']
    >>> hint_request_messages("What is 7 + 5?", "7+5=12")[1]["content"]
    'Question:\\nWhat is 7 + 5?\\n\\nSolution:\\n7+5=12'
    """
    return [
        {"role": "system", "content": HINT_SYSTEM_PROMPT},
        {"role": "user", "content": f"Question:\n{problem}\n\nSolution:\n{solution}"},
    ]


# A hint's LaTeX is often written with single backslashes inside the JSON strings: "\sqrt" is then
# no JSON escape (json.loads fails) and "\frac", "\theta", "\beta", "\rho" decode to control
# characters. Both are undone here; "\n" stays a newline (it is one far more often than "\nu").
_ESCAPE_OR_BACKSLASH = re.compile(r'\\(["\\/bfnrt]|u[0-9a-fA-F]{4})?')
_LATEX_CONTROL = re.compile(r"[\f\b\t\r](?=[A-Za-z])")
_FENCED = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_FIELD = re.compile(r'"(level_[123])"\s*:\s*"((?:[^"\\]|\\.)*)"', re.DOTALL)


def _json_loads(text: str):
    """json.loads (raw line breaks allowed in strings), retried with every backslash that starts no
    JSON escape doubled; None if neither parses."""
    repaired = _ESCAPE_OR_BACKSLASH.sub(lambda m: m.group() if m.group(1) else "\\\\", text)
    for attempt in (text, repaired):
        try:
            return json.loads(attempt, strict=False)
        except json.JSONDecodeError:
            continue
    return None


def _clean_level(value) -> str:
    """A level's text: strings only (as the authors), LaTeX's backslashes back, cut at
    MAX_HINT_CHARS."""
    if not isinstance(value, str):
        return ""
    text = _LATEX_CONTROL.sub(
        lambda m: {"\f": "\\f", "\b": "\\b", "\t": "\\t", "\r": "\\r"}[m.group()], value
    )
    return text.strip()[:MAX_HINT_CHARS]


def parse_hint_levels(reply: str) -> dict[str, str]:
    """The hints of a reply (step 2), read like the authors' parser: the JSON object in a fenced
    block, else from its first "{" to its last "}", after any "</think>"; a reply whose object
    does not parse keeps every complete "level_k": "..." field; a reply with no such field is
    taken whole as one level-1 hint; {} for an empty reply. Each hint is cut at MAX_HINT_CHARS.

    >>> reply = 'Sure. ```json {"level_1": "Think of carries.", "level_2": "7+5 > 9"} ```'
    >>> parse_hint_levels(reply)
    {'level_1': 'Think of carries.', 'level_2': '7+5 > 9'}
    >>> parse_hint_levels(r'{"level_1": "Use \\sqrt{x} and \\frac{1}{2}."}')["level_1"]
    'Use \\\\sqrt{x} and \\\\frac{1}{2}.'
    >>> parse_hint_levels('{"level_1": "Halve it.", "level_2": "Then add')  # cut by the budget
    {'level_1': 'Halve it.'}
    >>> parse_hint_levels("  add the units first ")
    {'level_1': 'add the units first'}
    """
    text = reply.strip()
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1].strip()
    for candidate in [*_FENCED.findall(text), text]:
        start, end = candidate.find("{"), candidate.rfind("}")
        payload = _json_loads(candidate[start : end + 1]) if start != -1 and end > start else None
        if isinstance(payload, dict):
            levels = {key: _clean_level(payload.get(key)) for key in LEVELS}
            if any(levels.values()):
                return {key: hint for key, hint in levels.items() if hint}
    fields = {key: _clean_level(_json_loads(f'"{value}"')) for key, value in _FIELD.findall(text)}
    if any(fields.values()):
        return {key: fields[key] for key in LEVELS if fields.get(key)}
    return {"level_1": text[:MAX_HINT_CHARS]} if text else {}


def hinted_problem(problem: str, hint: str) -> str:
    """The problem as the hinted group sees it (step 4).

    >>> hinted_problem("What is 7 + 5?", "Carry the ten.")
    'What is 7 + 5?\\n\\nHere is a hint to help you:\\nCarry the ten.'
    """
    return f"{problem}\n\nHere is a hint to help you:\n{hint}"


def leaks_answer(hint: str, answer: str) -> bool:
    """Whether a hint states the final answer as a number or expression of its own (step 6). A
    one-character answer ("2") is also found in "level 2" or "2 steps": such leaks are overcounted.

    >>> leaks_answer("The sum is 12.", "12"), leaks_answer("Carry the 1 to the tens.", "12")
    (True, False)
    >>> leaks_answer("It is -12, or 1/12, or 12^2.", "12"), leaks_answer("x = -12", "-12")
    (False, True)
    """
    answer = answer.strip()
    # Not inside a longer number, word, fraction, power or negative: "12" is not in "120", "x12",
    # "12.5", "1/12", "12^2" or "-12"; "is 12." is a leak.
    pattern = rf"(?<![\w.\-/^]){re.escape(answer)}(?![\w/^]|\.\d)"
    return bool(answer) and re.search(pattern, hint) is not None


@dataclass
class HintStats:
    """One step's record of self-hinting, as metrics.jsonl's ``hints/*`` keys."""

    prompts: int = 0  # prompts sampled this step
    prompts_with_signal: int = 0  # ... whose final group's rewards are not all equal
    groups_needing_hint: int = 0  # all-wrong groups after the unhinted rollouts
    groups_hinted: int = 0  # ... that got a hint and were sampled again
    groups_solved_by_hint: int = 0  # ... whose hinted group has a correct rollout
    leaked: int = 0  # hints that state the answer (used all the same)
    missing_solution: int = 0  # rows without a reference solution: skipped
    hint_chars: list[int] = field(default_factory=list)
    reward_without_hints: list[float] = field(
        default_factory=list
    )  # rewards of groups never hinted
    reward_with_hints: list[float] = field(default_factory=list)  # rewards of hinted groups

    def record(self) -> dict[str, float]:
        """prompt usage rate = the fraction of sampled prompts whose group carried signal.

        >>> stats = HintStats(prompts=4, prompts_with_signal=3, groups_hinted=1)
        >>> stats.record()["hints/prompt_usage_rate"]
        0.75
        """
        record = {
            "hints/prompt_usage_rate": self.prompts_with_signal / max(1, self.prompts),
            "hints/groups_needing_hint": self.groups_needing_hint,
            "hints/groups_hinted": self.groups_hinted,
            "hints/groups_solved_by_hint": self.groups_solved_by_hint,
            "hints/leaked": self.leaked,
            "hints/missing_solution": self.missing_solution,
        }
        for key, values in (
            ("mean_hint_chars", self.hint_chars),
            ("reward_without_hints", self.reward_without_hints),
            ("reward_with_hints", self.reward_with_hints),
        ):
            if values:  # a mean of nothing is left out rather than logged as NaN
                record[f"hints/{key}"] = sum(values) / len(values)
        return record


def replace_groups(rollouts, groups: list[int], other, group_size: int):
    """``rollouts`` (a ``sage.Rollouts``) with its groups ``groups`` taken from ``other``, whose
    groups follow that list."""
    source = {g: i for i, g in enumerate(groups)}
    rows = [
        other.select([source[r // group_size] * group_size + r % group_size])
        if r // group_size in source
        else rollouts.select([r])
        for r in range(len(rollouts.texts))
    ]
    return rows[0].concat(rows[1:])


def self_hint(engine, rollouts, rewards, chosen: list[dict], config, step: int, sample):
    """The policy writes hints for the all-wrong groups from their reference solutions; levels
    1, 2, 3 in turn, each still-unsolved group is sampled again on prompt + hint, graded against
    its original answer, and replaces its unhinted group. ``sample(problems, seed)`` gives
    (rollouts, rewards) of the trainer's sampler and reward. Returns (rollouts, rewards, hints/*
    metrics)."""
    import rollout
    from task.problems import build_prompt_ids, chat_ids

    stats, group_size, tokenizer = HintStats(), config.rollouts, engine.tokenizer
    unsolved = [g for g, group in enumerate(rewards.view(-1, group_size)) if group.max() <= 0]
    asking = [g for g in unsolved if chosen[g].get("solution")]
    stats.groups_needing_hint, stats.missing_solution = len(unsolved), len(unsolved) - len(asking)
    requests = {
        g: chat_ids(tokenizer, hint_request_messages(chosen[g]["problem"], chosen[g]["solution"]))
        for g in asking
    }
    requests = {g: ids for g, ids in requests.items() if len(ids) <= config.max_prompt_len}
    kept_hint = {}  # group -> the hint its final rollouts were sampled with
    if requests:
        writing = rollout.SamplingConfig(
            n=1,
            temperature=config.eval.eval_temperature,
            top_p=config.eval.eval_top_p,
            min_p=config.min_p,
            max_tokens=config.max_seq_len - config.max_prompt_len,
            seed=rollout.rollout_seed(config.seed, step, 1000),
        )
        replies = engine.generate(list(requests.values()), writing)
        levels = {g: parse_hint_levels(group[0].text) for g, group in zip(requests, replies)}
        for number, level in enumerate(LEVELS, start=1):
            targets = [
                g
                for g in requests
                if level in levels[g] and rewards.view(-1, group_size)[g].max() <= 0
            ]
            hinted = {
                g: {
                    **chosen[g],
                    "prompt_ids": build_prompt_ids(
                        tokenizer, hinted_problem(chosen[g]["problem"], levels[g][level])
                    ),
                }
                for g in targets
            }
            targets = [g for g in targets if len(hinted[g]["prompt_ids"]) <= config.max_prompt_len]
            if not targets:
                continue
            # graded against the original answer
            again, again_rewards = sample(
                [hinted[g] for g in targets], rollout.rollout_seed(config.seed, step, 1000 + number)
            )
            rollouts = replace_groups(rollouts, targets, again, group_size)
            rows = torch.tensor([g * group_size + i for g in targets for i in range(group_size)])
            rewards = rewards.clone().index_put_((rows,), again_rewards)
            kept_hint.update({g: levels[g][level] for g in targets})
    groups = rewards.view(-1, group_size)  # [prompts, G], the final rewards
    stats.prompts = len(groups)
    stats.prompts_with_signal = int(
        ((groups.max(dim=1).values - groups.min(dim=1).values) > 0).sum()
    )
    if requests:
        record_outcome(stats, kept_hint, groups, chosen)
    return rollouts, rewards, stats.record()


def record_outcome(
    stats: HintStats, kept_hint: dict, groups: torch.Tensor, chosen: list[dict]
) -> None:
    """Fill ``stats`` with what the step's hinting did; ``groups`` [prompts, G] are the final
    rewards."""
    hinted_groups = sorted(kept_hint)  # resampled on a hint (a hint too long at every level is not)
    stats.groups_hinted = len(hinted_groups)
    stats.hint_chars += [len(kept_hint[g]) for g in hinted_groups]
    stats.leaked += sum(leaks_answer(kept_hint[g], chosen[g]["answer"]) for g in hinted_groups)
    stats.groups_solved_by_hint = sum(int(groups[g].max() > 0) for g in hinted_groups)
    stats.reward_with_hints = groups[hinted_groups].flatten().tolist()
    stats.reward_without_hints = (
        groups[[g for g in range(len(groups)) if g not in hinted_groups]].flatten().tolist()
    )
