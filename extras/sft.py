"""The SFT warm start of base models before RL (App. E.2, Table 7), behind ``--sft-dataset``.

Base models do not yet write the paper's answer format, so RL from them sees no reward. The
paper first fine-tunes them on a small set of worked solutions: LoRA, 2 epochs, batch 1, lr 2e-4,
a linear schedule with 5 warmup steps, weight decay 0.01, on examples whose whole text is at most
half the max length (never cut: a cut example would lose its closing tag and EOS). The examples
are the numerically answerable rows of OpenMathReasoning-mini in the paper's answer format
(``sft_examples``, ``tokenize_sft_examples``, with counts of what was dropped). The merged model,
<run>/sft_model, is the base of every RL run of Table 1 (``--sft-only`` stops there).
"""

from __future__ import annotations

import gc
import math
import os
import random

import torch
from tqdm import tqdm

import loss
from extras.flags import SFTConfig
from task.problems import DataError, build_prompt_ids, require_fields, sft_completion


def sft_examples(
    rows: list[dict], problem_key: str, reasoning_key: str, answer_key: str, where: str
) -> tuple[list[dict], int]:
    """{problem, completion} in the paper's format from the numerically answerable rows (the
    paper keeps those only), and the number of rows dropped for a non-numeric answer."""
    require_fields(
        rows,
        (problem_key, reasoning_key, answer_key),
        where,
        "--sft-problem-key / --sft-reasoning-key / --sft-answer-key",
    )
    examples = []
    for row in rows:
        answer = str(row[answer_key]).strip()
        try:
            float(answer.replace(",", ""))
        except ValueError:
            continue
        examples.append(
            {
                "problem": str(row[problem_key]),
                "completion": sft_completion(str(row[reasoning_key]), answer),
            }
        )
    if not examples:
        raise DataError(f"no numerically answerable SFT examples in {where}")
    return examples, len(rows) - len(examples)


def tokenize_sft_examples(
    tokenizer, examples: list[dict], max_tokens: int, max_samples: int = 0
) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """(prompt ids, completion ids + EOS) of the first ``max_samples`` examples (0: all) whose
    whole text fits in ``max_tokens``, and counts of what was kept and dropped.

    An example is never cut: a cut one would lose its closing ``</SOLUTION>`` and EOS, and SFT
    would teach the model not to close the format (the RL stage would then see no reward).
    """
    pairs, dropped, longest = [], 0, 0
    for example in examples:
        prompt = build_prompt_ids(tokenizer, example["problem"])
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        if len(prompt) + len(completion) > max_tokens:
            dropped += 1
            continue
        pairs.append((prompt, completion))
        longest = max(longest, len(prompt) + len(completion))
        if max_samples and len(pairs) >= max_samples:
            break
    stats = {
        "kept": len(pairs),
        "dropped_too_long": dropped,
        "max_tokens": max_tokens,
        "longest_kept": longest,
    }
    if not pairs:
        raise DataError(
            f"no SFT example fits in {max_tokens} tokens (prompt + completion); raise "
            "--sft-max-tokens or --max-seq-len"
        )
    return pairs, stats


def sft(
    model,
    pairs: list[tuple[list[int], list[int]]],
    pad_token_id: int,
    settings: SFTConfig,
    config,
    progress: bool = True,
) -> list[float]:
    """Supervised fine-tuning on completion tokens only; returns the per-step losses.

    ``config`` (a ``sage.Config``) gives the seed of the example order, AdamW's weight decay and
    the clipping norm; ``settings`` the epochs, learning rate, batch size and warmup.
    """
    from loss import collate
    from machinery import models

    device = next(model.parameters()).device
    total_steps = settings.sft_epochs * math.ceil(len(pairs) / settings.sft_batch_size)
    optimizer, scheduler = models.make_optimizer(
        model, settings.sft_lr, config.weight_decay, total_steps, settings.sft_warmup_steps
    )
    rng, losses = random.Random(config.seed), []
    model.train()
    with tqdm(total=total_steps, desc="sft", disable=not progress) as bar:
        for _ in range(settings.sft_epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for start in range(0, len(order), settings.sft_batch_size):
                chosen = [pairs[i] for i in order[start : start + settings.sft_batch_size]]
                batch = collate(
                    [p for p, _ in chosen], [c for _, c in chosen], pad_token_id, device
                )
                logps, _ = loss.completion_logps(model, batch, 1.0, 0.0)
                mask = batch["completion_mask"]
                step_loss = -(logps * mask).sum() / mask.sum()  # [B, C] -> the token mean
                step_loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(step_loss.item())
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def warm_start(config, run_dir: str, wrap_lora) -> str:
    """SFT with LoRA (``wrap_lora``: sage.py's), merged into the base and saved as
    <run>/sft_model; returns its path.

    On --resume the saved model is reused. <run>/sft_stats.json records how many examples were
    kept and how many dropped (a non-numeric answer, or longer than --sft-max-tokens).
    """
    from machinery import models, runs
    from task.problems import load_rows

    settings, final = config.extras["sft"], os.path.join(run_dir, "sft_model")
    if config.resume and os.path.exists(os.path.join(final, "config.json")):
        if settings.sft_only:  # done before: nothing to train, and no RL to start
            tqdm.write(f"sft: {final} is saved already; --sft-only, so no RL")
            raise SystemExit(0)
        return final
    tokenizer = models.load_tokenizer(config.model)
    rows = load_rows(settings.sft_dataset, settings.sft_dataset_config, settings.sft_split)
    examples, not_numeric = sft_examples(
        rows,
        settings.sft_problem_key,
        settings.sft_reasoning_key,
        settings.sft_answer_key,
        settings.sft_dataset,
    )
    max_tokens = settings.sft_max_tokens or config.max_seq_len // 2
    pairs, stats = tokenize_sft_examples(tokenizer, examples, max_tokens, settings.sft_max_samples)
    model = models.load_base_model(config.model, config.gradient_checkpointing)  # data first
    loss.attend_somewhere_under_sdpa()  # its batches are left-padded
    runs.save_run_config(run_dir, config)  # the SFT stage can start: its data and model loaded
    runs.write_json_atomic(
        os.path.join(run_dir, "sft_stats.json"), {**stats, "dropped_not_numeric": not_numeric}
    )
    tqdm.write(
        f"sft: {stats['kept']} examples of at most {max_tokens} tokens "
        f"({stats['dropped_too_long']} longer ones and {not_numeric} non-numeric ones dropped)"
    )
    model = wrap_lora(model, config.lora_rank, config.lora_alpha)
    sft(model, pairs, tokenizer.pad_token_id, settings, config)
    final = runs.save_model_atomic(model.merge_and_unload(), tokenizer, final)
    if settings.sft_only:  # Table 1's recipe: one SFT model, the base of every RL row
        tqdm.write(f"sft: saved {final}; --sft-only, so no RL")
        raise SystemExit(0)
    del model
    gc.collect()  # return the SFT model's GPU memory before RL loads its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return final
