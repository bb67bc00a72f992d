"""The policy loss of GRPO-family RLVR with SAGE's pseudo-KL anchor (paper Eqs. 3-8, App. E.5).

Read top to bottom, this is one update's arithmetic:

1. Log-probs and entropies: per-token log pi(y_t | y_<t) of the sampled tokens and the
   full-vocabulary entropies H_t (Eq. 12) from the logits, temperature-scaled and with the
   sampler's min-p mask replayed (the update must see the distribution the tokens were sampled
   from). ``plain_token_logps_and_entropies`` is the definition, a few lines over the whole
   [batch, length, vocab] tensor; ``token_logps_and_entropies`` computes the same in row chunks
   with a hand-written backward, so no float32 tensor of that size is ever materialized besides
   the gradient the caller's logits need anyway. ``completion_logps`` runs a model on a batch
   made by ``collate`` and projects only the completion positions to the vocabulary.
2. Advantages: GRPO (std-normalized), Dr. GRPO (mean only), RLOO (leave-one-out) and BNPO
   (Beta-normalized, Xiao et al. 2025, arXiv 2506.02864 -- an *advantage*).
3. The clipped surrogate with separate eps_low and eps_high (PPO / DAPO clip-higher).
4. The anchor penalty against the pseudo-reference log p~_t = ref_logps_t + log_q_t (Eq. 5, 8),
   with Schulman's estimators, u_t = p~_t / pi_t:
       k1 = -log u   counted in the *sequence return* (``kl_shaped_rewards``; the only estimator
                     whose fixed point is Eq. 4 on multi-token completions),
       k2 = (log u)^2 / 2 in the loss,
       k3 = u - 1 - log u in the loss (the paper's App. E.5 and its public code; its gradient is
            that of the *forward* divergence: toy/ proves it),
       ratio_k3 = (pi / stop_grad(pi)) * k3 in the loss (same gradient as k2);
   the forward-KL baseline beta * (u log u - u + 1); or none.
5. Aggregation over tokens: per-sequence token mean (grpo), batch token mean (TRL's "bnpo" loss
   type, named here for what it is), constant divisor (Dr. GRPO), global token mean (DAPO).

``policy_loss`` strings 3-5 together and returns the scalar loss plus a dict of metrics.

Deviations from TRL's GRPOTrainer: the min-p mask is replayed (TRL ignores it, so its ratio is
off-policy whenever min_p > 0); BNPO is the paper's advantage, not an aggregation; the logged KL
is split into the true reverse-KL estimate against pi_ref and the k3 offset that q adds
(E[k3] = KL + Z - 1 - log Z, with Z the anchor's mass at a position).
"""

from __future__ import annotations

import math

import torch

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "bnpo")
KL_MODES = ("reverse", "forward", "none")
KL_ESTIMATORS = ("k1_return", "k2", "k3", "ratio_k3")
AGGREGATIONS = ("grpo", "batch_token_mean", "dr_grpo", "dapo")

# Rows of logits processed at once: about this many bytes per float32 work buffer. On CPU a
# chunk that stays in cache is fastest; on a GPU small chunks make the loop launch-bound (8 MiB
# is 13 rows of a 152k vocabulary), so each buffer holds 64 MiB there (110 such rows).
CHUNK_BYTES = 8 * 2**20
CUDA_CHUNK_BYTES = 64 * 2**20


def default_chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows per chunk of ``token_logps_and_entropies`` for this vocabulary and device.

    >>> default_chunk_rows(152064, torch.device("cpu")), default_chunk_rows(152064, torch.device("cuda"))
    (13, 110)
    """
    budget = CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CHUNK_BYTES
    return max(1, budget // (4 * vocab))


# --------------------------------------------------------------------------------------------
# 1. Per-token log-probs and entropies from logits: the definition, then the chunked version
# --------------------------------------------------------------------------------------------


def plain_token_logps_and_entropies(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, min_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: log pi(y_t) and H_t (Eq. 12) over the whole [..., V] logits, in float32.

    pi_T = softmax(logits / T). The entropy is that of the full pi_T. The sampler's min-p keeps
    the tokens with pi_T(v) >= min_p * max_v pi_T(v) and renormalizes; the sampled token was kept
    by the sampler, so it counts as kept even where float rounding puts it at the threshold.

    >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])      # uniform over 4 tokens
    >>> logps, entropies = plain_token_logps_and_entropies(logits, torch.tensor([2]))
    >>> round(logps.item(), 4), round(entropies.item(), 4)  # log(1/4), log 4
    (-1.3863, 1.3863)
    """
    z = logits.float() / temperature  # [..., V]
    log_probs = z.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropies = -torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=-1)
    if min_p > 0.0:
        kept = log_probs >= math.log(min_p) + log_probs.amax(dim=-1, keepdim=True)
        kept = kept.scatter(-1, token_ids[..., None], True)
        log_probs = z.masked_fill(~kept, float("-inf")).log_softmax(dim=-1)
    return log_probs.gather(-1, token_ids[..., None]).squeeze(-1), entropies.detach()



