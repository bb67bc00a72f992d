"""The GPU memory of a run on CUDA, forecast before anything loads: its refusal, and the engine's
share of the GPU.

Only the model's config.json is read. The trainer's update is counted in closed form
(``estimate_update_peak``, a few dozen lines of arithmetic); ``before_loading`` refuses a run
that cannot fit with one line naming the flag to change. ``sage.py --plan-memory`` prints the
same forecast for people (extras/memory_report.py), and ``python -m extras.memory_sim``
simulates the update with sage.py's own step instead, the formula's check (within 5% at the
paper's shapes, tests/test_memory_plan.py).

Beside the update:

* the engine: its bf16 weights, vLLM's working memory and the KV cache of the step's sequences
  at full length, all of them or as many as fit beside the trainer (then the step samples in
  waves, ``engine_sequences``), claimed as its share of the card;
* the run's peak: the engine sleeps during the update (level 2), so the peak is the larger of
  the update's and the trainer's resident weights beside the awake engine;
* with --backend hf, no engine: transformers ``generate`` samples the step's rows at once with
  the trainer's own weights and holds their KV cache (``hf_sampling``) beside its resident bytes;
* with --eval-solution-key, the support probe of each evaluation: a teacher-forced pass with no
  gradient beside the awake engine, its [B, C, V] logits and their float32 copies
  (``probe_activations``).

Error: allocator rounding, fragmentation and CUDA workspaces (cuBLAS, the CUDA context) are not
counted; 5% of the card is kept free for them (``GPU_HEADROOM``). A card of N GB
is N x 10^9 bytes (an "80 GB" H100 holds 85 x 10^9: the verdict errs on the safe side).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from machinery import fast_logprobs, models
from machinery.vllm_backend import CheckError

# The paper's model, Qwen2.5-Math-7B (DeepSeek-R1-Distill-Qwen-7B has the same shape): the
# Qwen2Config arguments of its architecture, for building it on the meta device or at random.
QWEN25_MATH_7B = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
)


@dataclasses.dataclass
class PlanConfig:
    """The memory plan's knobs (flags of sage.py)."""

    plan_memory: bool = False
    """Print the run's GPU memory forecast from the model's config.json (no weights load) and
    one JSON line, then exit."""
    gpu_gb: float = dataclasses.field(default=0.0, metadata={"range": ">= 0"})
    """The card --plan-memory judges, in GB (24, 40, 48, 80, 141; 0: this GPU, else 80)."""


def read_model_config(model: str):
    """The model's config.json (a local directory, or a hub name as ``models.resolve_model`` takes
    it; no weights are read). One that does not read is the loader's one line, so a run says the
    same whether the plan or the loader meets the model first."""
    from transformers import AutoConfig

    name = models.resolve_model(model)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise SystemExit(models.cannot_load(name, error)) from None


# --------------------------------------------------------------------------------------------
# The update's peak in closed form: what the run's refusal reads (memory_sim.py checks it)
# --------------------------------------------------------------------------------------------


