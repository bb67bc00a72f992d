"""DAPO's dynamic sampling and overlong shaping (Yu et al. 2025), behind ``--dynamic-sampling``
and ``--overlong-buffer`` (the ``--algo dapo`` preset turns the first on).

A group whose G rewards are all equal has advantage 0 everywhere and teaches nothing. Dynamic
sampling drops such groups and samples fresh prompts until the step holds ``--prompts-per-step``
groups with signal (or ``--max-refill-rounds`` extra rounds are spent, and the step trains on what
it has). Overlong shaping lowers the return of completions that run into the length limit; as in
DAPO (whose filter keeps 0 < correct < G), it is added after the groups are chosen, in
``sage.train_on``, so a group all right or all wrong is dropped whatever its lengths.
"""

from __future__ import annotations

import torch

import rollout


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO: 0 up to L_max - L_cache, then linear down to -1 at L_max, -1 beyond.

    >>> overlong_penalty(torch.tensor([50.0, 90.0, 100.0, 120.0]), max_len=100, buffer=20)
    tensor([ 0.0000, -0.5000, -1.0000, -1.0000])
    """
    start = max_len - buffer
    return ((start - lengths) / buffer).clamp(-1.0, 0.0)


def overlong_penalty_of(rollouts, config) -> torch.Tensor:
    """The overlong penalty [N] of a step's rollouts under --overlong-buffer."""
    max_len = config.max_seq_len - config.max_prompt_len
    lengths = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float32)
    return overlong_penalty(lengths, max_len, config.extras["dynamic_sampling"].overlong_buffer)


def refill(
    sampler, problems: list[dict], rollouts, rewards, config, step: int, sample, informative
):
    """Keep the groups with signal and sample fresh prompts until the step is full.

    ``rollouts`` (a ``sage.Rollouts``) and ``rewards`` [N] are the step's first round;
    ``sample(chosen problems, seed)`` gives (rollouts, rewards) of a further round;
    ``informative(rewards, group_size)`` flags the groups with signal. Returns the step's kept
    rollouts and rewards (at most prompts x G rows) and, over every round's groups, its
    frac_zero_signal_groups and the reward and accuracy of what was sampled (logged in place of
    the kept rows', which only groups with signal reach: with none kept, they were NaN).
    """
    group_size, wanted = config.rollouts, config.prompts_per_step * config.rollouts
    kept = [(rollouts, rewards, informative(rewards, group_size))]
    for refill_round in range(1, config.extras["dynamic_sampling"].max_refill_rounds + 1):
        if sum(int(flags.sum()) for _, _, flags in kept) * group_size >= wanted:
            break
        chosen = [problems[i] for i in sampler.take(config.prompts_per_step)]
        more, more_rewards = sample(chosen, rollout.rollout_seed(config.seed, step, refill_round))
        kept.append((more, more_rewards, informative(more_rewards, group_size)))
    rows = [
        [g * group_size + i for g in flags.nonzero().flatten().tolist() for i in range(group_size)]
        for _, _, flags in kept
    ]
    parts = [part.select(part_rows) for (part, _, _), part_rows in zip(kept, rows)]
    rollouts = parts[0].concat(parts[1:])
    rewards = torch.cat(
        [part_rewards[part_rows] for (_, part_rewards, _), part_rows in zip(kept, rows)]
    )
    rollouts = rollouts.select(list(range(min(len(rewards), wanted))))
    without_signal = sum(int((~flags).sum()) for _, _, flags in kept)
    groups = len(kept) * config.prompts_per_step
    sampled = torch.cat([part_rewards for _, part_rewards, _ in kept])  # every round's
    metrics = {
        "frac_zero_signal_groups": without_signal / groups,
        "reward": sampled.mean().item(),
        "accuracy": (sampled > 0.5).float().mean().item(),
    }
    return rollouts, rewards[:wanted], metrics
