"""Time of one training step with the branch guide over plain GRPO, same batch, one run.

The step is sage.update_policy: reference log-probs (adapter off), the policy forward pass, the
guide's log q from that same pass, the loss, backward and the AdamW step. The branch guide needs
the entropies, which the log-prob pass computes anyway, so it should add no forward pass: the
goal is a ratio <= 1.05. Both variants alternate on the same rollouts (LoRA policy on a small
random Qwen2), and each one's median over the repeats is compared.

Prints one JSON object as its last line with branch_over_grpo_step_time and the raw times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import guides  # noqa: E402
import loss  # noqa: E402
import sage  # noqa: E402
from bench import common  # noqa: E402
from extras import demo  # noqa: E402
from machinery import models  # noqa: E402


def make_rollouts(
    num_prompts: int,
    group_size: int,
    prompt_len: int,
    completion_len: int,
    vocab: int,
    seed: int,
    full_length: bool = False,
):
    """Random rollouts and rewards: completions of completion_len // 2 to completion_len tokens
    (all of completion_len with ``full_length``)."""
    rng = random.Random(seed)
    prompts, completions = [], []
    for _ in range(num_prompts):
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        for _ in range(group_size):
            length = (
                completion_len if full_length else rng.randint(completion_len // 2, completion_len)
            )
            prompts.append(prompt)
            completions.append([rng.randrange(10, vocab) for _ in range(length)])
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in completions])
    count = len(completions)
    rollouts = sage.Rollouts(
        prompts,
        completions,
        [""] * count,
        ["stop"] * count,
        [[0.0] * len(c) for c in completions],
        [""] * count,
        ["0"] * count,
    )
    return rollouts, rewards


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = demo.build_tiny_tokenizer()
    model = demo.build_tiny_model(
        tokenizer,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.hidden_size // 64,
        max_position_embeddings=1024,
    )
    policy = sage.wrap_lora(model, rank=8, alpha=16)
    optimizer, _ = models.make_optimizer(policy, 1e-6, 0.01, 1000, 10)
    rollouts, rewards = make_rollouts(
        args.prompts,
        args.rollouts,
        args.prompt_len,
        args.completion_len,
        model.config.vocab_size,
        seed=0,
    )
    advantages = loss.compute_advantages(rewards, args.rollouts, "grpo")
    generator = torch.Generator().manual_seed(0)

    def step(guide_name: str) -> float:
        config = sage.Config(
            model="bench",
            rollouts=args.rollouts,
            micro_batch_size=args.micro_batch_size,
            guide=guides.GuideConfig(name=guide_name),
            steps=1000,
            max_seq_len=args.prompt_len + args.completion_len,
            max_prompt_len=args.prompt_len,
        )
        started = time.perf_counter()
        common.update(
            policy, optimizer, rollouts, advantages, config, tokenizer.pad_token_id, generator
        )
        return time.perf_counter() - started

    step("none"), step("branch")  # warm-up
    times = {"none": [], "branch": []}
    for _ in range(args.repeats):
        for name in ("none", "branch"):
            times[name].append(step(name))
    grpo, branch = statistics.median(times["none"]), statistics.median(times["branch"])
    print(
        json.dumps(
            {
                "branch_over_grpo_step_time": round(branch / grpo, 4),
                "grpo_step_s": round(grpo, 4),
                "branch_step_s": round(branch, 4),
                "sequences_per_step": len(rollouts.completion_ids),
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
