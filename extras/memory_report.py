"""``sage.py --plan-memory``: a run's GPU memory forecast for people, then one JSON line.

The numbers are machinery/memory_plan.py's ``forecast`` (the update by the formula, or by
extras/memory_sim.py's simulation of the same flags), the verdict its ``does_not_fit``, with the
largest micro-batch that fits when the run fits. Only the model's config.json is read.
"""

from __future__ import annotations

import json

from machinery import memory_plan

CARDS_GB = (24, 40, 48, 80, 141)  # the cards bench/memory_table.py tabulates
UNCOUNTED = "allocator rounding, fragmentation and CUDA workspaces are not counted"


def plan(config, card_bytes: int, with_reference: bool, update: dict | None = None) -> dict:
    """The forecast of a run on a card of ``card_bytes``, in GB: the update's peak, the engine's
    share, the run's peak, the verdict, the largest micro-batch that fits and the fix. The
    update's bytes are the formula's, or ``update`` (extras/memory_sim.py's simulation of this
    config, whose check the formula is); the plan reports the formula's peak either way."""
    peaks = memory_plan.forecast(config, card_bytes, with_reference, update=update)
    update, engine, sampling = peaks["update"], peaks["engine"], peaks["sampling"]
    largest = memory_plan.largest_micro_batch(peaks, config, with_reference)

    def gigabytes(value: float) -> float:
        return round(value / 1e9, 2)

    if peaks["fits"]:
        verdict = (
            f"fits a {gigabytes(card_bytes):g} GB card: peak {peaks['run_peak'] / 1e9:.1f} GB of "
            f"the {peaks['usable'] / 1e9:.1f} GB usable; the largest micro-batch that fits is "
            f"{largest}"
        )
    else:
        verdict = memory_plan.does_not_fit(peaks, config, card_bytes, with_reference)

    return {
        "model": config.model,
        "gpu_gb": gigabytes(card_bytes),
        "fits": peaks["fits"],
        "verdict": verdict,
        "update_peak_gb": gigabytes(update["peak"]),
        "update_peak_op": update["peak_op"],
        "update_peak_formula_gb": gigabytes(peaks["formula"]["peak"]),
        "update_simulated": update is not peaks["formula"],
        "trainer_weights_gb": gigabytes(update["weights"]),
        "trainer_resident_gb": gigabytes(update["resident"]),
        "engine_weights_gb": gigabytes(engine["weights"]),
        "engine_kv_cache_gb": gigabytes(engine["kv_cache"]),
        "engine_needs_gb": gigabytes(engine["weights"] + engine["working"] + engine["kv_cache"]),
        "engine_share": engine["share"] and round(engine["share"], 2),
        "engine_sequences_at_once": engine["sequences"],
        "rollout_waves": engine["waves"],
        "hf_sampling_gb": gigabytes(sampling["peak"]),
        "hf_kv_cache_gb": gigabytes(sampling["kv_cache"]),
        "hf_backend_fits": peaks["hf_peak"] <= peaks["usable"],
        "probe_activations_gb": gigabytes(peaks["probe"]["peak"]),
        "probe_peak_gb": gigabytes(peaks["awake"] + peaks["probe"]["peak"]),
        "probe_counted": peaks["probe_counted"],
        "run_peak_gb": gigabytes(peaks["run_peak"]),
        "trainer_peak_gb": gigabytes(peaks["trainer_peak"]),
        "usable_gb": gigabytes(peaks["usable"]),
        "largest_micro_batch": largest,
        "engine_problem": peaks["engine_problem"] or None,
        "dtype": str(peaks["dtype"]).removeprefix("torch."),
        "micro_batch_size": config.micro_batch_size,
        "max_seq_len": config.max_seq_len,
        "max_prompt_len": config.max_prompt_len,
        "sequences_per_step": config.prompts_per_step * config.rollouts,
        "lora_rank": None if config.full_finetune else config.lora_rank,
        "gradient_checkpointing": config.gradient_checkpointing,
        "not_counted": UNCOUNTED,
    }


def engine_line(result: dict, config) -> str:
    """The engine's row of the report: its bytes, the sequences it holds at once, its share."""
    if config.backend != "vllm":
        return "none: --backend hf samples with the trainer's own model"
    weights = f"weights {result['engine_weights_gb']:.2f} GB"
    if result["engine_share"] is None:
        return f"{result['engine_needs_gb']:7.2f} GB ({weights}): no share fits (see the verdict)"
    waves = result["rollout_waves"]
    held = f"{result['engine_sequences_at_once']} sequences at once"
    held += f", the step in {waves} waves" if waves > 1 else " (the whole step)"
    return (
        f"{result['engine_needs_gb']:7.2f} GB ({weights}, KV cache "
        f"{result['engine_kv_cache_gb']:.2f} GB for {held}), given "
        f"{result['engine_share']:.2f} of the card"
    )


def print_report(result: dict, config) -> None:
    """The forecast for people, then one JSON line."""
    simulated = result["update_simulated"]
    counted = "simulated on the meta device" if simulated else "by the formula"
    beside = f"; the formula: {result['update_peak_formula_gb']:.2f} GB" if simulated else ""
    lines = [
        f"memory plan of {result['model']} ({result['dtype']}, micro-batch "
        f"{result['micro_batch_size']}, {result['sequences_per_step']} sequences of "
        f"{result['max_seq_len']} tokens, the update {counted}; {UNCOUNTED}):",
        f"  trainer, resident     {result['trainer_resident_gb']:7.2f} GB (weights "
        f"{result['trainer_weights_gb']:.2f} GB, adapters and AdamW states)",
        f"  trainer, update peak  {result['update_peak_gb']:7.2f} GB (the engine asleep{beside})",
        f"  engine                {engine_line(result, config)}",
    ]
    if config.backend == "hf":  # what generate holds beside the trainer's weights
        lines.append(
            f"  sampling (generate)   {result['hf_sampling_gb']:7.2f} GB (KV cache "
            f"{result['hf_kv_cache_gb']:.2f} GB for {result['sequences_per_step']} rows of "
            f"{result['max_seq_len']} tokens at once, beside the trainer's resident bytes)"
        )
    if result["probe_counted"]:  # the support probe beside the awake engine
        beside = "the trainer's resident bytes" + (
            " and the awake engine" if config.backend == "vllm" else ""
        )
        lines.append(
            f"  support probe         {result['probe_peak_gb']:7.2f} GB (its logits and their "
            f"float32 copies, {result['probe_activations_gb']:.2f} GB for "
            f"{result['micro_batch_size']} problems at once, beside {beside})"
        )
    lines.append(f"  run peak              {result['run_peak_gb']:7.2f} GB")
    lines.append(f"verdict: {result['verdict']}")
    print("\n".join(lines))
    print(json.dumps(result))


def print_plan(config, with_reference: bool, update: dict | None = None) -> None:
    """--plan-memory: the forecast on --gpu-gb's card, the update by the formula at once, or
    ``update`` simulated (``python -m extras.memory_sim`` with the same flags)."""
    card_bytes = memory_plan.card_of(config)
    print_report(plan(config, card_bytes, with_reference, update), config)
