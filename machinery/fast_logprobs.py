"""The fast log-prob kernel: per-token log-probs and entropies in row chunks, hand-written backward.

``loss.token_logps_and_entropies`` is the definition: log pi_T(y_t) of the sampled tokens and the
entropies H_t (Eq. 12) of pi_T = softmax(logits / T), or of its min-p truncation when min_p > 0,
in a few lines over the whole [N, V] logits. Written that way, autograd keeps
several float32 tensors of that size (the scaled logits, log_softmax, its exp, the gradient):
for a 152k vocabulary and a micro-batch of 4 x 1,536 completion tokens, each is 3.7 GB. This
module computes the same numbers without any of them, which is why the trainer uses it:

* the forward runs over chunks of rows (``default_chunk_rows``: 8 MiB of float32 work space per
  buffer on CPU, where a chunk that stays in cache is fastest; 64 MiB on a GPU, where small
  chunks leave the loop launch-bound), in a few preallocated buffers with in-place ops, and keeps
  per row only the logsumexp of the kept set and the row maximum;
* the backward is written by hand, d log pi_T(y) / dz_v = 1[v = y] - pi_T(v) on the kept set,
  recomputed chunk by chunk from those two numbers per row;
* by default the gradient is written into the logits' own storage (as Liger-Kernel's fused
  cross-entropy does), so the path adds no [N, V] tensor at all beyond a few chunks.

The tests hold ``chunked_token_logps_and_entropies`` equal to ``loss.token_logps_and_entropies``
(values, entropies and gradients, with temperature, min-p and bf16 logits), and
``shared_prompt_logps`` equal to ``loss.completion_logps``'s plain forward pass.
"""

from __future__ import annotations

import math

import torch

# Rows of logits processed at once: about this many bytes per float32 work buffer. On CPU a
# chunk that stays in cache is fastest; on a GPU small chunks make the loop launch-bound (8 MiB
# is 13 rows of a 152k vocabulary), so each buffer holds 64 MiB there (110 such rows).
CHUNK_BYTES = 8 * 2**20
CUDA_CHUNK_BYTES = 64 * 2**20