def _scaled_rows(logits_rows: torch.Tensor, temperature: float, buffer: torch.Tensor) -> torch.Tensor:
    """float32 z = logits / T for a chunk of rows: a view when no copy is needed, else ``buffer``."""
    if logits_rows.dtype == torch.float32 and temperature == 1.0:
        return logits_rows
    z = buffer[: logits_rows.shape[0]]
    z.copy_(logits_rows)
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _TokenLogProbs(torch.autograd.Function):
    """log pi_T(y_t) with a chunked backward: d log pi_T(y) / dz_v = 1[v = y] - pi_T(v) on the kept set.

    Each chunk works in preallocated float32 buffers with in-place ops, so the work space is a few
    chunks of rows whatever the input size, and no allocation happens inside the loop.
    min-p keeps v with pi_T(v) >= min_p * max_v pi_T(v), i.e. exp(z_v - max z) >= min_p, exactly
    as the sampler does after temperature.
    """

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, min_p, chunk_rows, inplace_backward):
        # logits: [N, V]; token_ids: [N]
        num_rows, vocab = logits.shape
        options = dict(dtype=torch.float32, device=logits.device)
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
            total = e.sum(dim=-1)  # [n]
            # Entropy of the full-vocabulary pi_T (Eq. 12): H = log sum e - sum(e (z - max)) / sum e.
            entropies[rows] = total.log() - shifted.mul_(e).sum(dim=-1) / total
            token_z = z.gather(-1, token_ids[rows, None]).squeeze(-1)
            if min_p > 0.0:
                # The sampled token is always in the kept set: the sampler kept it, even where
                # this float32 replay puts it a hair below the threshold (else log pi = -inf).
                token_e = e.gather(-1, token_ids[rows, None])
                e.masked_fill_(e < min_p, 0.0).scatter_(-1, token_ids[rows, None], token_e)
                lse = row_max.view(-1) + e.sum(dim=-1).log()
            else:
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
        grad_logps = grad_logps.float()
        rows_per_chunk = min(ctx.chunk_rows, num_rows)
        options = dict(dtype=torch.float32, device=logits.device)
        z_buffer = torch.empty(rows_per_chunk, vocab, **options)
        work_buffer = None if logits.dtype == torch.float32 else torch.empty(rows_per_chunk, vocab, **options)
        for start in range(0, num_rows, ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            z = _scaled_rows(logits[rows], ctx.temperature, z_buffer)
            grad = grad_logits[rows] if work_buffer is None else work_buffer[: z.shape[0]]
            torch.sub(z, kept_logsumexp[rows, None], out=grad)  # log pi_T on the kept set
            if ctx.min_p > 0.0:
                # Dropped by min-p (z - max z < log min_p) <=> log pi_T < log min_p + max z - lse.
                threshold = math.log(ctx.min_p) + row_maxima[rows] - kept_logsumexp[rows]
                dropped = (grad < threshold[:, None]).scatter_(-1, token_ids[rows, None], False)
                grad.masked_fill_(dropped, float("-inf"))
            grad.exp_().mul_(-grad_logps[rows, None])
            grad.scatter_add_(-1, token_ids[rows, None], grad_logps[rows, None])
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if work_buffer is not None:
                grad_logits[rows] = grad
        return grad_logits, None, None, None, None, None


def _checked_entropies(
    logits: torch.Tensor, entropies: torch.Tensor, temperature: float, chunk_rows: int
) -> torch.Tensor:
    """Raise on NaN / inf logits; recompute the rows where -inf logits (a masked vocabulary) gave NaN.

    The chunked loop sums pi_v * (z_v - max z), which is 0 * -inf = NaN where z_v = -inf. Every
    non-finite entropy is caught by one check over the [N] result (one sync, no [N, V] work);
    only those rows are recomputed, and a row whose logsumexp is not finite is bad input.
    """
    bad = ~torch.isfinite(entropies)  # [N]
    if not bad.any():
        return entropies
    entropies = entropies.clone()
    for index in bad.nonzero().squeeze(-1).split(chunk_rows):
        z = logits.detach()[index].float() / temperature  # [n, V]
        lse = torch.logsumexp(z, dim=-1)
        if not torch.isfinite(lse).all():
            raise ValueError(
                "logits have NaN or inf (or are all -inf) in some rows: a diverged model or an "
                "overflowing dtype; check the forward pass that produced them"
            )
        probs = torch.exp(z - lse[:, None])
        entropies[index] = lse - torch.where(probs > 0, probs * z, 0.0).sum(dim=-1)
    return entropies


def token_logps_and_entropies(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    min_p: float = 0.0,
    chunk_rows: int | None = None,
    inplace_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the given tokens and full-vocabulary entropies, in chunks.

    Args:
        logits: [..., V] next-token logits aligned with ``token_ids`` (any float dtype).
        token_ids: [...] the sampled tokens.
        temperature: the sampler's temperature T; log-probs are those of softmax(logits / T).
        min_p: the sampler's min-p; > 0 replays its mask so the log-probs are those of the
            truncated, renormalized behaviour policy. The sampled token always
            counts as kept, so its log-prob is finite even at the threshold.
        chunk_rows: rows per chunk (default ``default_chunk_rows``: 8 MiB of float32 work space
            per buffer on CPU, 64 MiB on a GPU).
        inplace_backward: write the gradient of ``logits`` into their own storage during the
            backward (as Liger-Kernel's fused cross-entropy does), so the path adds no
            [..., V] tensor at all. The logits then hold their gradient after ``backward()``: pass
            ``logits.clone()`` or set False if you read them afterwards. Non-contiguous logits are
            copied once by the reshape (slice the hidden states, not the logits, to avoid it).

    Returns:
        logps: [...] float32, differentiable w.r.t. ``logits``.
        entropies: [...] float32, H_t of softmax(logits / T) over the full vocabulary (Eq. 12),
            no gradient. -inf logits (a masked vocabulary) are allowed.

    Raises:
        ValueError: on mismatched shapes, or logits with NaN / +inf (or a row all -inf).

    >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])       # uniform over 4 tokens
    >>> logps, ent = token_logps_and_entropies(logits, torch.tensor([2]))
    >>> round(logps.item(), 4), round(ent.item(), 4)         # log(1/4), log 4
    (-1.3863, 1.3863)
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree: "
            "logits must be [..., vocab] with the leading dims of token_ids "
            "(project only the positions that predict the completion, e.g. the model's logits_to_keep)"
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
    logps, entropies = _TokenLogProbs.apply(flat_logits, flat_ids, temperature, min_p, chunk_rows, inplace_backward)
    entropies = _checked_entropies(flat_logits, entropies, temperature, chunk_rows)
    return logps.view(token_ids.shape), entropies.view(token_ids.shape)


def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device, group_size: int = 1) -> dict:
    """Left-padded prompts + right-padded completions in one [B, P + C] batch.

    position_ids count real tokens only, so a left-padded row sees the positions the engine saw.
    With ``group_size`` > 1, rows that come in groups sharing one prompt (GRPO's G completions of
    a prompt) are marked so, and ``completion_logps`` runs each prompt through the model once.

    >>> batch = collate([[5, 6], [7]], [[8], [9, 10]], pad_id=0, device="cpu")
    >>> batch["input_ids"].tolist(), batch["completion_mask"].tolist()
    ([[5, 6, 8, 0], [0, 7, 9, 10]], [[1.0, 0.0], [1.0, 1.0]])
    >>> batch["position_ids"].tolist()
    [[0, 1, 2, 2], [0, 0, 1, 2]]
    """
    prompt_len = max(map(len, prompts))
    completion_len = max(1, max(map(len, completions)))
    batch = len(prompts)
    input_ids = torch.full((batch, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    completion_mask = torch.zeros(batch, completion_len)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        start = prompt_len - len(prompt)
        input_ids[row, start:prompt_len] = torch.tensor(prompt)
        input_ids[row, prompt_len : prompt_len + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, start : prompt_len + len(completion)] = 1
        completion_mask[row, : len(completion)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    shared = group_size > 1 and batch % group_size == 0 and all(
        prompts[row] == prompts[row - row % group_size] for row in range(batch))
    return {
        "group_size": group_size if shared else 1,
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "position_ids": position_ids.to(device),
        "completion_ids": input_ids[:, prompt_len:].to(device),  # [B, C]
        "completion_mask": completion_mask.to(device),  # [B, C]
    }


def completion_logps(model, batch: dict, temperature: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) [B, C] (with the sampler's temperature and min-p replayed) and entropies H_t [B, C].

    Only the C positions that predict completion tokens are projected to the vocabulary
    (``logits_to_keep`` as indices), so the logits arrive contiguous and are never sliced or copied.
    Rows grouped by prompt (``collate``'s group_size) take ``shared_prompt_logps`` unless the
    model recomputes activations (gradient checkpointing keeps no cache to share).
    """
    if batch.get("group_size", 1) > 1 and not getattr(model, "is_gradient_checkpointing", False):
        return shared_prompt_logps(model, batch, temperature, min_p)
    completion_ids = batch["completion_ids"]
    prompt_len, completion_len = batch["input_ids"].shape[1] - completion_ids.shape[1], completion_ids.shape[1]
    predicting = torch.arange(prompt_len - 1, prompt_len + completion_len - 1, device=completion_ids.device)
    outputs = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=predicting,
        use_cache=False,
    )
    logits = outputs.logits  # [B, C, V]: position t's logits predict completion token t
    return token_logps_and_entropies(logits, completion_ids, temperature, min_p)


def shared_prompt_logps(model, batch: dict, temperature: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``completion_logps`` for G completions per prompt, each prompt run through the model once.

    The prompts' forward pass keeps its keys and values (the cache); repeated G times along the
    batch, they serve the completions' forward pass, and the gradient flows back through the
    repeat into the prompt positions, summed over the group, as it would through G separate
    copies. A GRPO step of 8 prompts x 8 completions of 65 + 12 tokens then processes 65 + 8 x 12
    tokens per group instead of 8 x 77: the same log-probs and gradients (tested), a few times
    fewer tokens when completions are short.
    """
    group_size, completion_ids = batch["group_size"], batch["completion_ids"]
    prompt_len, completion_len = batch["input_ids"].shape[1] - completion_ids.shape[1], completion_ids.shape[1]
    prompts = slice(None, None, group_size)  # the first row of each group
    outputs = model(input_ids=batch["input_ids"][prompts, :prompt_len],
                    attention_mask=batch["attention_mask"][prompts, :prompt_len],
                    position_ids=batch["position_ids"][prompts, :prompt_len], use_cache=True, logits_to_keep=1)
    logits = outputs.logits.repeat_interleave(group_size, dim=0)  # [B, 1, V]: predicts completion token 0
    if completion_len > 1:
        cache = outputs.past_key_values
        cache.batch_repeat_interleave(group_size)
        rest = model(input_ids=batch["input_ids"][:, prompt_len:-1], attention_mask=batch["attention_mask"][:, :-1],
                     position_ids=batch["position_ids"][:, prompt_len:-1], past_key_values=cache, use_cache=True)
        logits = torch.cat([logits, rest.logits], dim=1)  # [B, C, V]
    return token_logps_and_entropies(logits, completion_ids, temperature, min_p)


# --------------------------------------------------------------------------------------------
# 2. Advantages (one scalar per completion, shared by its tokens)
# --------------------------------------------------------------------------------------------


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by the group size {group_size} "
            f"(prompts x rollouts, grouped by prompt); got shape {tuple(rewards.shape)}"
        )
    return rewards.float().view(-1, group_size)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps) within each prompt's group (section 5).

    std is the unbiased (Bessel) std, as in TRL. All-equal groups give A = 0.

    >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    tensor([ 1.4997, -0.4999, -0.4999, -0.4999])
    """
    groups = _grouped(rewards, group_size)
    std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).flatten()


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean(r) (no std division; Liu et al. 2025).

    >>> dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    tensor([ 0.7500, -0.2500, -0.2500, -0.2500])
    """
    groups = _grouped(rewards, group_size)
    return (groups - groups.mean(dim=1, keepdim=True)).flatten()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r)).

    >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    tensor([ 1.0000, -0.3333, -0.3333, -0.3333])
    """
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 rollouts per prompt (leave-one-out baseline)")
    return dr_grpo_advantages(rewards, group_size) * group_size / (group_size - 1)


def bnpo_advantages(rewards: torch.Tensor, group_size: int, max_inverse_density: float = 1e6) -> torch.Tensor:
    """BNPO (Xiao et al. 2025): A = (R - p^) / f_Beta(p^; alpha, beta).

    p^ is each group's mean reward; alpha, beta come from the batch mean mu and variance s2 of
    p^ by moments: a = mu (mu(1-mu)/s2 - 1), b = (1-mu)(mu(1-mu)/s2 - 1), alpha = max(1 + a/3, 1),
    beta = max(1 + b/3, 1). 1/f is clamped at ``max_inverse_density``. When s2 = 0 (one group,
    or all groups alike) the moments are undefined and alpha = beta = 1 (f = 1, Dr. GRPO).
    With alpha = beta = 3/2, f is proportional to sqrt(p^(1-p^)), GRPO's std for binary rewards.
    """
    groups = _grouped(rewards, group_size)
    p_hat = groups.mean(dim=1)  # [num_groups]
    alpha, beta = bnpo_beta_parameters(p_hat)
    density = beta_density(p_hat, alpha, beta)
    inverse = (1.0 / density).clamp(max=max_inverse_density).nan_to_num(max_inverse_density)
    return ((groups - p_hat[:, None]) * inverse[:, None]).flatten()


def bnpo_beta_parameters(p_hat: torch.Tensor) -> tuple[float, float]:
    """alpha, beta of BNPO's Beta density from the batch of group success rates p^."""
    mu = p_hat.mean().item()
    var = p_hat.var(unbiased=False).item() if p_hat.numel() > 1 else 0.0
    if var <= 0.0 or mu <= 0.0 or mu >= 1.0:
        return 1.0, 1.0
    common = mu * (1.0 - mu) / var - 1.0
    a, b = mu * common, (1.0 - mu) * common
    return max(1.0 + a / 3.0, 1.0), max(1.0 + b / 3.0, 1.0)


def beta_density(p: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """f_Beta(p; alpha, beta) = p^(alpha-1) (1-p)^(beta-1) / B(alpha, beta)."""
    log_norm = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    p = p.double()
    log_f = torch.xlogy(torch.tensor(alpha - 1.0, dtype=p.dtype), p) + torch.xlogy(
        torch.tensor(beta - 1.0, dtype=p.dtype), 1.0 - p
    )
    return torch.exp(log_f - log_norm).float()


def compute_advantages(rewards: torch.Tensor, group_size: int, kind: str = "grpo") -> torch.Tensor:
    """Dispatch: grpo | dr_grpo | rloo | bnpo. rewards: [num_prompts * group_size] -> same shape."""
    if kind == "grpo":
        return grpo_advantages(rewards, group_size)
    if kind == "dr_grpo":
        return dr_grpo_advantages(rewards, group_size)
    if kind == "rloo":
        return rloo_advantages(rewards, group_size)
    if kind == "bnpo":
        return bnpo_advantages(rewards, group_size)
    raise ValueError(f"unknown advantage {kind!r}: choose one of {', '.join(ADVANTAGES)}")


def kl_shaped_rewards(
    rewards: torch.Tensor,
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    log_q: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Sequence return with the k1 estimator: r(y) - beta * sum_t (log pi_t - log p~_t).

    This is the pseudo-KL of Eq. 8 counted in the return, realizing Eq. 4 exactly with a
    score-function gradient and a baseline (toy/ proves it): beta * sum_t log q_t acts as a bonus
    for reaching the states the guide favours. Inputs [B, T] (detached), rewards [B] -> [B].
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)  # float32, or float64 for exact checks
    log_ratio = (logps.detach().to(dtype) - ref_logps.to(dtype) - log_q.to(dtype)) * completion_mask
    # The rewards may live on the CPU (the grader's) and the log-probs on the GPU.
    return rewards.to(log_ratio.device, dtype) - beta * log_ratio.sum(dim=-1)


# --------------------------------------------------------------------------------------------
# 3-4. Per-token terms: the clipped surrogate and the anchor penalty
# --------------------------------------------------------------------------------------------


def clipped_surrogate(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A); returns (L, rho).

    logps, old_logps: [B, T]; advantages: [B] (broadcast over tokens).
    """
    ratio = torch.exp(logps - old_logps)
    advantages = advantages[:, None]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -torch.minimum(ratio * advantages, clipped * advantages), ratio


def anchor_penalty(
    logps: torch.Tensor, anchor_logps: torch.Tensor, kl: str = "reverse", estimator: str = "k3"
) -> torch.Tensor:
    """Per-token penalty (multiply by beta) against the anchor, log u_t = anchor_logps_t - logps_t.

    reverse, k2:        (log u)^2 / 2
    reverse, k3:        u - 1 - log u                  (paper's default, App. E.5)
    reverse, ratio_k3:  (pi / stop_grad(pi)) * k3      (value of k3, gradient of k2)
    reverse, k1_return: 0 -- the KL is in the return (``kl_shaped_rewards``)
    forward:            u log u - u + 1, the paper's forward-KL baseline: its *value* estimates
                        D(p~ || pi) without bias, but its expected *gradient* is that of
                        (1/2) sum_y p~ (log p~ - log pi)^2, so its fixed point is not Eq. 27
                        (toy/ proves it; the exact forward-KL gradient is k3's). The estimator
                        argument is ignored.
    none:               0

    anchor_logps is log p~ = ref_logps + log_q (Eq. 5, 8); both [B, T].

    >>> anchor_penalty(torch.tensor([0.0]), torch.tensor([math.log(2.0)]), "reverse", "k3")
    tensor([0.3069])
    """
    if kl == "none" or (kl == "reverse" and estimator == "k1_return"):
        return torch.zeros_like(logps)
    log_u = anchor_logps - logps
    if kl == "forward":
        return log_u.exp() * log_u - log_u.exp() + 1.0
    if kl != "reverse":
        raise ValueError(f"unknown kl {kl!r}: choose one of {', '.join(KL_MODES)}")
    if estimator == "k2":
        return 0.5 * log_u**2
    k3 = log_u.exp() - 1.0 - log_u
    if estimator == "k3":
        return k3
    if estimator == "ratio_k3":
        return torch.exp(logps - logps.detach()) * k3
    raise ValueError(f"unknown kl estimator {estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")


# --------------------------------------------------------------------------------------------
# 5. Aggregation of per-token losses
# --------------------------------------------------------------------------------------------


def aggregate(
    per_token: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: str = "grpo",
    max_completion_length: int | None = None,
    global_num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce [B, T] per-token losses to a scalar.

    grpo:              mean over sequences of each sequence's token mean
    batch_token_mean:  sum over tokens / number of tokens in this batch (TRL's "bnpo")
    dr_grpo:           sum over tokens / (B * max_completion_length), a constant divisor
    dapo:              sum over tokens / tokens in the whole optimizer step (``global_num_tokens``,
                       summed over gradient-accumulation micro-batches; this batch's if None)

    >>> per_token = torch.tensor([[1.0, 1.0, 0.0], [4.0, 0.0, 0.0]])
    >>> mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    >>> aggregate(per_token, mask, "grpo"), aggregate(per_token, mask, "batch_token_mean")
    (tensor(2.5000), tensor(2.))
    >>> aggregate(per_token, mask, "dr_grpo", max_completion_length=4)
    tensor(0.7500)
    """
    mask = completion_mask.to(per_token.dtype)
    total = (per_token * mask).sum()
    if mode == "grpo":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        return per_sequence.mean()
    if mode == "batch_token_mean":
        return total / mask.sum().clamp_min(1.0)
    if mode == "dr_grpo":
        if not max_completion_length:
            raise ValueError("dr_grpo aggregation needs max_completion_length (the sampler's max_tokens)")
        return total / (per_token.shape[0] * max_completion_length)
    if mode == "dapo":
        count = mask.sum() if global_num_tokens is None else torch.as_tensor(global_num_tokens, device=mask.device)
        return total / count.clamp_min(1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}: choose one of {', '.join(AGGREGATIONS)}")


def micro_batch_weight(aggregation: str, micro_rows: int, total_rows: int, num_micro_batches: int) -> float:
    """Scale of a micro-batch's aggregated loss so the accumulated gradient is that of the whole step.

    grpo and dr_grpo average over sequences (weight rows / total); batch_token_mean is TRL's
    per-micro-batch token mean (weight 1 / number of micro-batches); dapo is normalized by the
    step's token count already (weight 1).
    """
    if aggregation in ("grpo", "dr_grpo"):
        return micro_rows / total_rows
    if aggregation == "batch_token_mean":
        return 1.0 / num_micro_batches
    return 1.0


# --------------------------------------------------------------------------------------------
# The whole loss
# --------------------------------------------------------------------------------------------


def check_policy_loss_inputs(completion_mask: torch.Tensor, advantages: torch.Tensor, per_token: dict, kl: str,
                             beta: float, eps_low: float, eps_high: float) -> None:
    """One-line errors for inputs ``policy_loss`` cannot use: shapes, NaN/inf on completion tokens,
    an empty mask, a missing reference, a clip range that is not one."""
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"the clip range [1 - eps_low, 1 + eps_high] needs 0 <= eps_low < 1 and eps_high >= 0; got "
                         f"eps_low={eps_low}, eps_high={eps_high}")
    shape = tuple(completion_mask.shape)
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must be [batch, length], got shape {shape}")
    for name, tensor in per_token.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but completion_mask has {shape}")
    if completion_mask.sum() == 0:
        raise ValueError("completion_mask is all zeros: no completion token to train on")
    for name, tensor in per_token.items():
        if tensor is not None and not torch.isfinite(tensor.detach()[completion_mask.bool()]).all():
            raise ValueError(f"{name} has NaN or inf on completion tokens (check the logits and the dtype)")
    if advantages.shape != completion_mask.shape[:1]:
        raise ValueError(f"advantages must be [batch] = {shape[:1]}, got {tuple(advantages.shape)}")
    if not torch.isfinite(advantages.detach()).all():
        raise ValueError("advantages has NaN or inf (check the rewards)")
    if kl != "none" and beta != 0.0 and per_token.get("ref_logps") is None:
        raise ValueError(f"kl={kl!r} with beta={beta} needs ref_logps (or set beta=0 / kl='none')")


def loss_metrics(loss, logps, ratio, advantages, mask, eps_low, eps_high, ref_logps, anchor_logps, log_q,
                 entropies, q_constant_per_position) -> dict[str, float]:
    """What ``policy_loss`` logs: the loss, clip fractions, entropy, KL estimates, q statistics.

    kl/ref_k3 estimates KL(pi || pi_ref). kl/anchor_k3 is k3 against p~, whose expectation is
    KL(pi || pi_ref) + Z - 1 - E_pi[log q] with Z = E_ref[q] the anchor's mass at a position. For a
    guide constant over the vocabulary at a position (branch, random) that offset is q - 1 - log q,
    logged as kl/anchor_offset; for the token guide q of the tokens not sampled is not defined, so
    neither is the offset, and it is not logged.
    """
    count = mask.sum()

    def token_mean(x):
        return ((x * mask).sum() / count).item()

    advantages_2d = advantages[:, None].expand_as(ratio)
    low = (ratio < 1.0 - eps_low) & (advantages_2d < 0)
    high = (ratio > 1.0 + eps_high) & (advantages_2d > 0)
    metrics = {
        "loss": loss.item(),
        "clip_ratio/low": token_mean(low.float()),
        "clip_ratio/high": token_mean(high.float()),
        "clip_ratio/region": token_mean((low | high).float()),
    }
    if entropies is not None:
        metrics["entropy"] = token_mean(entropies)
    if ref_logps is not None:
        # True reverse-KL estimate against pi_ref (k3, no q) and against the anchor p~.
        metrics["kl/ref_k3"] = token_mean(anchor_penalty(logps, ref_logps, "reverse", "k3"))
        if anchor_logps is not None:
            metrics["kl/anchor_k3"] = token_mean(anchor_penalty(logps, anchor_logps, "reverse", "k3"))
    if log_q is not None:
        q, valid = log_q.exp(), mask.bool()
        if q_constant_per_position:
            metrics["kl/anchor_offset"] = token_mean(q - 1.0 - log_q)
        metrics.update({
            "q/mean": token_mean(q),
            "q/min": q[valid].min().item(),
            "q/max": q[valid].max().item(),
            "q/frac_active": token_mean((log_q != 0).float()),
        })
    return metrics


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    ref_logps: torch.Tensor | None = None,
    log_q: torch.Tensor | None = None,
    *,
    beta: float = 0.05,
    kl: str = "reverse",
    kl_estimator: str = "k3",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: str = "grpo",
    max_completion_length: int | None = None,
    global_num_tokens: float | None = None,
    entropies: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    q_constant_per_position: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAGE's per-token loss: clipped surrogate + beta * penalty against p~ = pi_ref * q, aggregated.

    Args:
        logps: [B, T] log pi_theta(y_t), differentiable.
        old_logps: [B, T] log pi_old(y_t) of the policy that sampled (detached).
        advantages: [B] one per completion (``compute_advantages``; for k1_return computed from
            ``kl_shaped_rewards``).
        completion_mask: [B, T] 1 on completion tokens.
        ref_logps: [B, T] log pi_ref(y_t); needed unless beta = 0 or kl = none.
        log_q: [B, T] the guide's log q_t (``guides.compute_log_q``); None means q = 1.
        beta: penalty coefficient (paper: 0.05).
        kl: reverse | forward | none.
        kl_estimator: k1_return | k2 | k3 | ratio_k3 (reverse only; see ``anchor_penalty``).
        eps_low, eps_high: clip range of the ratio (DAPO: eps_high = 0.28).
        aggregation: grpo | batch_token_mean | dr_grpo | dapo (see ``aggregate``).
        entropies: [B, T] optional, only logged.
        importance_weights: [B, T] optional truncated importance weights
            min(pi_old / pi_engine, C) that correct the trainer/engine mismatch.
        q_constant_per_position: the guide gives every vocabulary token at a position the same q
            (branch, random), so the k3 offset it adds is known and logged (``loss_metrics``).

    Returns:
        (loss, metrics): the scalar loss and floats for logging.
    """
    check_policy_loss_inputs(completion_mask, advantages, {
        "logps": logps, "old_logps": old_logps, "ref_logps": ref_logps, "log_q": log_q, "entropies": entropies,
        "importance_weights": importance_weights}, kl, beta, eps_low, eps_high)
    # Only logps carries a gradient: pi_old, pi_ref and q are held fixed during the update (Eq. 3).
    # Padding is zeroed so that whatever it holds (inf, NaN) cannot leak into the loss as 0 * inf.
    padding = ~completion_mask.bool()
    logps = logps.masked_fill(padding, 0.0)
    old_logps, ref_logps, log_q, entropies, importance_weights = (
        None if x is None else x.detach().masked_fill(padding, 0.0)
        for x in (old_logps, ref_logps, log_q, entropies, importance_weights)
    )
    advantages = advantages.to(torch.promote_types(logps.dtype, torch.float32))  # float64 kept for exact checks
    surrogate, ratio = clipped_surrogate(logps, old_logps, advantages, eps_low, eps_high)  # [B, T]
    per_token = surrogate if importance_weights is None else surrogate * importance_weights
    anchor_logps = None
    if kl != "none" and beta != 0.0:
        anchor_logps = ref_logps + (log_q if log_q is not None else 0.0)  # log p~ = log pi_ref + log q (Eq. 5, 8)
        per_token = per_token + beta * anchor_penalty(logps, anchor_logps, kl, kl_estimator)
    loss = aggregate(per_token, completion_mask.float(), aggregation, max_completion_length, global_num_tokens)
    metrics = loss_metrics(loss, logps.detach(), ratio.detach(), advantages, completion_mask.float(), eps_low, eps_high,
                           ref_logps, anchor_logps, log_q, entropies, q_constant_per_position)
    return loss, metrics
