"""The meta-device simulation of one update step: the check of the memory plan's formula.

``memory_plan.estimate_update_peak`` counts the update's peak by arithmetic, and the run's
refusal and ``sage.py --plan-memory`` read it; ``python -m extras.memory_sim`` (``print_plan``),
tests/test_memory_plan.py and bench/memory_table.py simulate the step here, with sage.py's own
functions. The model is built on PyTorch's meta device (shapes and dtypes, no values), wrapped
as sage.py wraps it (LoRA or every weight trained, gradient checkpointing), and one step of
``sage.held_fixed_logps`` and ``sage.update_policy`` runs on a batch of the step's shape with
every prompt and completion at full length (the worst case). A dispatch mode adds each new
storage an op returns and a finalizer removes it when the storage is freed, so the running total
follows what CUDA's ``max_memory_allocated`` counts. Attention is charged as CUDA's fused kernel
holds it (output and log-sum-exp, never the [B, H, L, L] scores) and the log-prob pass takes
CUDA's chunk size. Meta tensors hold no values, so a value the step reads answers as a healthy
step would: a number reads 1, a check passes, and a boolean mask keeps every element.

The step simulated is the steady state: AdamW's moments exist (a step after the first). Its
first two micro-batches run (the later ones repeat the second's allocations; the few MB of
held-fixed per-token values of the others are left out). Allocator rounding, fragmentation and
CUDA workspaces are not counted.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sage
from extras import memory_report
from machinery import cli, memory_plan, models


class LiveStorages(TorchDispatchMode):
    """The bytes of the storages alive on one device type, and their peak, as ops create them.

    On the meta device it also answers the reads of values a meta tensor does not hold."""

    FALSE_ANSWERS = ("any", "eq")  # "is anything bad?" and "are these equal?" read False

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.sizes: dict[int, int] = {}  # storage address -> bytes
        self.total = self.peak = 0
        self.peak_op = ""
        self.false_storages: set[int] = set()

    def add(self, tensor: torch.Tensor, op: str = "") -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.sizes:  # a view, or a storage already counted
            return
        self.sizes[key] = storage.nbytes()
        self.total += storage.nbytes()
        weakref.finalize(storage, self._freed, key)
        if self.total > self.peak:
            self.peak, self.peak_op = self.total, op

    def _freed(self, key: int) -> None:
        self.total -= self.sizes.pop(key, 0)
        self.false_storages.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_meta = self.device_type == "meta"
        if on_meta and func is torch.ops.aten._local_scalar_dense.default:  # .item(), bool()
            tensor = args[0]
            if tensor.dtype == torch.bool:
                return tensor.untyped_storage()._cdata not in self.false_storages
            return 1.0 if tensor.is_floating_point() else 1
        if on_meta and func is torch.ops.aten.nonzero.default:  # a mask that keeps everything
            tensor = args[0]
            indices = torch.empty(tensor.numel(), tensor.dim(), dtype=torch.long, device="meta")
            self.add(indices, func.name())
            return indices
        out = func(*args, **kwargs)
        if on_meta and func.name().split("::")[-1].split(".")[0] in self.FALSE_ANSWERS:
            self.false_storages.add(out.untyped_storage()._cdata)
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device_type:
                self.add(leaf, func.name())
        return out


def _meta_tolist(original):
    def tolist(tensor):
        if tensor.device.type != "meta":
            return original(tensor)
        if tensor.dim() == 0:
            return 1.0 if tensor.is_floating_point() else 1
        return [tolist(row) for row in tensor]

    return tolist


def _fused_attention(original):
    """F.scaled_dot_product_attention as CUDA's fused memory-efficient kernel holds it: the
    output and its log-sum-exp, never the scores (the meta device would take the math path)."""

    def attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if query.device.type != "meta":
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if key.shape[1] != query.shape[1]:  # grouped-query attention: the kernel repeats heads
            repeats = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(repeats, dim=1)
            value = value.repeat_interleave(repeats, dim=1)
        bias = attn_mask
        if attn_mask is not None and attn_mask.dtype != query.dtype:  # a boolean mask -> a bias
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device="meta")
        output, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )
        return output

    return attention


@contextlib.contextmanager
def cuda_kernels_on_meta():
    """While it lasts, meta tensors run as the CUDA step does: the fused attention kernel, CUDA's
    chunk of the log-prob pass, and healthy answers to the reads of values."""
    import torch.fx.experimental._config as fx_config

    from machinery import fast_logprobs

    chunk_rows = fast_logprobs.default_chunk_rows

    def cuda_chunk_rows(vocab, device):
        cuda = torch.device(device).type == "meta"
        return chunk_rows(vocab, torch.device("cuda") if cuda else device)

    saved = (
        torch.nn.functional.scaled_dot_product_attention,
        torch.Tensor.tolist,
        fx_config.meta_nonzero_assume_all_nonzero,
    )
    torch.nn.functional.scaled_dot_product_attention = _fused_attention(saved[0])
    torch.Tensor.tolist = _meta_tolist(saved[1])
    fx_config.meta_nonzero_assume_all_nonzero = True
    fast_logprobs.default_chunk_rows = cuda_chunk_rows
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention, torch.Tensor.tolist = saved[:2]
        fx_config.meta_nonzero_assume_all_nonzero = saved[2]
        fast_logprobs.default_chunk_rows = chunk_rows


def step_rollouts(config, vocab: int, count: int) -> sage.Rollouts:
    """``count`` rollouts of the step, prompt-major (G completions share each prompt), every
    prompt --max-prompt-len and every completion the whole budget long."""
    completion_len = config.max_seq_len - config.max_prompt_len
    prompts, completions = [], []
    for row in range(count):
        first = 10 + (row // config.rollouts) * 7
        prompts.append([(first + i) % vocab for i in range(config.max_prompt_len)])
        completions.append([(first + 3 * row + i) % vocab for i in range(completion_len)])
    return sage.Rollouts(
        prompt_ids=prompts,
        completion_ids=completions,
        texts=[""] * count,
        finish_reasons=["length"] * count,
        engine_logps=[[0.0] * completion_len for _ in range(count)],
        problems=[""] * count,
        answers=[""] * count,
    )


def build_trainer(model_config, config, dtype: torch.dtype, device, attention: str = "sdpa"):
    """(policy, reference, optimizer) of a model built from its config on ``device`` in
    ``dtype`` (no weights read), wrapped as sage.py wraps it, with AdamW's moments already made
    (a step after the first: the steady state the plan counts)."""
    from transformers import AutoModelForCausalLM

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(model_config, attn_implementation=attention)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.gradient_checkpointing:
        models.enable_gradient_checkpointing(model)
    policy, reference = sage.make_policy(
        model,
        full_finetune=config.full_finetune,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        with_reference=sage.needs_reference(config),
    )
    optimizer, _ = models.make_optimizer(policy, config.lr, config.weight_decay, 10, 1)
    for parameter in (p for p in policy.parameters() if p.requires_grad):
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return policy, reference, optimizer


def untimed(phase: str):
    """A timer for ``sage.train_on`` that times nothing (a PhaseTimer resets CUDA's peak
    statistics as each phase starts, which a measurement of the whole step must not)."""
    return contextlib.nullcontext()


def simulated_rows(config) -> int:
    """The rows of a step the update is run on: two micro-batches (the peak comes by the
    second), rounded up to whole groups (the advantages are per group).

    >>> from types import SimpleNamespace as Config
    >>> simulated_rows(Config(prompts_per_step=8, rollouts=8, micro_batch_size=4))
    8
    >>> simulated_rows(Config(prompts_per_step=8, rollouts=8, micro_batch_size=1))
    8
    """
    sequences, group = config.prompts_per_step * config.rollouts, config.rollouts
    return min(sequences, -(-2 * config.micro_batch_size // group) * group)


def train_on_step_rollouts(policy, reference, optimizer, config, model_config) -> dict:
    """``sage.train_on``, steps 2-4 of the trainer's step, on ``simulated_rows`` of a step at
    full length. Returns its metrics."""
    count = simulated_rows(config)
    rollouts = step_rollouts(config, model_config.get_text_config().vocab_size, count)
    rewards = torch.arange(count, dtype=torch.float32) % 2  # every group has signal
    learner = sage.Learner(
        policy,
        reference,
        optimizer=optimizer,
        scheduler=None,
        guide_generator=torch.Generator().manual_seed(0),
        pad_id=0,
    )
    return sage.train_on(learner, rollouts, rewards, config, step=0, timer=untimed)


def simulate_update(model_config, config, dtype: torch.dtype, device: str = "meta") -> dict:
    """Bytes of one steady-state update step counted storage by storage: ``weights`` (the
    trainer's model, adapters and reference), ``resident`` (with AdamW's moments: what stays
    between steps), ``peak`` and the op at the peak. On ``meta``, simulated; on ``cpu``, a real
    step of a small model (the simulation's check)."""
    with contextlib.ExitStack() as stack:
        if device == "meta":
            stack.enter_context(cuda_kernels_on_meta())
        policy, reference, optimizer = build_trainer(model_config, config, dtype, device)

        counter = LiveStorages(device)
        held_models = [policy] + ([reference] if reference is not None else [])
        for tensor in (t for m in held_models for t in [*m.parameters(), *m.buffers()]):
            counter.add(tensor, "weights")
        weights = counter.total
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type == device:
                    counter.add(value, "AdamW state")
        resident = counter.total
        with counter:
            train_on_step_rollouts(policy, reference, optimizer, config, model_config)
        return {
            "weights": weights,
            "resident": resident,
            "peak": counter.peak,
            "peak_op": counter.peak_op,
        }


def print_plan(config) -> None:
    """The plan of the run with the update simulated here (the formula's figure beside it),
    printed for people and as one JSON line."""
    model_config = memory_plan.read_model_config(config.model)
    dtype = memory_plan.trainer_dtype(config)
    update = simulate_update(model_config, config, dtype)
    memory_report.print_plan(config, sage.needs_reference(config), update=update)


if __name__ == "__main__":  # python -m extras.memory_sim --model ... (sage.py's flags)
    cli.run(lambda: print_plan(sage.parse_config()))
