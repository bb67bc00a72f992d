"""The trainer's batches: a step's prompts and completions as one padded tensor batch.

Prompts are left-padded and completions right-padded, so every completion starts at the same
column and its log-probs come out as one [B, C] block; position ids count real tokens only.
"""

from __future__ import annotations

import torch


def collate(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, device, group_size: int = 1
) -> dict:
    """Left-padded prompts + right-padded completions in one [B, P + C] batch.

    position_ids count real tokens only, so a left-padded row sees the positions the engine saw.
    With ``group_size`` > 1, rows that come in groups sharing one prompt (GRPO's G completions of
    a prompt) are marked so, and ``completion_logps`` runs each prompt through the model once.

    >>> batch = collate([[5, 6], [7]], [[8], [9, 10]], pad_id=0, device="cpu")
    >>> batch["input_ids"].tolist(), batch["completion_mask"].tolist()
    ([[5, 6, 8, 0], [0, 7, 9, 10]], [[1.0, 0.0], [1.0, 1.0]])
    >>> batch["position_ids"].tolist()
    [[0, 1, 2, 2], [0, 0, 1, 2]]
    """
    prompt_len = max(map(len, prompts))
    completion_len = max(1, max(map(len, completions)))
    batch = len(prompts)
    input_ids = torch.full((batch, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    completion_mask = torch.zeros(batch, completion_len)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        start, end = prompt_len - len(prompt), prompt_len + len(completion)
        input_ids[row, start:prompt_len] = torch.tensor(prompt)
        input_ids[row, prompt_len:end] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, start:end] = 1
        completion_mask[row, : len(completion)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    shared = group_size > 1 and batch % group_size == 0
    shared = shared and all(prompts[row] == prompts[row - row % group_size] for row in range(batch))
    return {
        "group_size": group_size if shared else 1,
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "position_ids": position_ids.to(device),
        "completion_ids": input_ids[:, prompt_len:].to(device),  # [B, C]
        "completion_mask": completion_mask.to(device),  # [B, C]
    }
