"""One update step of a Qwen2.5-Math-7B-shaped model on the GPU: its measured peak against the plan.

The step is the one the memory plan's check simulates (``extras.memory_sim.simulate_update``),
run for real: a randomly initialized model built from its config (``from_config``, nothing
downloaded) in the trainer's dtype (bf16 on CUDA), gradient checkpointing on, LoRA rank 8 as
``sage.make_policy`` wraps it, AdamW's moments made by a first step (the steady state the plan
counts), then the first two micro-batches of a step at full length (sage.py's defaults: 4
sequences of ``--prompt-len`` + 1,536 tokens each): ``sage.held_fixed_logps`` (the reference,
the adapter off) and ``sage.update_policy`` (the chunked log-probs of machinery/fast_logprobs.py,
the loss, its backward and one AdamW step). Beside it, the plan's update peak of the same config
(``simulate_update`` on the meta device, the figure ``python -m extras.memory_sim`` prints as
"trainer, update peak"; the closed form the run's refusal reads beside it). At 256 + 1,536
tokens that figure is docs/gpu.md's 20.27 GB; at sage.py's own default, 512 + 1,536, it is 20.96.

Measured on CUDA: ``torch.cuda.max_memory_allocated`` over the step (the weights and AdamW states
included, as the plan counts them), ``max_memory_reserved``, and the storages counted one by one
as the plan counts them (``memory_sim.LiveStorages`` on the device: what the simulation would
have to match exactly, apart from the allocator). The step fails the check when its loss or
gradient norm is not finite, when no trained weight moved, or when the measured peak exceeds the
simulation or the closed form by more than the 5% of the card the plan keeps free for what it
does not count.

``--tiny`` runs the same code at a small shape (on the CPU in float32, where the counted storages
stand for the measured peak), so the script is tested without a GPU.

usage (from the project root): python bench/gpu_check_update.py [--tiny] [--prompt-len 256 512]
Prints one JSON object as its last line; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_step  # noqa: E402  (bench/, the script's own directory)

import sage  # noqa: E402
from extras import memory_sim  # noqa: E402
from machinery import cli, memory_plan, models  # noqa: E402

DOCUMENTED_PLAN_GB = {256: 20.27}  # docs/gpu.md: the plan's update peak at 256 + 1,536 tokens
TINY = gpu_step.SMALL  # the small shape bench/gpu_step.py measures


def model_config(shape: dict):
    """The Qwen2 config of the shape (Qwen2.5-Math-7B's unless --tiny), as bench/gpu_step.py
    builds it."""
    from transformers import Qwen2Config

    return Qwen2Config(
        **shape,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )


def run_config(model_dir: str, prompt_len: int, args) -> sage.Config:
    """sage.py's Config for a run on that model at this shape (its other flags the defaults)."""
    return sage.parse_config(
        [
            "--model",
            model_dir,
            "--max-prompt-len",
            str(prompt_len),
            "--max-seq-len",
            str(prompt_len + args.completion_len),
            "--micro-batch-size",
            str(args.micro_batch_size),
            "--lora-rank",
            str(args.lora_rank),
        ]
    )


def build_policy(config, model_cfg, device: torch.device, dtype: torch.dtype):
    """The trainer's policy, reference and AdamW (its moments made) on the device, as
    ``memory_sim.build_trainer`` builds them for the simulation, with the attention the trainer
    picks there (flash-attention 2 or SDPA)."""
    attention = models.attention_implementation(dtype)
    return memory_sim.build_trainer(model_cfg, config, dtype, device, attention=attention)


def measure_step(policy, reference, optimizer, config, model_cfg, count: bool) -> dict:
    """One steady-state update on the first two micro-batches of a full-length step, as
    ``memory_sim.simulate_update`` runs it: peak memory, time, loss, gradient norm and how far
    the trained weights moved."""
    device = next(policy.parameters()).device
    on_cuda = device.type == "cuda"
    trained = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().to("cpu", copy=True) for p in trained]  # off the GPU: not in its peak
    counter = memory_sim.LiveStorages(device.type)
    for tensor in (t for m in (policy, reference) if m is not None for t in m.parameters()):
        counter.add(tensor, "weights")
    for tensor in (t for m in (policy, reference) if m is not None for t in m.buffers()):
        counter.add(tensor, "weights")
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type == device.type:
                counter.add(value, "AdamW state")
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start_allocated = torch.cuda.memory_allocated() if on_cuda else None
    started = time.perf_counter()
    with counter if count else _nothing():
        metrics = memory_sim.train_on_step_rollouts(policy, reference, optimizer, config, model_cfg)
    if on_cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - started
    moved = max(
        (p.detach().cpu().float() - b.float()).abs().max().item() for p, b in zip(trained, before)
    )
    return {
        "measured_peak_gb": _gb(torch.cuda.max_memory_allocated()) if on_cuda else None,
        "measured_reserved_gb": _gb(torch.cuda.max_memory_reserved()) if on_cuda else None,
        "allocated_before_step_gb": _gb(start_allocated) if on_cuda else None,
        "counted_peak_gb": _gb(counter.peak) if count else None,
        "counted_peak_op": counter.peak_op if count else None,
        "step_s": round(step_s, 2),
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "weights_moved_max_abs": moved,
        "rows": memory_sim.simulated_rows(config),
    }


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _gb(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 1e9, 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small shape (runs on the CPU)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs="+",
        help="prompt tokens, one step per value (default: 256 512; --tiny: 32)",
    )
    parser.add_argument("--completion-len", type=int, help="completion tokens (1536; --tiny: 64)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sage.py's default")
    parser.add_argument("--lora-rank", type=int, default=8, help="sage.py's default")
    parser.add_argument(
        "--count",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also count the step's storages one by one, as the plan does",
    )
    parser.add_argument("--no-plan", action="store_true", help="skip the plan's simulation")
    args = parser.parse_args(argv)
    if (problem := cli.torch_build_problem()) is not None:
        raise SystemExit(f"error: {problem}")
    args.prompt_len = args.prompt_len or ([32] if args.tiny else [256, 512])
    args.completion_len = args.completion_len or (64 if args.tiny else 1536)
    shape = TINY if args.tiny else memory_plan.QWEN25_MATH_7B
    device, dtype = models.device_and_dtype()
    on_cuda = device.type == "cuda"
    model_cfg = model_config(shape)
    total = torch.cuda.get_device_properties(0).total_memory if on_cuda else None
    allowance = memory_plan.GPU_HEADROOM * total / 1e9 if on_cuda else None
    result = {
        "device": torch.cuda.get_device_name(0) if on_cuda else "cpu",
        "card_gb": _gb(total),
        "shape": "tiny" if args.tiny else "qwen2.5-math-7b",
        "dtype": str(dtype).removeprefix("torch."),
        "attention": models.attention_implementation(dtype),
        "torch": torch.__version__,
        "steps": [],
    }
    failures = []
    with tempfile.TemporaryDirectory() as model_dir:
        model_cfg.save_pretrained(model_dir)
        configs = [run_config(model_dir, length, args) for length in args.prompt_len]
        started = time.perf_counter()
        torch.manual_seed(0)
        policy, reference, optimizer = build_policy(configs[0], model_cfg, device, dtype)
        result["build_s"] = round(time.perf_counter() - started, 1)
        for prompt_len, config in zip(args.prompt_len, configs):
            row = {
                "prompt_len": prompt_len,
                "completion_len": args.completion_len,
                "micro_batch_size": config.micro_batch_size,
                "gradient_checkpointing": config.gradient_checkpointing,
                "fast_logprobs": config.fast_logprobs,
                "lora_rank": config.lora_rank,
            }
            row |= measure_step(policy, reference, optimizer, config, model_cfg, args.count)
            if on_cuda:
                torch.cuda.empty_cache()
            if not args.no_plan:  # the same step simulated, in the measured dtype
                started = time.perf_counter()
                simulated = memory_sim.simulate_update(model_cfg, config, dtype)
                row["plan_gb"] = _gb(simulated["peak"])
                formula = memory_plan.estimate_update_peak(
                    model_cfg, config, dtype, sage.needs_reference(config)
                )
                row["formula_gb"] = _gb(formula["peak"])
                row["plan_s"] = round(time.perf_counter() - started, 1)
                row["documented_plan_gb"] = (
                    None if args.tiny else DOCUMENTED_PLAN_GB.get(prompt_len)
                )
                measured = row["measured_peak_gb"] or row["counted_peak_gb"]
                if measured is not None and row["plan_gb"]:
                    row["ratio"] = round(measured / row["plan_gb"], 3)
                if on_cuda:
                    row["over_plan_gb"] = round(row["measured_peak_gb"] - row["plan_gb"], 3)
                    for name, planned in (("simulation", "plan_gb"), ("closed form", "formula_gb")):
                        if row["measured_peak_gb"] - row[planned] > allowance:
                            failures.append(
                                f"prompt {prompt_len}: measured {row['measured_peak_gb']} GB, more "
                                f"than the {name}'s {row[planned]} GB + {allowance:.1f} GB headroom"
                            )
            for key in ("loss", "grad_norm"):
                if not (isinstance(row[key], float) and math.isfinite(row[key])):
                    failures.append(f"prompt {prompt_len}: {key} is {row[key]}")
            if not row["weights_moved_max_abs"] > 0:
                failures.append(f"prompt {prompt_len}: no trained weight moved")
            result["steps"].append(row)
            print(json.dumps(row), flush=True)
    result["failures"] = failures
    result["ok"] = not failures
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
