"""docs/gpu.md's table of the memory plan: model length x card, with the largest micro-batch that
fits and the run's forecast peak, for the paper's 7B shape (Qwen2.5-Math-7B; the R1-distill 7B
has the same shape) and sage.py's defaults (8 x 8 sequences, prompts of up to 512 tokens, LoRA
rank 8, gradient checkpointing).

The update is simulated once per length and micro-batch (``memory_sim.simulate_update``, up
to a minute each at the 7B shape on a laptop CPU); each card's verdict is ``memory_report.plan``'s
on that simulation: a micro-batch fits when the update's peak (the engine asleep) and the
trainer's resident bytes beside the awake engine both fit the card's usable memory.

    python bench/memory_table.py                      # 2,048 and 8,192 tokens, 5 cards
    python bench/memory_table.py --lengths 1024 --micro-batches 1,2   # a quick look

Prints the markdown table, then one JSON object as its last line: rows (length, card_gb,
largest_micro_batch, run_peak_gb, engine_sequences_at_once, rollout_waves, engine_problem) and
update_peak_gb (per length, per micro-batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch
from transformers import Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sage  # noqa: E402
from extras import memory_report, memory_sim  # noqa: E402
from machinery import memory_plan  # noqa: E402


def card_row(config, card_gb: float, updates: dict) -> dict:
    """One card's verdict at one length: the largest simulated micro-batch whose plan fits
    (``memory_report.plan`` on the update simulated already)."""
    for size in sorted(updates, reverse=True):
        trial = dataclasses.replace(config, micro_batch_size=size)
        result = memory_report.plan(
            trial,
            card_bytes=int(card_gb * 1e9),
            with_reference=sage.needs_reference(trial),
            update=updates[size],
        )
        if result["fits"]:
            break
    fits = result["fits"]
    return {
        "length": config.max_seq_len,
        "card_gb": card_gb,
        "largest_micro_batch": result["micro_batch_size"] if fits else None,
        "run_peak_gb": result["run_peak_gb"] if fits else None,
        "engine_sequences_at_once": result["engine_sequences_at_once"],
        "rollout_waves": result["rollout_waves"],
        "engine_problem": result["engine_problem"],
    }


def markdown(rows: list[dict], update_peaks: dict) -> str:
    lines = [
        "| length | card | largest micro-batch | run peak | engine holds (waves) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if row["engine_problem"]:
            verdict, peak, engine = "none: the engine does not fit", "-", "-"
        elif row["largest_micro_batch"] is None:
            verdict, peak = "none", "-"
            engine = f"{row['engine_sequences_at_once']} ({row['rollout_waves']})"
        else:
            largest = row["largest_micro_batch"]
            simulated = max(update_peaks[row["length"]])
            verdict = (
                f"{largest} or more (largest simulated)" if largest == simulated else str(largest)
            )
            peak = f"{row['run_peak_gb']:.1f} GB"
            engine = f"{row['engine_sequences_at_once']} ({row['rollout_waves']})"
        lines.append(
            f"| {row['length']:,} | {row['card_gb']:g} GB | {verdict} | {peak} | {engine} |"
        )
    lines.append("")
    lines.append("| length | update peak by micro-batch |")
    lines.append("| --- | --- |")
    for length, peaks in update_peaks.items():
        text = ", ".join(f"{size}: {peak / 1e9:.1f} GB" for size, peak in peaks.items())
        lines.append(f"| {length:,} | {text} |")
    return "\n".join(lines)


def positive_list(kind):
    """An argparse type: "1,2,4" -> [1, 2, 4] of ``kind``, each above zero (else one line)."""

    def parse(text: str) -> list:
        try:
            values = [kind(value) for value in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
        if min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be above zero")
        return values

    return parse


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--lengths", type=positive_list(int), default="2048,8192", help="--max-seq-len values")
    cards_gb = ",".join(map(str, memory_report.CARDS_GB))
    add("--cards", type=positive_list(float), default=cards_gb, help="cards, in GB")
    add("--micro-batches", type=positive_list(int), default="1,2,4,8,16,32")
    args = parser.parse_args(argv)
    lengths, cards, micro_batches = args.lengths, args.cards, args.micro_batches
    prompt_len = sage.Config(model="").max_prompt_len
    if min(lengths) <= prompt_len:
        parser.error(f"--lengths must exceed the prompts' {prompt_len} tokens")
    started = time.perf_counter()
    rows, update_peaks = [], {}
    with tempfile.TemporaryDirectory() as folder:
        shape = {**memory_plan.QWEN25_MATH_7B, "max_position_embeddings": 32768}  # 8,192 tokens
        Qwen2Config(**shape, tie_word_embeddings=False).save_pretrained(folder)
        model_config = memory_plan.read_model_config(folder)
        for length in lengths:
            config = sage.Config(model=folder, max_seq_len=length)
            dtype = memory_plan.trainer_dtype(config)
            updates = {}
            for size in micro_batches:
                trial = dataclasses.replace(config, micro_batch_size=size)
                updates[size] = memory_sim.simulate_update(model_config, trial, dtype)
                gigabytes = updates[size]["peak"] / 1e9
                print(f"length {length}, micro-batch {size}: {gigabytes:.1f} GB", flush=True)
            update_peaks[length] = {size: update["peak"] for size, update in updates.items()}
            rows += [card_row(config, card, updates=updates) for card in cards]
    print(markdown(rows, update_peaks))
    result = {
        "rows": rows,
        "update_peak_gb": {
            str(length): {str(size): round(peak / 1e9, 2) for size, peak in peaks.items()}
            for length, peaks in update_peaks.items()
        },
        "wall_s": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
