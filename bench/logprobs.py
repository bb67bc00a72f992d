"""Peak memory and time of the trainer's log-prob + entropy kernel vs a naive float32 path.

Both paths take the same logits [batch, length, vocab] (vocab 32768, length 1024, batch 4 by
default), compute the sampled tokens' log-probs and the full-vocabulary entropies, and run the
backward of a random linear function of the log-probs:

    naive:  z = logits.float() / T; logp_all = log_softmax(z); entropy from softmax(z) * logp_all
            (what loss.token_logps_and_entropies, the definition, does too)
    ours:   machinery/fast_logprobs.py's chunked_token_logps_and_entropies (row chunks, a
            chunked backward that writes the gradient into the logits' own storage, as the
            trainer uses it through loss.completion_logps)

Memory is what each path adds on top of the logits it is given, at its peak, forward and
backward together (the gradient of the logits included). On CUDA it is read from the caching
allocator's peak counter; on CPU each path runs in a fresh subprocess and the peak is the rise
of the process's peak resident set size (VmHWM, reset once the logits exist) over its size then.
Time is the median of several forward+backward passes, both paths in the same run.

Prints one JSON object as its last line: peak_memory_ratio (ours / naive; goal <= 0.25),
time_ratio (ours / naive; goal <= 1.5), the same two for the copy-gradient variant, and the raw
numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machinery.fast_logprobs import chunked_token_logps_and_entropies  # noqa: E402

MiB = 2**20


def naive_logps_and_entropies(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float):
    """The straightforward float32 path: full log_softmax, softmax for the entropy."""
    z = logits.float() / temperature
    logp_all = torch.log_softmax(z, dim=-1)  # [B, T, V] float32
    logps = logp_all.gather(-1, token_ids[..., None]).squeeze(-1)
    with torch.no_grad():
        entropies = -(torch.softmax(z, dim=-1) * logp_all).sum(-1)
    return logps, entropies


PATHS = {
    "naive": naive_logps_and_entropies,
    "ours": lambda logits, ids, temperature: chunked_token_logps_and_entropies(
        logits, ids, temperature
    ),
    # The same chunked path with a fresh gradient tensor (inplace_backward=False), for reference.
    "ours_copy_grad": lambda logits, ids, temperature: chunked_token_logps_and_entropies(
        logits, ids, temperature, inplace_backward=False
    ),
}


def make_inputs(args, device):
    # drawn on the device: at Qwen's vocabulary a CPU draw of the logits takes seconds per call
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.length, args.vocab)
    dtype = getattr(torch, args.dtype)
    logits = torch.randn(shape, generator=generator, device=device) * 2.0
    logits = logits.to(dtype=dtype).requires_grad_()
    token_ids = torch.randint(0, args.vocab, shape[:2], generator=generator, device=device)
    upstream = torch.randn(shape[:2], generator=generator, device=device)
    return logits, token_ids, upstream


def step(path, logits, token_ids, upstream, temperature):
    logps, entropies = path(logits, token_ids, temperature)
    (logps * upstream).sum().backward()
    grad = logits.grad
    logits.grad = None
    return grad, entropies


def resident_set(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def measure_cpu_peak(name: str, args) -> float:
    """Run in a fresh process: the rise of peak RSS over RSS once the logits exist, in MiB."""
    logits, token_ids, upstream = make_inputs(args, "cpu")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
    baseline = resident_set("VmRSS")
    step(PATHS[name], logits, token_ids, upstream, args.temperature)
    return (resident_set("VmHWM") - baseline) / MiB


def measure_cuda_peak(name: str, args) -> float:
    logits, token_ids, upstream = make_inputs(args, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    step(PATHS[name], logits, token_ids, upstream, args.temperature)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - baseline) / MiB


def measure_time(name: str, args, device) -> float:
    logits, token_ids, upstream = make_inputs(args, device)
    original = logits.detach().clone()
    times = []
    for _ in range(args.warmup + args.repeats):
        with torch.no_grad():
            logits.copy_(original)  # the in-place backward leaves the gradient in the logits
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(PATHS[name], logits, token_ids, upstream, args.temperature)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup :])


def check_agreement(args, device) -> float:
    """Max |difference| between the two paths' gradients and entropies (sanity)."""
    logits, token_ids, upstream = make_inputs(args, device)
    grad_naive, entropy_naive = step(PATHS["naive"], logits, token_ids, upstream, args.temperature)
    grad_ours, entropy_ours = step(PATHS["ours"], logits, token_ids, upstream, args.temperature)
    return max(
        (grad_naive - grad_ours).abs().max().item(),
        (entropy_naive - entropy_ours).abs().max().item(),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument(
        "--dtype", default="float32", help="dtype of the given logits (float32 or bfloat16)"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--_peak-of", dest="peak_of", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.peak_of:  # child process: one CPU memory measurement
        print(json.dumps({"peak_mib": measure_cpu_peak(args.peak_of, args)}))
        return

    peaks = {}
    for name in PATHS:
        if args.device == "cuda":
            peaks[name] = measure_cuda_peak(name, args)
        else:
            child = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--_peak-of", name, *sys.argv[1:]],
                capture_output=True,
                text=True,
                check=True,
            )
            peaks[name] = json.loads(child.stdout.strip().splitlines()[-1])["peak_mib"]
    times = {name: measure_time(name, args, args.device) for name in PATHS}
    logits_mib = (
        args.batch
        * args.length
        * args.vocab
        * torch.finfo(getattr(torch, args.dtype)).bits
        / 8
        / MiB
    )
    result = {
        "peak_memory_ratio": round(peaks["ours"] / peaks["naive"], 4),
        "time_ratio": round(times["ours"] / times["naive"], 4),
        "peak_memory_ratio_copy_grad": round(peaks["ours_copy_grad"] / peaks["naive"], 4),
        "time_ratio_copy_grad": round(times["ours_copy_grad"] / times["naive"], 4),
        "ours_peak_added_mib": round(peaks["ours"], 1),
        "ours_copy_grad_peak_added_mib": round(peaks["ours_copy_grad"], 1),
        "naive_peak_added_mib": round(peaks["naive"], 1),
        "logits_mib": round(logits_mib, 1),
        "ours_seconds": round(times["ours"], 4),
        "naive_seconds": round(times["naive"], 4),
        "max_abs_diff": check_agreement(args, args.device),
        "shape": [args.batch, args.length, args.vocab],
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