def default_chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows per chunk of ``chunked_token_logps_and_entropies`` for this vocabulary and device.

    >>> default_chunk_rows(152064, torch.device("cpu"))
    13
    >>> default_chunk_rows(152064, torch.device("cuda"))
    110
    """
    budget = CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CHUNK_BYTES
    return max(1, budget // (4 * vocab))


def work_dtype(logits: torch.Tensor) -> torch.dtype:
    """The kernel works in float32 (bf16 / fp16 logits are upcast); float64 logits stay float64,
    so a test can check an identity with float64's error bound instead of float32's."""
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled_rows(
    logits_rows: torch.Tensor, temperature: float, buffer: torch.Tensor
) -> torch.Tensor:
    """z = logits / T in ``buffer``'s dtype for a chunk of rows: a view if no copy is needed,
    else ``buffer``."""
    if logits_rows.dtype == buffer.dtype and temperature == 1.0:
        return logits_rows
    z = buffer[: logits_rows.shape[0]]
    z.copy_(logits_rows)
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _TokenLogProbs(torch.autograd.Function):
    """log pi_T(y_t) with a chunked backward: d log pi_T(y) / dz_v = 1[v = y] - pi_T(v) on the
    kept set.

    Each chunk works in preallocated float32 buffers with in-place ops, so the work space is a few
    chunks of rows whatever the input size, and no allocation happens inside the loop.
    min-p keeps v with pi_T(v) >= min_p * max_v pi_T(v), i.e. z_v >= max z + log min_p, as the
    sampler does after temperature; the backward makes the forward's test on the same floats.
    """

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, min_p, chunk_rows, inplace_backward):
        # logits: [N, V]; token_ids: [N]
        num_rows, vocab = logits.shape
        options = dict(dtype=work_dtype(logits), device=logits.device)
        logps = torch.empty(num_rows, **options)
        entropies = torch.empty(num_rows, **options)
        kept_logsumexp = torch.empty(num_rows, **options)
        row_maxima = torch.empty(num_rows, **options)
        rows_per_chunk = min(chunk_rows, num_rows)
        z_buffer = torch.empty(rows_per_chunk, vocab, **options)
        exp_buffer = torch.empty(rows_per_chunk, vocab, **options)
        shifted_buffer = torch.empty(rows_per_chunk, vocab, **options)
        for start in range(0, num_rows, chunk_rows):
            rows = slice(start, start + chunk_rows)
            z = _scaled_rows(logits[rows], temperature, z_buffer)  # [n, V]
            e, shifted = exp_buffer[: z.shape[0]], shifted_buffer[: z.shape[0]]
            row_max = z.amax(dim=-1, keepdim=True)  # [n, 1]
            torch.sub(z, row_max, out=shifted)  # z - max <= 0: no cancellation below
            torch.exp(shifted, out=e)  # in (0, 1]
            token_z = z.gather(-1, token_ids[rows, None]).squeeze(-1)
            if min_p > 0.0:
                # The sampled token is always in the kept set: the sampler kept it, even where
                # this float32 replay puts it a hair below the threshold (else log pi = -inf).
                token_e = e.gather(-1, token_ids[rows, None])
                dropped = z < row_max + math.log(min_p)
                e.masked_fill_(dropped, 0.0).scatter_(-1, token_ids[rows, None], token_e)
            total = e.sum(dim=-1)  # [n], over the kept set
            # Entropy of that distribution (Eq. 12): H = log sum e - sum(e (z - max)) / sum e;
            # a dropped token has e = 0 and adds nothing, a -inf logit (a masked vocabulary)
            # neither: nansum drops its 0 * -inf = NaN (NaN or +inf logits still give a NaN
            # total, which the caller's check catches).
            entropies[rows] = total.log() - shifted.mul_(e).nansum(-1) / total
            lse = row_max.view(-1) + total.log()
            kept_logsumexp[rows] = lse
            row_maxima[rows] = row_max.view(-1)
            logps[rows] = token_z - lse
        ctx.save_for_backward(logits, token_ids, kept_logsumexp, row_maxima)
        ctx.temperature, ctx.min_p, ctx.chunk_rows = temperature, min_p, chunk_rows
        ctx.inplace_backward = inplace_backward
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropies):
        logits, token_ids, kept_logsumexp, row_maxima = ctx.saved_tensors
        num_rows, vocab = logits.shape
        # In place: the logits' own storage receives their gradient (they are not needed after),
        # so the backward adds no [N, V] tensor. Autograd's version counter still protects any
        # other node that saved these logits: it would raise instead of reading the gradient.
        grad_logits = logits if ctx.inplace_backward else torch.empty_like(logits)
        options = dict(dtype=work_dtype(logits), device=logits.device)
        grad_logps = grad_logps.to(options["dtype"])
        rows_per_chunk = min(ctx.chunk_rows, num_rows)
        z_buffer = torch.empty(rows_per_chunk, vocab, **options)
        work_buffer = None
        if logits.dtype != options["dtype"]:
            work_buffer = torch.empty(rows_per_chunk, vocab, **options)
        for start in range(0, num_rows, ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            z = _scaled_rows(logits[rows], ctx.temperature, z_buffer)
            grad = grad_logits[rows] if work_buffer is None else work_buffer[: z.shape[0]]
            if ctx.min_p > 0.0:  # the forward's test, made before grad overwrites z's storage
                threshold = row_maxima[rows, None] + math.log(ctx.min_p)
                dropped = (z < threshold).scatter_(-1, token_ids[rows, None], False)
            torch.sub(z, kept_logsumexp[rows, None], out=grad)  # log pi_T on the kept set
            if ctx.min_p > 0.0:
                grad.masked_fill_(dropped, float("-inf"))
            grad.exp_().mul_(-grad_logps[rows, None])
            grad.scatter_add_(-1, token_ids[rows, None], grad_logps[rows, None])
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if work_buffer is not None:
                grad_logits[rows] = grad
        return grad_logits, None, None, None, None, None


def chunked_token_logps_and_entropies(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    min_p: float = 0.0,
    chunk_rows: int | None = None,
    inplace_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss.token_logps_and_entropies``, computed in chunks of rows with a hand-written backward.

    Args:
        logits: [..., V] next-token logits aligned with ``token_ids`` (any float dtype).
        token_ids: [...] the sampled tokens.
        temperature: the sampler's temperature T; log-probs are those of softmax(logits / T).
        min_p: the sampler's min-p; > 0 replays its mask so the log-probs are those of the
            truncated, renormalized behaviour policy. The sampled token always
            counts as kept, so its log-prob is finite even at the threshold.
        chunk_rows: rows per chunk (default ``default_chunk_rows``).
        inplace_backward: write the gradient of ``logits`` into their own storage, which then
            holds it after ``backward()``: pass ``logits.clone()`` or set False if you read them
            afterwards. Non-contiguous logits are copied once by the reshape (slice the hidden
            states, not the logits, to avoid it).

    Returns:
        logps: [...] float32 (float64 for float64 logits), differentiable w.r.t. ``logits``.
        entropies: [...] the same dtype, H_t (Eq. 12) of the same distribution (the full
            softmax(logits / T), or its min-p truncation), no gradient. -inf logits (a masked
            vocabulary) are allowed.

    Raises:
        ValueError on mismatched shapes or settings; FloatingPointError on NaN / +inf logits.

    >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])       # uniform over 4 tokens
    >>> logps, ent = chunked_token_logps_and_entropies(logits, torch.tensor([2]))
    >>> round(logps.item(), 4), round(ent.item(), 4)         # log(1/4), log 4
    (-1.3863, 1.3863)
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree: "
            "logits must be [..., vocab] with the leading dims of token_ids (project only the "
            "positions that predict the completion, e.g. the model's logits_to_keep)"
        )
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {min_p}")
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_ids = token_ids.reshape(-1).long()
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(vocab, logits.device)
    logps, entropies = _TokenLogProbs.apply(
        flat_logits, flat_ids, temperature, min_p, chunk_rows, inplace_backward
    )
    if not torch.isfinite(entropies).all():  # NaN or inf logits give NaN: one [N] check
        raise FloatingPointError(
            "logits have NaN or inf (or are all -inf) in some rows: a diverged model or an "
            "overflowing dtype; check the forward pass that produced them"
        )
    return logps.view(token_ids.shape), entropies.view(token_ids.shape)


def completion_logits(model, batch: dict) -> torch.Tensor:
    """[B, C, V] logits of the C positions that predict a batch's completions (only those are
    projected to the vocabulary)."""
    completion_ids, input_len = batch["completion_ids"], batch["input_ids"].shape[1]
    first = input_len - completion_ids.shape[1] - 1  # the position that predicts token 0: P - 1
    predicting = torch.arange(first, input_len - 1, device=completion_ids.device)  # [C]
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    return model(**inputs, logits_to_keep=predicting, use_cache=False).logits


def completion_logps(model, batch: dict, temperature: float, min_p: float):
    """``loss.completion_logps``'s fast path: the chunked kernel on the completions' logits, each
    shared prompt run once where a batch comes in groups (``collate``'s group_size) and no
    gradient checkpointing forbids the cache."""
    if batch.get("group_size", 1) > 1 and not getattr(model, "is_gradient_checkpointing", False):
        return shared_prompt_logps(model, batch, temperature, min_p)
    logits = completion_logits(model, batch)
    return chunked_token_logps_and_entropies(logits, batch["completion_ids"], temperature, min_p)


def shared_prompt_logps(
    model, batch: dict, temperature: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss.completion_logps`` for G completions per prompt, each prompt run through the model
    once.

    The prompts' forward pass keeps its keys and values (the cache); repeated G times along the
    batch, they serve the completions' forward pass, and the gradient flows back through the
    repeat into the prompt positions, summed over the group, as it would through G separate
    copies. A GRPO step of 8 prompts x 8 completions of 65 + 12 tokens then processes 65 + 8 x 12
    tokens per group instead of 8 x 77: the same log-probs and gradients (tested), a few times
    fewer tokens when completions are short.
    """
    group_size, completion_ids = batch["group_size"], batch["completion_ids"]
    completion_len = completion_ids.shape[1]
    prompt_len = batch["input_ids"].shape[1] - completion_len
    prompts = slice(None, None, group_size)  # the first row of each group
    outputs = model(
        input_ids=batch["input_ids"][prompts, :prompt_len],
        attention_mask=batch["attention_mask"][prompts, :prompt_len],
        position_ids=batch["position_ids"][prompts, :prompt_len],
        use_cache=True,
        logits_to_keep=1,
    )
    # [B, 1, V]: predicts completion token 0
    logits = outputs.logits.repeat_interleave(group_size, dim=0)
    if completion_len > 1:
        cache = outputs.past_key_values
        cache.batch_repeat_interleave(group_size)
        rest = model(
            input_ids=batch["input_ids"][:, prompt_len:-1],
            attention_mask=batch["attention_mask"][:, :-1],
            position_ids=batch["position_ids"][:, prompt_len:-1],
            past_key_values=cache,
            use_cache=True,
        )
        logits = torch.cat([logits, rest.logits], dim=1)  # [B, C, V]
    return chunked_token_logps_and_entropies(logits, completion_ids, temperature, min_p)
