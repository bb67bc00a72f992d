"""The base model of a run: the name it loads by, loaded for the device it trains on, and what
fits on one GPU.

* A --model is a local directory or a hub ``org/name`` as it is, or a short name of the paper's
  models (Qwen2.5-Math-7B) with its organization, said once; any other bare name is refused in
  one line naming ``org/name`` (``resolve_model``). A hub name that is not in the local cache is
  first asked of the hub once, briefly (``check_hub_reach``), so that an unreachable hub is one
  line, not the loaders' minutes of retries (docs/implementation.md, item 16).
* The base model loads in bf16 on CUDA (float32 on CPU), with flash-attention 2 when a build is
  installed (else PyTorch's SDPA), and gradient checkpointing for long completions.
  Fine-tuning every weight keeps them in float32 on CUDA too: an AdamW step of lr = 5e-6 is
  smaller than half a bf16 step of any weight above 2e-3 in size, so in bf16 most updates would
  round away and training would silently stall.
* On the CPU, freed activations stay with the process for the next micro-batch
  (``keep_freed_memory``).
* AdamW with linear warmup and linear decay (App. E, Table 8). (The policy and its reference
  pi_ref are made in sage.py; what fits the device is machinery/memory_plan.py's to say.)
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from machinery import UsageError
from machinery.vllm_backend import one_line

# Short names -> hub names: the paper's models (docs/gpu.md: Qwen2.5-Math-7B, the base of Table
# 1, and DeepSeek-R1-Distill-Qwen-7B, its R1-distill rows), their 1.5B siblings, and Llama 3.1 8B.
SHORT_NAMES = {
    name.lower(): f"{org}/{name}"
    for org, name in [
        ("Qwen", "Qwen2.5-Math-7B"),
        ("Qwen", "Qwen2.5-Math-1.5B"),
        ("deepseek-ai", "DeepSeek-R1-Distill-Qwen-7B"),
        ("deepseek-ai", "DeepSeek-R1-Distill-Qwen-1.5B"),
        ("meta-llama", "Llama-3.1-8B"),
        ("meta-llama", "Llama-3.1-8B-Instruct"),
    ]
}
REACH_TIMEOUT_S = 5.0  # one try; a hub that answers at all answers well within this


class ModelError(UsageError):
    """A --model that names nothing loadable, or a hub that cannot be reached (one line)."""


def resolve_model(model: str) -> str:
    """``model`` as the loaders take it: a local path as it is, a short name (any case) with its
    organization; a hub name must be in the cache or answer (``check_hub_reach``)."""
    if os.path.exists(os.path.expanduser(model)):
        return model
    if "/" not in model:
        if model.lower() not in SHORT_NAMES:
            known = ", ".join(name.split("/")[1] for name in SHORT_NAMES.values())
            raise ModelError(
                f"--model {model}: neither a local directory nor a known model ({known}); name a "
                "hub model as org/name, e.g. Qwen/Qwen2.5-Math-7B"
            )
        print(f"[model] {model} is {SHORT_NAMES[model.lower()]} on the hub", file=sys.stderr)
        model = SHORT_NAMES[model.lower()]
    check_hub_reach(model)
    return model


def check_hub_reach(model: str) -> None:
    """A ModelError for a hub name that is neither cached nor answered within
    ``REACH_TIMEOUT_S`` (HF_HUB_OFFLINE=1 never asks)."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return
    try:
        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return  # cached: the loaders fall back to it at once
        model_info(model, timeout=REACH_TIMEOUT_S)  # one try, no retries
    except (ValueError, HfHubHTTPError):  # not a hub name, or the hub answered: the loader says
        return
    except Exception as error:  # noqa: BLE001 -- the HTTP client's refused, no route, timed out
        raise ModelError(
            f"--model {model}: the hub at {constants.ENDPOINT} cannot be reached "
            f"({one_line(error)}) and the model is not in the local cache: check the network (or "
            "HF_ENDPOINT), or pass a local model directory"
        ) from None


def cannot_load(model: str, error: BaseException) -> str:
    """The one line of a model that does not load (its config.json, tokenizer or weights), the
    same from the memory plan and the loader."""
    return (
        f"error: cannot load model {model!r} ({one_line(error)}); pass a local model directory "
        "or a cached hub name"
    )


def device_and_dtype(full_finetune: bool = False) -> tuple[torch.device, torch.dtype]:
    """bf16 on CUDA (float32 when every weight is trained: see above), float32 on CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.float32 if full_finetune else torch.bfloat16
    return torch.device("cpu"), torch.float32


def attention_implementation(dtype: torch.dtype) -> str:
    """flash-attention 2 in bf16 (or fp16) when transformers finds a build installed, else
    PyTorch's SDPA (transformers' own default whatever is installed)."""
    from transformers.utils import is_flash_attn_2_available

    half = dtype in (torch.bfloat16, torch.float16)
    return "flash_attention_2" if half and is_flash_attn_2_available() else "sdpa"


def enable_gradient_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward: one layer input per token is kept
    instead of all activations (a 7B Qwen2 keeps ~10 MB per token without it: docs/gpu.md).

    With LoRA the embedding output has no gradient of its own, so a hook marks it as needing one
    (transformers' ``enable_input_require_grads``, what peft's k-bit preparation does): without
    it a reentrant checkpoint would see no input that needs a gradient and drop the adapters'.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory of freed activations for the next micro-batch: by
    default a block over 128 KiB is mapped fresh, unmapped when freed, and every page of it
    faults and is zero-filled again at first touch (docs/history.md). Blocks up to 32 MiB come
    from the heap, and up to 1 GiB of it stays with the process. Whether both settings took
    (False where the C library is not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own C library
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, 32 * 2**20)) and bool(mallopt(M_TRIM_THRESHOLD, 2**30))


def load_tokenizer(path: str):
    """The tokenizer of a hub name or a local directory, padding with EOS where it names no pad
    token; one line if it does not load."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise SystemExit(cannot_load(path, error)) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(path: str, gradient_checkpointing: bool = False, full_finetune: bool = False):
    """The base model from a hub name or a local directory, on the GPU if there is one, in its
    dtype; one line if it does not load."""
    from transformers import AutoModelForCausalLM

    device, dtype = device_and_dtype(full_finetune)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attention_implementation(dtype)
        )
    except (OSError, ValueError) as error:
        raise SystemExit(cannot_load(path, error)) from None
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if device.type == "cpu":
        keep_freed_memory()
    return model.to(device)


def make_optimizer(model, lr: float, weight_decay: float, total_steps: int, warmup_steps: int):
    """AdamW on the trainable parameters with linear warmup and linear decay to 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def resident_bytes(*models) -> int:
    """What the trainer keeps on its device between steps: the models' weights and buffers (None:
    a LoRA reference, the policy with its adapters off) and AdamW's two moments of each trained
    weight, in its dtype, whether or not a first step has made them yet.

    >>> layer = torch.nn.Linear(4, 2)  # 10 float32 parameters, trained
    >>> resident_bytes(layer, None)  # 40 bytes of weights, 80 of moments
    120
    """
    total = 0
    for model in filter(None, models):
        total += sum(buffer.nbytes for buffer in model.buffers())
        total += sum(p.nbytes * (3 if p.requires_grad else 1) for p in model.parameters())
    return total


def parameter_count(config) -> int:
    """The model's parameters, counted on the meta device (nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