def estimate_update_peak(model_config, config, dtype: torch.dtype, with_reference: bool) -> dict:
    """Bytes of one steady-state update step, as ``memory_sim.simulate_update`` counts them, by
    arithmetic: ``weights``, ``resident`` (with AdamW's moments), ``peak`` and the phase at the
    peak.

    h, I, V: the hidden, MLP and vocabulary sizes; q: the query width (heads x head size); n
    layers; s: the bytes of ``dtype`` (bf16 under LoRA on CUDA, float32 with --full-finetune);
    B: --micro-batch-size; T = B x --max-seq-len tokens, of which N = B x the completion budget
    are completion positions; a micro-batch at full length.

    * Weights, gradients, AdamW's two moments. LoRA (``sage.wrap_lora``): the base in s, and
      rank r adapters on q, k, v, o, gate, up and down, kept in float32 by peft: r (in + out)
      each, r (7h + 2q + 2 kv + 3I) a layer; the reference is the base with the adapter off.
      --full-finetune: every weight in float32, plus a frozen copy when a KL anchor needs one.
    * Kept for the backward, per token and layer. LoRA: the frozen base projections keep
      nothing; each adapter keeps a float32 copy of its input, 4 (5h + q + I); each RMSNorm its
      float32 input, 2 x 4h; the attention its rotated queries, the keys and values repeated to
      every head and its output, 4q s; the MLP the gate, its SiLU and up, 3I s (the 7B: 333
      KB). --full-finetune: every linear keeps its input for its weight's gradient: each norm
      its input, normalized and output, 2 x 3h s; the attention 4q s; the MLP 4I s (the
      gate, its SiLU, up and their product). Gradient checkpointing keeps a layer's input, h s.
    * One layer's backward (recomputed under checkpointing): what it keeps and the gradients in
      flight, the most at its MLP's: LoRA 12h + 4I more (a float32 and four s-sized [h]
      tensors; two float32 [I] gradients where down's float32 input was); full 2I s more.
    * The log-prob pass (``fast_logprobs.completion_logps``): only the N completion positions
      are projected, N V s of logits, and the chunked kernel's three float32 work buffers of
      ``default_chunk_rows`` rows on CUDA (64 MiB each); the final norm's input, 4h a token
      (full: 2h s, and the output layer's new weight gradient V h s with its [N, h] input and
      input gradient 2N h s, beside the first micro-batch's).
    * The attention mask: a boolean [B, 1, L, L] and, in each attention call, the fused kernel's
      bias of it in s: every layer's held without checkpointing, one at a time with it.

    The peak is the resident bytes and the gradients plus the larger of the log-prob pass (all
    layers' kept bytes, the logits and the chunks) and the top layer's backward. Without
    checkpointing, a micro-batch of whole groups runs each shared prompt once
    (``fast_logprobs.shared_prompt_logps``): counted here at full length, an upper bound.

    >>> from types import SimpleNamespace
    >>> from transformers import Qwen2Config  # the 7B, LoRA rank 8, micro-batch 4 x 2,048
    >>> config = SimpleNamespace(micro_batch_size=4, max_seq_len=2048, max_prompt_len=512,
    ...     full_finetune=False, lora_rank=8, gradient_checkpointing=True)
    >>> estimate = estimate_update_peak(Qwen2Config(**QWEN25_MATH_7B, tie_word_embeddings=False),
    ...     config, torch.bfloat16, with_reference=True)
    >>> {key: round(value / 1e9, 2) for key, value in estimate.items() if key != "peak_op"}
    {'weights': 15.31, 'resident': 15.47, 'peak': 20.95}
    >>> estimate["peak_op"]  # 0.08 GB of gradients, 5.34 GB a layer's and 0.05 GB of masks
    "a layer's backward"
    """
    text = model_config.get_text_config()
    h, inter, vocab = text.hidden_size, text.intermediate_size, text.vocab_size
    head_size = getattr(text, "head_dim", None) or h // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    q, kv = text.num_attention_heads * head_size, kv_heads * head_size
    layers = text.num_hidden_layers
    s, rows, length = dtype.itemsize, config.micro_batch_size, config.max_seq_len
    tokens, completion = rows * length, rows * (length - config.max_prompt_len)
    parameters = models.parameter_count(model_config)
    if config.full_finetune:
        trained, weights = parameters * s, parameters * s * (1 + with_reference)
        saved = s * (6 * h + 4 * q + 4 * inter)
        backward = saved + 2 * inter * s
        final_norm, output_layer = 2 * h * s, vocab * h * s + 2 * completion * h * s
    else:
        trained = 4 * layers * config.lora_rank * (7 * h + 2 * q + 2 * kv + 3 * inter)
        weights = parameters * s + trained
        saved = 4 * (7 * h + q + inter) + s * (4 * q + 3 * inter)
        backward = saved + 12 * h + 4 * inter
        final_norm, output_layer = 4 * h, 0
    checkpointing = config.gradient_checkpointing
    kept = h * s if checkpointing else saved  # per token and layer, through the forward
    mask, bias = rows * length**2, rows * length**2 * s
    chunk_rows = min(fast_logprobs.default_chunk_rows(vocab, torch.device("cuda")), completion)
    logits = completion * vocab * s + max(3 * chunk_rows * vocab * 4, output_layer)
    every_layer = tokens * layers * kept
    top_layer = backward if checkpointing else backward - saved  # (its kept bytes are counted)
    log_prob_pass = every_layer + tokens * final_norm + logits
    layer_backward = every_layer + tokens * top_layer + bias  # its attention's mask bias
    if not checkpointing:  # every layer holds its attention's bias
        log_prob_pass += layers * bias
        layer_backward += (layers - 1) * bias
    phases = {"the log-prob pass": log_prob_pass, "a layer's backward": layer_backward}
    peak_op = max(phases, key=phases.get)
    resident = weights + 2 * trained  # AdamW's moments, in the trained weights' dtype
    peak = resident + trained + phases[peak_op] + mask  # + the gradients
    return {"weights": weights, "resident": resident, "peak": peak, "peak_op": peak_op}


