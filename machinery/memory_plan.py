"""The GPU memory of a run on CUDA, forecast before anything loads: its one refusal, and the
engine's share of the GPU.

Only the model's config.json is read. The trainer's update is counted in closed form
(``estimate_update_peak``, a few dozen lines of arithmetic); ``before_loading`` refuses a run
that cannot fit, --full-finetune's float32 state included, with one line naming the flag to
change. ``sage.py --plan-memory`` prints the same forecast for people (extras/memory_report.py),
and ``python -m extras.memory_sim`` simulates the update with sage.py's own step instead, the
formula's check (within 5% at the paper's shapes, tests/test_memory_plan.py). Beside the update
the forecast counts the engine (``size_engine``: it sleeps during the update, so the run's peak
is the larger of the update's and the trainer's resident bytes beside the awake engine), with
--backend hf what ``generate`` holds instead (``hf_sampling_bytes``), and with
--eval-solution-key the support probe (``probe_activations``).

Error: allocator rounding, fragmentation and CUDA workspaces (cuBLAS, the CUDA context) are not
counted; 5% of the card is kept free for them (``GPU_HEADROOM``). A card of N GB is N x 10^9
bytes (an "80 GB" H100 holds 85 x 10^9: the verdict errs on the safe side).
"""

from __future__ import annotations

import dataclasses
import math

import psutil
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
    """The card the plan and a run's refusal judge, GB (24, 48, 80, 141; 0: this GPU, else 80)."""


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


# ---- The update's peak in closed form: what the refusal reads, memory_sim.py checks --------------


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


# ---- The engine's share of the GPU, for the trainer's engine (rollout.py) and the plan -----------

GPU_HEADROOM = 0.05  # CUDA context, fragmentation
ENGINE_OVERHEAD_BYTES = 2 * 2**30  # vLLM's activations, sampler and CUDA graphs, beside its cache
SHARE_MARGIN = 0.01  # the share claimed above what the engine's bytes need


def kv_bytes_per_token(config) -> int:
    """The KV cache of one token in bf16: K and V of every layer's key-value heads.

    >>> from transformers import Qwen2Config  # Qwen2.5-Math-7B's shape: 56 KiB a token
    >>> kv_bytes_per_token(Qwen2Config(**QWEN25_MATH_7B)) // 1024
    56
    """
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_size * 2


