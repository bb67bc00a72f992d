"""What the step benchmarks share: sage.py's update (its steps 3-7) on rollouts they make up."""

from __future__ import annotations

import sage


def update(policy, optimizer, rollouts, advantages, config, pad_id: int, generator) -> dict:
    """The trainer's update on given rollouts: the held-fixed log-probs (the LoRA adapter off
    for the reference), per micro-batch the forward pass, the guide's log q, the loss and its
    backward, then one AdamW step; returns its metrics."""
    device = next(policy.parameters()).device
    batches = sage.micro_batches(rollouts, config, pad_id, device)
    held = [sage.held_fixed_logps(policy, None, batch, config) for _, batch in batches]
    return sage.update_policy(
        policy, optimizer, batches, held, advantages, config, step=0, generator=generator
    )