# --------------------------------------------------------------------------------------------
# The engine's share of the GPU: sized here for the trainer's engine (rollout.py) and the plan
# --------------------------------------------------------------------------------------------


# What the trainer keeps on the GPU beside an awake engine: its own bf16 weights (the LoRA policy
# and its adapters); the update's activations come while the engine sleeps.
GPU_HEADROOM = 0.05  # CUDA context, fragmentation
ENGINE_OVERHEAD_BYTES = 2 * 2**30  # vLLM's activations, sampler and CUDA graphs, beside its cache
SHARE_MARGIN = 0.01  # the share claimed above what the engine's bytes need


def kv_bytes_per_token(config) -> int:
    """The KV cache of one token in bf16: K and V of every layer's key-value heads.

    >>> from transformers import Qwen2Config  # Qwen2.5-Math-7B's shape: 56 KiB a token
    >>> kv_bytes_per_token(Qwen2Config(hidden_size=3584, num_hidden_layers=28,
    ...     num_attention_heads=28, num_key_value_heads=4)) // 1024
    56
    """
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_size * 2


def share_ceiling(weights: int, total_bytes: int, trainer_bytes: int | None) -> float:
    """The most of a GPU of ``total_bytes`` the engine may claim: what the trainer's resident
    ``trainer_bytes`` (None: a bf16 copy of the ``weights``, as the LoRA policy holds) and the
    headroom leave."""
    trainer = weights if trainer_bytes is None else trainer_bytes
    return 1.0 - GPU_HEADROOM - trainer / total_bytes


def check_requested_share(requested, ceiling: float) -> None:
    """A --gpu-memory-utilization above what the trainer leaves free is a one-line error."""
    if requested is not None and requested > ceiling:
        raise CheckError(
            f"--gpu-memory-utilization {requested} is more than the GPU has free beside the "
            f"trainer: pass at most {math.floor(ceiling * 100) / 100:.2f}, or leave it unset"
        )