def size_engine(
    config,
    *,
    max_model_len: int,
    step_sequences: int,
    total_bytes: int,
    requested: float | None = None,
    trainer_bytes: int | None = None,
) -> tuple[int, float]:
    """vLLM's max_num_seqs and gpu_memory_utilization on a GPU of ``total_bytes``: how many of a
    step's ``step_sequences`` of ``max_model_len`` tokens fit in the KV cache beside the engine's
    bf16 weights, its working memory, the trainer's resident ``trainer_bytes`` (None: a bf16
    copy of the weights, as the LoRA policy holds) and the headroom, at most all of them; and the
    share they need (at least 0.3), or ``requested`` (--gpu-memory-utilization). With fewer, vLLM
    samples the step in waves: it queues the rest and starts one as soon as a running sequence
    ends, so none is preempted and recomputed. A requested share above what the trainer leaves
    free or too small for one sequence, or a GPU where not one fits, is a one-line CheckError.

    >>> from transformers import Qwen2Config  # Qwen2.5-Math-7B's shape
    >>> seven_b = Qwen2Config(**QWEN25_MATH_7B)
    >>> def sized(length, card_gb):  # the step's 64 sequences of ``length`` tokens
    ...     at_once, share = size_engine(seven_b, max_model_len=length, step_sequences=64,
    ...         total_bytes=card_gb * 10**9)
    ...     return at_once, round(share, 2)
    >>> sized(2048, 80), sized(8192, 80), sized(8192, 48)  # the paper's, R1-distill's, in waves
    ((64, 0.32), (64, 0.6), (26, 0.63))
    """
    # The engine's bf16 copy of the weights (the trainer holds another) and a sequence's cache.
    weights = 2 * models.parameter_count(config)
    per_sequence = max_model_len * kv_bytes_per_token(config)
    trainer = weights if trainer_bytes is None else trainer_bytes
    ceiling = 1.0 - GPU_HEADROOM - trainer / total_bytes  # the most the trainer leaves free
    if requested is not None and requested > ceiling:
        raise CheckError(
            f"--gpu-memory-utilization {requested} is more than the GPU has free beside the "
            f"trainer: pass at most {math.floor(ceiling * 100) / 100:.2f}, or leave it unset"
        )
    share = (ceiling if requested is None else requested) - SHARE_MARGIN
    fit = int((share * total_bytes - weights - ENGINE_OVERHEAD_BYTES) // per_sequence)
    if fit < 1:
        one = (weights + ENGINE_OVERHEAD_BYTES + per_sequence) / total_bytes + SHARE_MARGIN
        one = math.ceil(one * 100) / 100
        if requested is not None and one <= ceiling:
            raise CheckError(
                f"--gpu-memory-utilization {requested} leaves the engine no room for one sequence "
                f"of {max_model_len} tokens beside its weights: pass {one:.2f} or more"
            )
        raise CheckError(
            f"the engine's bf16 weights ({weights / 1e9:.1f} GB) and the KV cache of one sequence "
            f"of {max_model_len} tokens do not fit beside the trainer on this "
            f"{total_bytes / 1e9:.0f} GB GPU: lower --max-seq-len or use a larger GPU"
        )
    at_once = min(step_sequences, fit)
    if requested is not None:
        return at_once, requested
    need = (weights + ENGINE_OVERHEAD_BYTES + at_once * per_sequence) / total_bytes + SHARE_MARGIN
    return at_once, min(max(0.3, need), ceiling)


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
    trainer's resident ``trainer_bytes`` (None: what is allocated now), and says so in one line
    when that is fewer than the step's (``size_engine``). A standalone engine (evaluate.py) gets
    what was requested."""
    if "max_num_seqs" not in llm_kwargs:  # a standalone engine batches as it can
        return requested or default, llm_kwargs
    step_sequences = llm_kwargs["max_num_seqs"]
    at_once, share = size_engine(
        config,
        max_model_len=max_model_len,
        step_sequences=step_sequences,
        total_bytes=torch.cuda.get_device_properties(0).total_memory,
        requested=requested,
        trainer_bytes=trainer_bytes or torch.cuda.memory_allocated() or None,
    )
    if at_once < step_sequences:
        print(
            f"[engine] one step's {step_sequences} sequences of {max_model_len} tokens do not "
            f"fit in the KV cache at once: the engine holds {at_once} and samples the step in "
            f"about {math.ceil(step_sequences / at_once)} waves (docs/gpu.md)"
        )
    return share, {**llm_kwargs, "max_num_seqs": at_once}


# ---- The run's forecast, its refusal and the flag that fixes it ----------------------------------


def trainer_dtype(config) -> torch.dtype:
    """The trainer's dtype on CUDA (``models.device_and_dtype``): float32 when every weight is
    trained, else bf16."""
    return torch.float32 if config.full_finetune else torch.bfloat16


def hf_sampling_bytes(model_config, config, dtype: torch.dtype) -> dict:
    """What ``generate`` holds while --backend hf samples a step (one call, every prompt's G
    copies at once; extras/hf_engine.py), beside the trainer's weights. ``kv_cache``: the keys
    and values of every row at --max-seq-len tokens in the trainer's dtype; ``peak``: the larger
    of the prefill's and the last token's. The prefill holds the prompts' cache and, in each
    layer's MLP, four [rows x prompt, intermediate] tensors (the activated gate, the up
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


def probe_activations(model_config, config, dtype: torch.dtype) -> dict:
    """What ``evaluate.support_probe`` holds beyond the trainer's resident bytes, with no
    gradient: a teacher-forced forward pass over --micro-batch-size B problems of --max-seq-len
    L tokens, y* at most the completion budget C = L - --max-prompt-len long.

    ``layer``: the forward pass holds one layer's activations at a time, each token's hidden
    state in and out and four [intermediate] tensors of its MLP (as ``hf_sampling_bytes`` counts
    them), in the trainer's dtype. ``logits``: after it,
    ``fast_logprobs.completion_logits``'s [B, C, V] logits in the trainer's dtype and, inside
    ``loss.token_logps_and_entropies`` with min-p (its first call; the second, without min-p,
    holds less), six float32 [B, C, V] tensors at once (z masked, the full log-softmax, the
    log-softmax, its exp, their product and the ``where`` over it) and two boolean ones (the kept
    mask, ``probs > 0``); without min-p, five float32 and one boolean. ``peak``: the larger of
    the two."""
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
    simulation of this config, else the formula's), the engine's beside it (``size_engine``, with
    ``engine_problem``, the reason it cannot have a share, or ""), generate's with --backend hf
    (``hf_sampling_bytes``), the support probe's with --eval-solution-key and --eval-every
    (``probe_counted``), the run's peak and whether it ``fits``, and ``trainer_peak``: the
    trainer's own share, what a run's logged peaks measure (runs.PhaseTimer subtracts what the
    engine keeps counted)."""
    model_config = read_model_config(config.model)
    dtype = trainer_dtype(config)
    formula = estimate_update_peak(model_config, config, dtype, with_reference)
    update = update or formula
    resident = update["resident"]
    engine = dict(weights=0, working=0, sequences=0, share=0.0, waves=None)
    engine_problem = ""
    if config.backend == "vllm":  # the HF backend samples from the trainer's own model
        step_sequences = config.prompts_per_step * config.rollouts  # vLLM's max_num_seqs
        weights = 2 * models.parameter_count(model_config)
        engine.update(weights=weights, working=ENGINE_OVERHEAD_BYTES, share=None)
        try:
            engine["sequences"], engine["share"] = size_engine(
                model_config,
                max_model_len=config.max_seq_len,
                step_sequences=step_sequences,
                total_bytes=card_bytes,
                requested=config.gpu_memory_utilization or None,
                trainer_bytes=resident,
            )
            engine["waves"] = math.ceil(step_sequences / engine["sequences"])
        except CheckError as error:
            engine_problem = str(error)
    engine["kv_cache"] = engine["sequences"] * config.max_seq_len * kv_bytes_per_token(model_config)
    sampling = hf_sampling_bytes(model_config, config, dtype)
    hf_peak = max(update["peak"], resident + sampling["peak"])  # --backend hf's
    awake = resident + (engine["share"] or 0.0) * card_bytes
    run_peak = hf_peak if config.backend == "hf" else max(update["peak"], awake)
    trainer_peak = hf_peak if config.backend == "hf" else resident + engine["working"]
    trainer_peak = max(trainer_peak, update["peak"])
    # The support probe runs beside the awake engine (with --backend hf, beside no engine).
    probe = probe_activations(model_config, config, dtype)
    probe_counted = bool(config.eval.eval_solution_key) and config.eval.eval_every > 0
    if probe_counted:
        run_peak = max(run_peak, awake + probe["peak"])
        trainer_peak = max(trainer_peak, resident + probe["peak"])
    usable = int((1 - GPU_HEADROOM) * card_bytes)
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
        probe_counted=probe_counted,
        awake=awake,
        run_peak=run_peak,
        trainer_peak=trainer_peak,
        usable=usable,
        fits=not engine_problem and run_peak <= usable,
    )


def largest_micro_batch(peaks: dict, config, with_reference: bool) -> int:
    """The largest power of two (up to the step's sequences) at which the formula's update peak
    and, with the support probe, the probe beside the awake engine fit the card (``peaks``:
    ``forecast``'s); 0 if none does."""
    size = 2 ** ((config.prompts_per_step * config.rollouts).bit_length() - 1)
    model_config, dtype = peaks["model_config"], peaks["dtype"]
    while size:
        trial = dataclasses.replace(config, micro_batch_size=size)
        need = estimate_update_peak(model_config, trial, dtype, with_reference)["peak"]
        if peaks["probe_counted"]:
            need = max(need, peaks["awake"] + probe_activations(model_config, trial, dtype)["peak"])
        if need <= peaks["usable"]:
            return size
        size //= 2
    return 0


def does_not_fit(peaks: dict, config, card_bytes: int, with_reference: bool) -> str:
    """The verdict on a run that does not fit (``peaks``: ``forecast``'s), naming the flag to
    change: first where the trainer's resident bytes alone do not fit (its weights and AdamW's
    moments, --full-finetune's in float32); where the engine is what does not fit, --backend hf
    too if its plan (no engine; generate's sampling beside the trainer) fits the card."""
    resident, usable, full = peaks["update"]["resident"], peaks["usable"], config.full_finetune
    probe_peak = peaks["awake"] + peaks["probe"]["peak"]
    if resident > usable:
        fix = f"the trainer's weights and AdamW states alone take {resident / 1e9:.1f} GB: "
        fix += "drop --full-finetune (LoRA, the paper's setting)" if full else "use a larger GPU"
    elif peaks["engine_problem"]:
        fix = peaks["engine_problem"]
        if full:  # float32 weights, gradients and moments crowd the engine out
            fix += ", or drop --full-finetune (LoRA)"
        if peaks["hf_peak"] <= usable:
            kv_cache = peaks["sampling"]["kv_cache"] / 1e9
            fix += (
                f", or pass --backend hf (slower sampling; its KV cache, {kv_cache:.1f} GB, fits)"
            )
    elif largest := largest_micro_batch(peaks, config, with_reference):
        fix = f"pass --micro-batch-size {largest}"
    elif peaks["probe_counted"] and probe_peak > usable:
        fix = (
            "drop --eval-solution-key (the support probe's logits do not fit beside the awake "
            "engine), or lower --max-seq-len"
        )
    elif not config.gradient_checkpointing:
        fix = "keep --gradient-checkpointing on, or lower --max-seq-len"
    elif full:
        fix = "drop --full-finetune (LoRA, the paper's setting), or lower --max-seq-len"
    else:
        fix = "lower --max-seq-len"
    return (
        f"does not fit a {round(card_bytes / 1e9, 2):g} GB card (peak "
        f"{peaks['run_peak'] / 1e9:.1f} GB, {usable / 1e9:.1f} GB usable): {fix}"
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


def check_full_finetune_fits(model: str, with_reference: bool, with_engine: bool) -> None:
    """Where no plan runs (the CPU, extras/trl_sage.py): --full-finetune is refused before anything
    loads when its float32 weights, their gradients, AdamW's two moments, the frozen reference
    (``with_reference``) and the engine's copy (bf16 on CUDA) alone exceed 90% of the device's
    memory, in one line naming what would fit. A model that does not read is the loader's to say.
    """
    from transformers import AutoConfig

    try:
        parameters = models.parameter_count(AutoConfig.from_pretrained(model))
    except (OSError, ValueError):
        return
    on_cuda = torch.cuda.is_available()
    per_parameter = 4 * (4 + with_reference) + (2 if on_cuda else 4) * with_engine
    if on_cuda:
        available, where = torch.cuda.get_device_properties(0).total_memory, "the GPU has"
    else:
        available, where = psutil.virtual_memory().total, "this machine has"
    if parameters * per_parameter > 0.9 * available:
        largest = 0.9 * available / per_parameter / 1e9
        raise SystemExit(
            f"error: --full-finetune of a {parameters / 1e9:.1f}B-parameter model needs about "
            f"{parameters * per_parameter / 1e9:.0f} GB for weights, gradients, AdamW states"
            f"{', a frozen reference' if with_reference else ''}"
            f"{' and the engine copy' if with_engine else ''}, but {where} "
            f"{available / 1e9:.0f} GB: drop --full-finetune (LoRA, the paper's setting) or use a "
            f"model of at most {largest:.1f}B parameters"
        )
