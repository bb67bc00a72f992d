"""One training step of the paper's run on a Qwen2.5-Math-7B-shaped model: peak memory, time, MFU.

The step is ``sage.update_policy`` as the trainer runs it: reference log-probs (the LoRA adapter
switched off), the policy's forward and backward over micro-batches with the branch guide's log q
taken from that same pass, the k3 anchor penalty, and one AdamW step. The model is built by code
with Qwen2.5-Math-7B's exact shape (hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944,
vocabulary 152064) and random weights, in bf16 with LoRA rank 8 and gradient checkpointing, the
defaults of a ``--model`` run. The batch is the paper's: 8 prompts x 8 rollouts, 256-token prompts
and 1,536-token completions (every completion at full length: the worst case for memory).

On a CPU the same step runs at a small shape (``--small``, the default there), so the script
stays tested; on a GPU the full shape is the default.

MFU is model FLOPs over the device's dense bf16 peak. Model FLOPs are those of the step's
arithmetic, not of the hardware: the reference forward, the policy forward, and the policy
backward, which with LoRA computes activation gradients only (the base weights are frozen; the
adapters' FLOPs are negligible) -- 1x the forward's matmuls, 2x its attention. The recomputation
of gradient checkpointing is not counted (the convention of MFU).

Prints one JSON object as its last line: peak_memory_gb (tensors allocated; on CPU the process's
resident peak), peak_reserved_gb (on CUDA what the caching allocator held, fragmentation included:
the figure to leave room for beside the engine; null on CPU), step_s, tokens_per_s, mfu (null on
CPU or an unknown GPU), device, and the shape and batch measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from step import make_rollouts  # noqa: E402  (bench/, the script's own directory)

import guides  # noqa: E402
import loss  # noqa: E402
import sage  # noqa: E402
from bench import common  # noqa: E402
from machinery import cli, memory_plan, models  # noqa: E402

QWEN25_MATH_7B = memory_plan.QWEN25_MATH_7B  # the shape a GPU node measures (--no-small)
SMALL = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=4096,
)
# Dense bf16 peaks (no sparsity), TFLOP/s, by a substring of torch.cuda.get_device_name().
BF16_PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,
    "H200": 989.4,
    "H800": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
}


def build_model(
    shape: dict, dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool
):
    """A randomly initialized Qwen2 of the given shape, created on the device in ``dtype``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **shape, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False
    )
    config._attn_implementation = models.attention_implementation(dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if gradient_checkpointing:
        models.enable_gradient_checkpointing(model)
    return model


def step_model_flops(
    shape: dict, num_sequences: int, prompt_len: int, completion_len: int
) -> float:
    """Model FLOPs of one step (see the module docstring): reference forward + policy forward +
    policy backward (activation gradients only)."""
    d, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    head_dim = d // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    length = prompt_len + completion_len
    linear = (
        2 * layers * (d * (d + 2 * kv + d) + 3 * d * shape["intermediate_size"]) * length
    )  # per sequence
    attention = 2 * layers * d * length * length  # QK^T and AV, causal (half of 2 x 2 x d x L^2)
    lm_head = 2 * d * vocab * completion_len  # only the completion positions are projected
    forward = linear + attention + lm_head
    backward = linear + 2 * attention + lm_head
    return num_sequences * (2 * forward + backward)


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in BF16_PEAK_TFLOPS.items() if key in name), None)


def resident_peak_bytes() -> int:
    """VmHWM: the process's peak resident set (CPU runs)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> dict:
    on_cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--small",
        action=argparse.BooleanOptionalAction,
        default=not on_cuda,
        help="a small model and batch (default on CPU); --no-small for the 7B shape",
    )
    parser.add_argument("--prompts", type=int, help="prompts per step (paper: 8; small: 2)")
    parser.add_argument("--rollouts", type=int, help="completions per prompt (paper: 8; small: 4)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (256; small: 32)")
    parser.add_argument("--completion-len", type=int, help="completion tokens (1536; small: 64)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sage.py's default")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured steps after one warm-up step"
    )
    args = parser.parse_args(argv)
    if (problem := cli.torch_build_problem()) is not None:  # sage.py's refusal
        raise SystemExit(f"error: {problem}")
    paper = dict(prompts=8, rollouts=8, prompt_len=256, completion_len=1536)
    small = dict(prompts=2, rollouts=4, prompt_len=32, completion_len=64)
    for key, value in (small if args.small else paper).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    shape = SMALL if args.small else QWEN25_MATH_7B

    device, dtype = models.device_and_dtype()
    torch.manual_seed(0)
    model = build_model(shape, dtype, device, args.gradient_checkpointing)
    policy = sage.wrap_lora(model, rank=args.lora_rank, alpha=2 * args.lora_rank)
    optimizer, _ = models.make_optimizer(policy, 1e-6, 0.01, 1000, 10)
    rollouts, rewards = make_rollouts(
        args.prompts,
        args.rollouts,
        args.prompt_len,
        args.completion_len,
        shape["vocab_size"],
        seed=0,
        full_length=True,
    )
    advantages = loss.compute_advantages(rewards, args.rollouts, "grpo")
    config = sage.Config(
        model="bench",
        rollouts=args.rollouts,
        micro_batch_size=args.micro_batch_size,
        guide=guides.GuideConfig(name="branch"),
        steps=1000,
        max_seq_len=args.prompt_len + args.completion_len,
        max_prompt_len=args.prompt_len,
    )
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        if on_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        common.update(policy, optimizer, rollouts, advantages, config, 0, generator)
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    step()  # warm-up: kernels chosen, allocator filled
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(args.repeats)]
    peak = torch.cuda.max_memory_allocated() if on_cuda else resident_peak_bytes()
    # What the allocator held (fragmentation included), the budget the engine must fit beside.
    reserved = torch.cuda.max_memory_reserved() if on_cuda else None
    step_s = statistics.median(times)
    tokens = len(rollouts.completion_ids) * (args.prompt_len + args.completion_len)
    flops = step_model_flops(
        shape, len(rollouts.completion_ids), args.prompt_len, args.completion_len
    )
    peak_flops = peak_tflops(device)
    result = {
        "peak_memory_gb": round(peak / 1e9, 2),
        "peak_reserved_gb": round(reserved / 1e9, 2) if reserved is not None else None,
        "step_s": round(step_s, 3),
        "tokens_per_s": round(tokens / step_s, 1),
        "mfu": round(flops / step_s / (peak_flops * 1e12), 4) if peak_flops else None,
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "shape": "small" if args.small else "qwen2.5-math-7b",
        "sequences": len(rollouts.completion_ids),
        "tokens_per_step": tokens,
        "model_tflop_per_step": round(flops / 1e12, 2),
        "micro_batch_size": args.micro_batch_size,
        "gradient_checkpointing": args.gradient_checkpointing,
        "attention": model.config._attn_implementation,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