def engine_sequences(
    config,
    *,
    max_model_len: int,
    step_sequences: int,
    total_bytes: int,
    requested: float | None = None,
    trainer_bytes: int | None = None,
) -> int:
    """How many of one step's ``step_sequences`` the engine holds at once on a GPU of
    ``total_bytes``, each with ``max_model_len`` tokens of KV cache: all of them when they fit
    beside the trainer, else as many as fit. vLLM then samples the step in waves: it queues the
    rest and starts one as soon as a running sequence ends, so no sequence is preempted and
    recomputed. ``requested`` (--gpu-memory-utilization) or None: the engine's share, else the
    most it may take beside the trainer's resident ``trainer_bytes`` (``share_ceiling``).
    Raises a one-line CheckError when not one sequence fits, naming the fix.

    >>> from transformers import Qwen2Config  # Qwen2.5-Math-7B's shape
    >>> seven_b = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
    ...     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064)
    >>> engine_sequences(seven_b, max_model_len=2048, step_sequences=64, total_bytes=80 * 10**9)
    64
    >>> engine_sequences(seven_b, max_model_len=8192, step_sequences=64, total_bytes=48 * 10**9)
    26
    """
    weights = 2 * models.parameter_count(
        config
    )  # the engine's bf16 copy; the trainer holds another
    per_sequence = max_model_len * kv_bytes_per_token(config)
    ceiling = share_ceiling(weights, total_bytes, trainer_bytes)
    check_requested_share(requested, ceiling)
    share = (ceiling if requested is None else requested) - SHARE_MARGIN
    fit = int((share * total_bytes - weights - ENGINE_OVERHEAD_BYTES) // per_sequence)
    if fit >= 1:
        return min(step_sequences, fit)
    share_for_one = (weights + ENGINE_OVERHEAD_BYTES + per_sequence) / total_bytes + SHARE_MARGIN
    share_for_one = math.ceil(share_for_one * 100) / 100
    if requested is not None and share_for_one <= ceiling:
        raise CheckError(
            f"--gpu-memory-utilization {requested} leaves the engine no room for one sequence of "
            f"{max_model_len} tokens beside its weights: pass {share_for_one:.2f} or more"
        )
    raise CheckError(
        f"the engine's bf16 weights ({weights / 1e9:.1f} GB) and the KV cache of one sequence of "
        f"{max_model_len} tokens do not fit beside the trainer on this "
        f"{total_bytes / 1e9:.0f} GB GPU: lower --max-seq-len or use a larger GPU"
    )


def cuda_memory_share(
    config,
    *,
    max_model_len: int,
    max_num_seqs: int,
    requested: float | None,
    total_bytes: int,
    trainer_bytes: int | None = None,
) -> float:
    """The engine's share of a GPU of ``total_bytes`` that holds ``max_num_seqs`` sequences of
    ``max_model_len`` tokens in its KV cache at once (``engine_sequences`` says how many): its
    bytes' share plus ``SHARE_MARGIN``. ``requested`` (--gpu-memory-utilization) or None: the
    default 0.3, raised as far as the sequences need. Raises a one-line CheckError when the
    requested share is too small or too large, or when they do not fit beside the trainer's
    resident ``trainer_bytes`` (``share_ceiling``).

    >>> from transformers import Qwen2Config  # Qwen2.5-Math-7B's shape, an 80 GB GPU
    >>> seven_b = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
    ...     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064)
    >>> share = cuda_memory_share(seven_b, max_model_len=2048, max_num_seqs=64, requested=None,
    ...     total_bytes=80 * 10**9)
    >>> round(share, 2)  # the paper's step
    0.32
    >>> share = cuda_memory_share(seven_b, max_model_len=8192, max_num_seqs=64, requested=None,
    ...     total_bytes=80 * 10**9)
    >>> round(share, 2)  # R1-distill's
    0.6
    """
    kv_bytes = max_num_seqs * max_model_len * kv_bytes_per_token(config)
    weights = 2 * models.parameter_count(
        config
    )  # the engine's bf16 copy; the trainer holds another
    claim = (weights + ENGINE_OVERHEAD_BYTES + kv_bytes) / total_bytes + SHARE_MARGIN
    ceiling = share_ceiling(weights, total_bytes, trainer_bytes)
    check_requested_share(requested, ceiling)
    sequences = f"{max_num_seqs} sequences of {max_model_len} tokens"
    if requested is not None and requested < claim:
        raise CheckError(
            f"--gpu-memory-utilization {requested} is too small for {sequences} "
            f"({kv_bytes / 2**30:.1f} GiB of KV cache): "
            f"pass {math.ceil(claim * 100) / 100:.2f}, or lower --max-seq-len"
        )
    if claim > ceiling:
        raise CheckError(
            f"{sequences} need a {kv_bytes / 2**30:.1f} GiB KV cache, more than the GPU holds "
            f"beside the trainer (the engine would need {claim:.2f} of it, at most "
            f"{ceiling:.2f} is free): lower --rollouts, --prompts-per-step or --max-seq-len"
        )
    return requested if requested is not None else min(max(0.3, claim), ceiling)


def size_engine(
    config,
    *,
    max_model_len: int,
    step_sequences: int,
    total_bytes: int,
    requested: float | None,
    trainer_bytes: int | None,
) -> tuple[int, float]:
    """(sequences the engine holds at once, its share of the GPU): as many of the step's as fit
    beside the trainer (``engine_sequences``) and the share they need (``cuda_memory_share``).
    Both the engine and the memory plan size it here."""
    sizing = dict(
        max_model_len=max_model_len,
        total_bytes=total_bytes,
        requested=requested,
        trainer_bytes=trainer_bytes,
    )
    at_once = engine_sequences(config, step_sequences=step_sequences, **sizing)
    return at_once, cuda_memory_share(config, max_num_seqs=at_once, **sizing)


def gpu_share_and_limits(
    config,
    *,
    max_model_len: int,
    llm_kwargs: dict,
    requested: float | None,
    default: float,
    trainer_bytes: int | None = None,
) -> tuple[float, dict]:
    """The share of the GPU the engine gets and its batch limits. The trainer's engine (its
    step's limits in ``llm_kwargs``) holds as many of the step's sequences as fit beside the
    trainer's resident ``trainer_bytes`` (None: what is allocated now); the rest wait for a free
    slot (``size_engine``). A standalone engine (evaluate.py) gets what was requested."""
    if "max_num_seqs" not in llm_kwargs:  # a standalone engine batches as it can
        return requested or default, llm_kwargs
    if trainer_bytes is None:
        trainer_bytes = torch.cuda.memory_allocated() or None
    step_sequences = llm_kwargs["max_num_seqs"]
    at_once, share = size_engine(
        config,
        max_model_len=max_model_len,
        step_sequences=step_sequences,
        total_bytes=torch.cuda.get_device_properties(0).total_memory,
        requested=requested,
        trainer_bytes=trainer_bytes,
    )
    if at_once < step_sequences:
        print(
            f"[engine] one step's {step_sequences} sequences of {max_model_len} tokens do not "
            f"fit in the KV cache at once: the engine holds {at_once} and samples the step in "
            f"about {math.ceil(step_sequences / at_once)} waves (docs/gpu.md)"
        )
    return share, {**llm_kwargs, "max_num_seqs": at_once}


def trainer_dtype(config, device_type: str) -> torch.dtype:
    """The trainer's dtype on that device (``models.device_and_dtype``): bf16 on CUDA, float32
    when every weight is trained there, float32 on the CPU."""
    half = device_type == "cuda" and not config.full_finetune
    return torch.bfloat16 if half else torch.float32


def engine_share(
    model_config, config, card_bytes: int, trainer_bytes: int | None = None
) -> tuple[dict, str]:
    """The engine's bytes (weights, working memory, the KV cache of the sequences it holds at
    once), how many of the step's sequences that is and in how many waves a step samples, the
    share of the card it claims beside the trainer's resident ``trainer_bytes`` (sized as the
    engine sizes itself: ``size_engine``), and the reason it cannot have one (""
    when it can)."""
    if config.backend != "vllm":  # the HF backend samples from the trainer's own model
        engine = {"weights": 0, "working": 0, "kv_cache": 0, "share": 0.0, "sequences": 0}
        return {**engine, "waves": None}, ""
    step_sequences = config.prompts_per_step * config.rollouts  # vLLM's max_num_seqs
    try:
        sequences, share = size_engine(
            model_config,
            max_model_len=config.max_seq_len,
            step_sequences=step_sequences,
            total_bytes=card_bytes,
            requested=config.gpu_memory_utilization or None,
            trainer_bytes=trainer_bytes,
        )
        reason = ""
    except CheckError as error:
        sequences, share, reason = 0, None, str(error)
    per_token = kv_bytes_per_token(model_config)
    engine = {
        "weights": 2 * models.parameter_count(model_config),
        "working": ENGINE_OVERHEAD_BYTES,
        "kv_cache": sequences * config.max_seq_len * per_token,
        "share": share,
        "sequences": sequences,
        "waves": math.ceil(step_sequences / sequences) if sequences else None,
    }
    return engine, reason


def hf_sampling(model_config, config, dtype: torch.dtype) -> dict:
    """What transformers ``generate`` holds while --backend hf samples a step (extras/hf_engine.py:
    one call, every prompt's G copies at once), beside the trainer's weights: ``kv_cache``, the
    keys and values of every row at --max-seq-len tokens in the trainer's dtype, and ``peak``,
    the larger of the prefill's and the last token's. The prefill holds the prompts' cache and,
    in each layer's MLP, four [rows x prompt, intermediate] tensors (the activated gate, the up
    projection and its LoRA term, their product); the last token holds the whole cache, one
    layer's K once more (its cache grows by concatenation) and five float32 [rows, vocab] copies
    of the logits (the cast, the processors, the recorded log-softmax, the sampling softmax)."""
    text = model_config.get_text_config()
    rows = config.prompts_per_step * config.rollouts
    size = dtype.itemsize
    per_token = kv_bytes_per_token(model_config) // 2 * size  # (counted for bf16)
    kv_cache = rows * config.max_seq_len * per_token
    prefill = rows * config.max_prompt_len * (per_token + 4 * text.intermediate_size * size)
    last_token = (
        kv_cache + kv_cache // (2 * text.num_hidden_layers) + 5 * rows * text.vocab_size * 4
    )
    return {"kv_cache": kv_cache, "peak": max(prefill, last_token), "rows": rows}


def probe_runs(config) -> bool:
    """Whether the run's evaluations run the support probe: --eval-solution-key with
    --eval-every."""
    return bool(config.eval.eval_solution_key) and config.eval.eval_every > 0


def probe_activations(model_config, config, dtype: torch.dtype) -> dict:
    """What ``evaluate.support_probe`` holds beyond the trainer's resident bytes, with no
    gradient: a teacher-forced forward pass over --micro-batch-size B problems of --max-seq-len
    L tokens, y* at most the completion budget C = L - --max-prompt-len long.

    ``layer``: the forward pass holds one layer's activations at a time, each token's hidden
    state in and out and four [intermediate] tensors of its MLP (as ``hf_sampling`` counts
    them), in the trainer's dtype. ``logits``: after it, ``fast_logprobs.completion_logits``'s
    [B, C, V] logits in the trainer's dtype and, inside ``loss.token_logps_and_entropies`` with
    min-p (its first call; the second, without min-p, holds less), six float32 [B, C, V]
    tensors at once (z masked, the full log-softmax, the log-softmax, its exp, their product and
    the ``where`` over it) and two boolean ones (the kept mask, ``probs > 0``); without min-p,
    five float32 and one boolean. ``peak``: the larger of the two."""
    text = model_config.get_text_config()
    rows, length = config.micro_batch_size, config.max_seq_len
    completion = config.max_seq_len - config.max_prompt_len
    size = dtype.itemsize
    layer = rows * length * (2 * text.hidden_size + 4 * text.intermediate_size) * size
    float32_copies, bool_copies = (6, 2) if config.min_p > 0 else (5, 1)
    per_logit = size + 4 * float32_copies + bool_copies
    logits = rows * completion * text.vocab_size * per_logit
    return {"layer": layer, "logits": logits, "peak": max(layer, logits)}


def forecast(config, card_bytes: int, with_reference: bool, update: dict | None = None) -> dict:
    """The run's bytes on a card of ``card_bytes``: the update's (``update``, extras/memory_sim.py's
    simulation of this config, else the formula's), the engine's beside it (``engine_share``,
    with ``engine_problem``, the reason it cannot have one, or ""), generate's with --backend hf,
    the support probe's with --eval-solution-key, the run's peak and whether it ``fits``, and
    ``trainer_peak``: the trainer's own share, what a run's logged peaks measure
    (runs.PhaseTimer subtracts what the engine keeps counted)."""
    model_config = read_model_config(config.model)
    dtype = trainer_dtype(config, "cuda")
    formula = estimate_update_peak(model_config, config, dtype, with_reference)
    update = update or formula
    resident = update["resident"]
    engine, engine_problem = engine_share(model_config, config, card_bytes, resident)
    usable = int((1 - GPU_HEADROOM) * card_bytes)
    sampling = hf_sampling(model_config, config, dtype)
    hf_peak = max(update["peak"], resident + sampling["peak"])  # --backend hf's
    awake = resident + (engine["share"] or 0.0) * card_bytes
    run_peak = hf_peak if config.backend == "hf" else max(update["peak"], awake)
    trainer_peak = hf_peak if config.backend == "hf" else resident + engine["working"]
    trainer_peak = max(trainer_peak, update["peak"])
    # The support probe runs beside the awake engine (with --backend hf, beside no engine).
    probe = probe_activations(model_config, config, dtype)
    if probe_runs(config):
        run_peak = max(run_peak, awake + probe["peak"])
        trainer_peak = max(trainer_peak, resident + probe["peak"])
    return dict(
        model_config=model_config,
        dtype=dtype,
        formula=formula,
        update=update,
        engine=engine,
        engine_problem=engine_problem,
        sampling=sampling,
        hf_peak=hf_peak,
        probe=probe,
        awake=awake,
        run_peak=run_peak,
        trainer_peak=trainer_peak,
        usable=usable,
        fits=not engine_problem and run_peak <= usable,
    )


def largest_micro_batch(peaks: dict, config, with_reference: bool) -> int:
    """The largest power of two (up to the step's sequences) at which the formula's update peak
    and, with --eval-solution-key, the support probe beside the awake engine fit the card
    (``peaks``: ``forecast``'s); 0 if none does."""
    size = 2 ** ((config.prompts_per_step * config.rollouts).bit_length() - 1)
    model_config, dtype = peaks["model_config"], peaks["dtype"]
    while size:
        trial = dataclasses.replace(config, micro_batch_size=size)
        need = estimate_update_peak(model_config, trial, dtype, with_reference)["peak"]
        if probe_runs(config):
            need = max(need, peaks["awake"] + probe_activations(model_config, trial, dtype)["peak"])
        if need <= peaks["usable"]:
            return size
        size //= 2
    return 0


def fix_for(peaks: dict, config, with_reference: bool) -> str:
    """The flag to change when a run does not fit (``peaks``: ``forecast``'s). Where the engine
    is what does not fit, --backend hf is named too if its plan (no engine; generate's sampling
    beside the trainer) fits the card."""
    if peaks["engine_problem"]:
        fix = peaks["engine_problem"]
        if config.full_finetune:  # float32 weights, gradients and moments crowd the engine out
            fix += ", or drop --full-finetune (LoRA)"
        if peaks["hf_peak"] <= peaks["usable"]:
            kv_cache = peaks["sampling"]["kv_cache"] / 1e9
            fix += (
                f", or pass --backend hf (slower sampling; its KV cache, {kv_cache:.1f} GB, fits)"
            )
        return fix
    largest = largest_micro_batch(peaks, config, with_reference)
    if largest:
        return f"pass --micro-batch-size {largest}"
    if probe_runs(config) and peaks["awake"] + peaks["probe"]["peak"] > peaks["usable"]:
        return (
            "drop --eval-solution-key (the support probe's logits do not fit beside the awake "
            "engine), or lower --max-seq-len"
        )
    if not config.gradient_checkpointing:
        return "keep --gradient-checkpointing on, or lower --max-seq-len"
    if config.full_finetune:
        return "drop --full-finetune (LoRA, the paper's setting), or lower --max-seq-len"
    return "lower --max-seq-len"


def does_not_fit(peaks: dict, config, card_bytes: int, with_reference: bool) -> str:
    """The verdict on a run that does not fit, naming the flag to change."""
    card_gb = round(card_bytes / 1e9, 2)
    return (
        f"does not fit a {card_gb:g} GB card (peak {peaks['run_peak'] / 1e9:.1f} GB, "
        f"{peaks['usable'] / 1e9:.1f} GB usable): {fix_for(peaks, config, with_reference)}"
    )


def card_of(config) -> int:
    """The card a run is planned for, in bytes: --gpu-gb; 0: this GPU's memory, or on
    the CPU an 80 GB card's."""
    gpu_gb = config.extras["memory"].gpu_gb
    if gpu_gb:
        return int(gpu_gb * 1e9)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return 80 * 10**9


def before_loading(config, with_reference: bool) -> float:
    """On CUDA, before the model loads: a run that cannot fit is refused with one line naming the
    flag to change; a run that fits says nothing and gets the trainer's forecast peak in GB (the
    run's logger compares it with the peaks measured, the engine's counted bytes left out). The
    update's peak is the formula's (``estimate_update_peak``): no simulation runs on the run's
    path."""
    card_bytes = card_of(config)
    peaks = forecast(config, card_bytes, with_reference)
    if peaks["fits"]:
        return round(peaks["trainer_peak"] / 1e9, 2)
    raise SystemExit(f"error: the run {does_not_fit(peaks, config, card_bytes, with_reference)}")
