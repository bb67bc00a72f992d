"""The policy loss: GRPO's clipped surrogate with SAGE's pseudo-KL anchor (Eqs. 3-8, 12, App. E.5).

In the order of one update: (1) per-token log-probs and entropies H_t (Eq. 12) of pi_T, the
policy at the sampler's temperature (its full softmax, or with --loss-distribution min_p the
sampler's min-p truncation); (2) one advantage per completion (GRPO, Dr. GRPO, RLOO, BNPO),
the rewards first shaped by the pseudo-KL for k1 in the return (Eq. 8); (3) the clipped
surrogate; (4) the penalty against the anchor log p~ = log pi_ref + log q (Eqs. 5, 8); (5) the
aggregation over tokens; then ``policy_loss``, with pi_old, pi_ref and q held fixed (Eq. 3).
How this differs from TRL's GRPOTrainer: docs/deviations.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from machinery import UsageError, cli, fast_logprobs

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "bnpo")
KL_MODES = ("reverse", "forward", "none")
KL_ESTIMATORS = ("k1_return", "k2", "k3", "ratio_k3")
DISTRIBUTIONS = ("full", "min_p")
AGGREGATIONS = ("grpo", "batch_token_mean", "dr_grpo", "dapo")

# ---- 1. Per-token log-probs and entropies ------------------------------------------------------


def token_logps_and_entropies(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, min_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) and H_t (Eq. 12) of one distribution, from [..., V] logits, float32 (float64
    for float64 logits, as in the exact checks).

    min_p = 0: pi_T = softmax(logits / T) over the full vocabulary (the default, TRL's).
    min_p > 0: the sampler's truncation of pi_T, the tokens with pi_T(v) >= min_p * max_v pi_T(v)
    kept and renormalized (the sampled token counts as kept); H_t is then that distribution's
    entropy too, so the guide reads only logits that the log-probs carry (docs/min-p.md).

    >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])      # uniform over 4 tokens
    >>> logps, entropies = token_logps_and_entropies(logits, torch.tensor([2]))
    >>> round(logps.item(), 4), round(entropies.item(), 4)  # log(1/4), log 4
    (-1.3863, 1.3863)
    >>> logits = torch.tensor([[0.0, 0.0, -9.0, -9.0]])    # min-p keeps the first two
    >>> logps, entropies = token_logps_and_entropies(logits, torch.tensor([0]), min_p=0.01)
    >>> round(logps.item(), 4), round(entropies.item(), 4)  # log(1/2), log 2
    (-0.6931, 0.6931)
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [..., V]
    if min_p > 0.0:
        full_log_probs = z.log_softmax(dim=-1)
        kept = full_log_probs >= math.log(min_p) + full_log_probs.amax(dim=-1, keepdim=True)
        kept = kept.scatter(-1, token_ids[..., None], True)
        z = z.masked_fill(~kept, float("-inf"))
    log_probs = z.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropies = -torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=-1)
    return log_probs.gather(-1, token_ids[..., None]).squeeze(-1), entropies.detach()


def collate(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, device, group_size: int = 1
) -> dict:
    """Left-padded prompts + right-padded completions in one [B, P + C] batch, so that every
    completion starts at the same column and its log-probs come out as one [B, C] block.

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
        start, end = prompt_len - len(prompt), prompt_len + len(completion)
        input_ids[row, start:prompt_len] = torch.tensor(prompt)
        input_ids[row, prompt_len:end] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, start:end] = 1
        completion_mask[row, : len(completion)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    shared = group_size > 1 and batch % group_size == 0
    shared = shared and all(prompts[row] == prompts[row - row % group_size] for row in range(batch))
    return {
        "group_size": group_size if shared else 1,
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "position_ids": position_ids.to(device),
        "completion_ids": input_ids[:, prompt_len:].to(device),  # [B, C]
        "completion_mask": completion_mask.to(device),  # [B, C]
    }


def completion_logps(model, batch: dict, temperature: float, min_p: float, fast: bool = True):
    """``token_logps_and_entropies`` of a batch's completions under ``model``, [B, C] (the batch:
    ``collate``'s, left-padded prompts and right-padded completions).

    Two paths give the same numbers and gradients (tests/test_loss.py holds them equal), as
    nanoGPT keeps its flash and its manual attention. A run takes the fast one unless
    --no-fast-logprobs: machinery/fast_logprobs.py's chunked kernel, with no [B, C, V] float32
    tensor, which also runs a prompt shared by a group once when there is no gradient
    checkpointing. The other is the definition above, on the logits of the C positions that
    predict completions.
    """
    if fast:
        return fast_logprobs.completion_logps(model, batch, temperature=temperature, min_p=min_p)
    logits = fast_logprobs.completion_logits(model, batch)  # [B, C, V]
    return token_logps_and_entropies(
        logits, batch["completion_ids"], temperature=temperature, min_p=min_p
    )


def attend_somewhere_under_sdpa() -> None:
    """Let a left pad's attention row attend to every key, under SDPA, for every model of this
    process (transformers' ``AttentionMaskInterface``; the loaders of a model that reads
    ``collate``'s batches call it). Every key up to a left pad is padding, so its row attends to
    none, and CUDA's fused kernels give NaN for such a row, in the backward pass at least, which
    then reaches every gradient (docs/gpu.md). No other row changes; nothing reads a pad's row."""
    from transformers import masking_utils

    def sdpa_mask(*args, **kwargs):  # [B, 1, Q, K] bool, True where a query attends; or None
        mask = masking_utils.sdpa_mask(*args, **kwargs)
        return mask if mask is None else mask | ~mask.any(dim=-1, keepdim=True)

    masking_utils.AttentionMaskInterface.register("sdpa", sdpa_mask)


# ---- 2. Advantages (one scalar per completion, shared by its tokens) ---------------------------


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by the group size {group_size} "
            f"(prompts x rollouts, grouped by prompt); got shape {tuple(rewards.shape)}"
        )
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps) within each prompt's group (section 5), with
    the unbiased (Bessel) std, as in TRL.

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


def bnpo_advantages(rewards: torch.Tensor, group_size: int, max_inverse_density: float = 1e6):
    """BNPO (Xiao et al. 2025, arXiv 2506.02864): A = (R - p^) / f_Beta(p^; alpha, beta), p^ the
    group's mean reward, 1/f clamped at ``max_inverse_density``, alpha and beta fitted to the
    batch's p^ (``bnpo_beta_parameters``). alpha = beta = 3/2 makes f proportional to
    sqrt(p^(1-p^)), GRPO's std for binary rewards; alpha = beta = 1 makes it Dr. GRPO.
    """
    groups = _grouped(rewards, group_size)
    p_hat = groups.mean(dim=1)  # [num_groups]
    if not ((p_hat >= 0.0) & (p_hat <= 1.0)).all():  # f_Beta lives on [0, 1]
        raise UsageError(
            f"--advantage bnpo: the groups' mean rewards run from {p_hat.min().item():.3g} to "
            f"{p_hat.max().item():.3g}, outside [0, 1] where BNPO's Beta density is defined: "
            "use a reward in [0, 1] or another --advantage"
        )
    alpha, beta = bnpo_beta_parameters(p_hat)
    density = beta_density(p_hat, alpha, beta)
    inverse = (1.0 / density).clamp(max=max_inverse_density).nan_to_num(max_inverse_density)
    return ((groups - p_hat[:, None]) * inverse[:, None]).flatten()


def bnpo_beta_parameters(p_hat: torch.Tensor) -> tuple[float, float]:
    """alpha, beta from the mean mu and variance s2 of the groups' p^ by moments: with
    c = mu(1-mu)/s2 - 1, alpha = max(1 + mu c / 3, 1), beta = max(1 + (1-mu) c / 3, 1); 1, 1
    when s2 = 0 (one group, or all alike) and the moments are undefined."""
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
    dtype = torch.promote_types(p.dtype, torch.float32)  # float32, or float64 for exact checks
    p, exponents = p.double(), torch.tensor([alpha - 1.0, beta - 1.0], dtype=torch.float64)
    log_f = torch.xlogy(exponents[0], p) + torch.xlogy(exponents[1], 1.0 - p)
    return torch.exp(log_f - log_norm).to(dtype)


def compute_advantages(rewards: torch.Tensor, group_size: int, kind: str = "grpo") -> torch.Tensor:
    """Dispatch: grpo | dr_grpo | rloo | bnpo. rewards: [num_prompts * group_size] -> same shape.
    A group whose rewards are all equal carries no signal: its advantages are exactly 0, for
    every kind (its float mean can be a rounding off, which GRPO's eps would magnify).

    >>> compute_advantages(torch.full((16,), 0.7), 16).abs().max()
    tensor(0.)
    """
    functions = (grpo_advantages, dr_grpo_advantages, rloo_advantages, bnpo_advantages)
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage {kind!r}: choose one of {', '.join(ADVANTAGES)}")
    advantages = dict(zip(ADVANTAGES, functions))[kind](rewards, group_size)
    groups = _grouped(rewards, group_size)  # [num_groups, G]
    no_signal = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return advantages.view_as(groups).masked_fill(no_signal, 0.0).flatten()


def kl_shaped_rewards(rewards, logps, ref_logps, log_q, completion_mask, beta: float):
    """r(y) - beta * sum_t (log pi_t - log p~_t): the pseudo-KL of Eq. 8 as k1 in the return.

    It realizes Eq. 4 exactly, with a score-function gradient and a baseline (toy/ proves it);
    beta * sum_t log q_t is a bonus for reaching the states the guide favours. [B, C] -> [B].
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)  # float32, or float64 for exact checks
    # SAGE: log p~ = log pi_ref + log q, so the return's k1 also subtracts log q (Eq. 8)
    log_ratio = logps.detach().to(dtype) - ref_logps.to(dtype) - log_q.to(dtype)
    log_ratio = log_ratio * completion_mask
    # The rewards may live on the CPU (the grader's) and the log-probs on the GPU.
    return rewards.to(log_ratio.device, dtype) - beta * log_ratio.sum(dim=-1)


# ---- 3-4. Per-token terms: the clipped surrogate and the anchor penalty ------------------------


def clipped_surrogate(logps, old_logps, advantages, eps_low: float, eps_high: float):
    """PPO's L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A), [B, C]."""
    ratio = torch.exp(logps - old_logps)
    advantages = advantages[:, None]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def anchor_penalty(logps, anchor_logps, kl: str = "reverse", estimator: str = "k3", old_logps=None):
    """Per-token penalty (times beta) against the anchor log p~ = ref_logps + log_q (Eqs. 5, 8),
    with log u_t = anchor_logps_t - logps_t, all [B, C] (toy/ proves the gradients' claims):

    reverse, k2:        (log u)^2 / 2
    reverse, k3:        u - 1 - log u (the paper's, App. E.5; the *forward* KL's gradient)
    reverse, ratio_k3:  (pi / pi_old) * k3, TRL's use_bias_correction_kl (``old_logps``; None:
                        stop_grad(pi), on-policy: the value of k3, the gradient of k2)
    reverse, k1_return: 0; the KL is in the return (``kl_shaped_rewards``)
    forward:            u log u - u + 1, the paper's forward-KL baseline (its expected gradient
                        is not the forward KL's: its fixed point is not Eq. 27)
    none:               0

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
    if estimator == "ratio_k3":  # the samples are pi_old's: k3 importance-weighted to pi's
        return torch.exp(logps - (logps.detach() if old_logps is None else old_logps)) * k3
    choices = ", ".join(KL_ESTIMATORS)
    raise ValueError(f"unknown kl estimator {estimator!r}: choose one of {choices}")


# ---- 5. Aggregation of per-token losses --------------------------------------------------------


def aggregate(
    per_token, completion_mask, mode="grpo", max_completion_length=None, global_num_tokens=None
) -> torch.Tensor:
    """Reduce [B, C] per-token losses to a scalar. grpo: the mean of each sequence's token mean;
    dr_grpo: the sum over tokens divided by B * max_completion_length; batch_token_mean (TRL's
    "bnpo") and dapo: the token mean, the sum divided by the step's tokens (``global_num_tokens``;
    None: this batch's), so that a step cut into micro-batches keeps the step's token mean.

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
    if mode == "dr_grpo":
        if not max_completion_length:
            raise ValueError("dr_grpo aggregation needs max_completion_length (the max_tokens)")
        return total / (per_token.shape[0] * max_completion_length)
    if mode in ("batch_token_mean", "dapo"):
        count = mask.sum() if global_num_tokens is None else global_num_tokens
        return total / torch.as_tensor(count, device=mask.device).clamp_min(1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}: choose one of {', '.join(AGGREGATIONS)}")


def micro_batch_weight(aggregation: str, micro_rows: int, total_rows: int):
    """Scale of a micro-batch's loss so that the accumulated gradient is the step's: rows / total
    for the sequence means (grpo, dr_grpo), 1 for the token means (already over the step's
    tokens)."""
    if aggregation in ("grpo", "dr_grpo"):
        return micro_rows / total_rows
    return 1.0


# ---- The whole loss ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LossConfig:
    """The loss's knobs; defaults are the paper's (section 5.1, App. E.5)."""

    advantage: str = field(default="grpo", metadata={"choices": ADVANTAGES})
    """grpo | dr_grpo | rloo | bnpo (Beta-normalized): one advantage per completion."""
    aggregation: str = field(default="grpo", metadata={"flag": "loss-agg", "choices": AGGREGATIONS})
    """grpo | batch_token_mean | dr_grpo | dapo: how per-token losses become one (``aggregate``)."""
    eps_low: float = field(default=0.2, metadata={"range": "in [0, 1)"})
    """Lower clip of the ratio (paper: 0.2)."""
    eps_high: float = field(default=0.2, metadata={"range": ">= 0"})
    """Upper clip of the ratio (paper: 0.2; DAPO: 0.28)."""
    kl: str = field(default="reverse", metadata={"choices": KL_MODES})
    """reverse | forward | none: the divergence from the anchor p~ = pi_ref * q."""
    kl_estimator: str = field(default="k3", metadata={"choices": KL_ESTIMATORS})
    """k3 (paper) | k2 | ratio_k3 | k1_return (in the return: Eq. 4); docs/estimators.md."""
    beta: float = field(default=0.05, metadata={"range": ">= 0"})
    """KL coefficient (paper: 0.05)."""
    distribution: str = field(
        default="full", metadata={"flag": "loss-distribution", "choices": DISTRIBUTIONS}
    )
    """full | min_p: what the policy's log-probs and the guide's H_t are computed over: pi_T's
    full softmax (the authors' code, TRL), or the sampler's min-p truncation (docs/min-p.md)."""
    reference_min_p: bool = False
    """Replay min-p on the reference too (off: its full softmax, as the authors' code)."""
    tis_cap: float = field(default=0.0, metadata={"range": ">= 0"})
    """Truncated importance sampling cap C on pi_old / pi_engine (0: off; 2 is usual)."""
    max_completion_length: int | None = field(default=None, metadata={"flag": None})
    """dr_grpo's constant divisor, the sampler's max_tokens; set by the trainer, not a flag."""

    def __post_init__(self):
        """One line, naming the flag, for a setting the loss cannot run."""
        if (problem := cli.field_problem(self)) is not None:  # the fields' choices and ranges
            raise ValueError(problem)
        if self.advantage == "bnpo" and self.kl_estimator == "k1_return":  # (bnpo_advantages)
            raise ValueError("--kl-estimator k1_return's returns leave --advantage bnpo's [0, 1]")


@dataclass
class HeldFixed:
    """The per-token tensors held fixed during an update (Eq. 3), each [B, C]."""

    # log pi_old, the policy that sampled (None: the update's)
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None  # log pi_ref; needed unless beta = 0 or kl = none
    log_q: torch.Tensor | None = None  # SAGE: the guide's log q (guides.py); None: q = 1, GRPO
    entropies: torch.Tensor | None = None  # pi_old's H_t: logged, and the policy guide's signal
    engine_logps: torch.Tensor | None = None  # the rollout engine's log-probs, for --tis-cap
    importance_weights: torch.Tensor | None = None  # or weights made elsewhere (TRL's vLLM IS)
    ref_entropies: torch.Tensor | None = None  # pi_ref's H_t, when the guide reads them


def policy_loss(
    logps, advantages, completion_mask, fixed: HeldFixed, config: LossConfig, step_tokens=None
):
    """SAGE's loss: clipped surrogate + beta * penalty against p~ = pi_ref * q, aggregated.

    logps [B, C] is log pi_theta(y_t), the only input with a gradient; advantages [B] come from
    ``compute_advantages``; completion_mask [B, C] is 1 on completion tokens; step_tokens counts
    the completion tokens of the optimizer step (the token means'). Returns (loss, metrics as
    floats); the caller adds the guide's offset (``anchor_offset``) where q is one number per
    position. A NaN in the inputs surfaces as a non-finite loss, which the trainer refuses.
    """
    shape = completion_mask.shape  # [B, C]
    assert completion_mask.dim() == 2 and completion_mask.sum() > 0, "no completion token"
    assert advantages.shape == shape[:1], f"advantages {tuple(advantages.shape)}, not [B]"
    assert fixed.old_logps is not None, "old_logps: pi_old's (logps.detach() on-policy)"
    for name in ("old_logps", "ref_logps", "log_q", "entropies", "engine_logps"):
        tensor = getattr(fixed, name)
        assert tensor is None or tensor.shape == shape, f"{name} {tuple(tensor.shape)}, not [B, C]"
    anchored = config.kl != "none" and config.beta != 0.0
    assert not anchored or fixed.ref_logps is not None, "the anchor needs ref_logps"
    if config.tis_cap > 0:
        assert fixed.engine_logps is not None, "--tis-cap needs the engine's log-probs"
        assert fixed.importance_weights is None, "importance weights from --tis-cap or given"
    importance = fixed.importance_weights
    if config.tis_cap > 0:  # truncated importance sampling: min(pi_old / pi_engine, C)
        importance = torch.exp(fixed.old_logps - fixed.engine_logps).clamp(max=config.tis_cap)
        importance = importance * completion_mask
    # Only logps carries a gradient: pi_old, pi_ref and q are held fixed during the update (Eq. 3).
    # Padding is zeroed so that whatever it holds (inf, NaN) cannot leak into the loss as 0 * inf.
    padding = ~completion_mask.bool()
    logps = logps.masked_fill(padding, 0.0)
    old_logps, ref_logps, log_q, entropies, importance = (
        None if x is None else x.detach().masked_fill(padding, 0.0)
        for x in (fixed.old_logps, fixed.ref_logps, fixed.log_q, fixed.entropies, importance)
    )
    advantages = advantages.to(torch.promote_types(logps.dtype, torch.float32))  # float64 kept
    surrogate = clipped_surrogate(
        logps, old_logps, advantages, eps_low=config.eps_low, eps_high=config.eps_high
    )
    per_token = surrogate if importance is None else surrogate * importance  # [B, C]
    anchor_logps = None
    if anchored:
        # The anchor is log p~ = log pi_ref + log q (Eqs. 5, 8); GRPO's is log pi_ref.
        anchor_logps = ref_logps + (log_q if log_q is not None else 0.0)  # SAGE: log q enters
        penalty = anchor_penalty(
            logps,
            anchor_logps,
            kl=config.kl,
            estimator=config.kl_estimator,
            old_logps=old_logps,
        )
        per_token = per_token + config.beta * penalty
    mask = completion_mask.float()
    loss = aggregate(
        per_token,
        mask,
        mode=config.aggregation,
        max_completion_length=config.max_completion_length,
        global_num_tokens=step_tokens,
    )
    held = HeldFixed(old_logps=old_logps, ref_logps=ref_logps, log_q=log_q, entropies=entropies)
    metrics = loss_metrics(
        logps.detach(),
        advantages,
        mask=mask,
        held=held,
        anchor_logps=anchor_logps,
        config=config,
    )
    return loss, {"loss": loss.item(), **metrics}


# ---- What the loss logs ----------------------------------------------------------------------


def loss_metrics(logps, advantages, mask, held: HeldFixed, anchor_logps, config: LossConfig):
    """Clip fractions, entropy, KL estimates and q statistics of ``policy_loss``, no gradient.

    kl/ref_k3 estimates KL(pi || pi_ref) with the penalty's own k3 (``anchor_penalty``).
    kl/anchor_k3, k3 against p~, has the expectation KL(pi || pi_ref) + Z - 1 - E_pi[log q],
    with Z = E_ref[q] the anchor's mass at a position (``anchor_offset``).
    """

    def mean(x):  # over the completion tokens
        return ((x * mask).sum() / mask.sum()).item()

    ratio, sign = torch.exp(logps - held.old_logps), advantages[:, None].expand_as(logps)
    low = (ratio < 1.0 - config.eps_low) & (sign < 0)  # clipped from below, A < 0
    high = (ratio > 1.0 + config.eps_high) & (sign > 0)
    metrics = {f"clip_ratio/{k}": mean(v.float()) for k, v in (("low", low), ("high", high))}
    metrics["clip_ratio/region"] = mean((low | high).float())
    if held.entropies is not None:
        metrics["entropy"] = mean(held.entropies)
    if held.ref_logps is not None:  # the true reverse KL, against pi_ref
        metrics["kl/ref_k3"] = mean(anchor_penalty(logps, held.ref_logps, "reverse", "k3"))
    if anchor_logps is not None:
        metrics["kl/anchor_k3"] = mean(anchor_penalty(logps, anchor_logps, "reverse", "k3"))
    if held.log_q is not None:
        log_q, q, valid = held.log_q, held.log_q.exp(), mask.bool()
        metrics["q/mean"], metrics["q/min"] = mean(q), q[valid].min().item()
        metrics["q/max"] = q[valid].max().item()
        metrics["q/frac_active"] = mean((log_q != 0).float())
    return metrics


def anchor_offset(log_q, mask, q_constant: bool) -> dict:
    """kl/anchor_offset, q - 1 - log q over the completion tokens: kl/anchor_k3's offset from
    KL(pi || pi_ref) where q is one number over the vocabulary at a position (``q_constant``:
    branch, random); {} elsewhere (the token guide's is not defined: q of unsampled tokens) and
    without a guide. The callers of ``policy_loss`` add it to its metrics.

    log_q, mask: [B, C].

    >>> anchor_offset(torch.tensor([[math.log(2.0), 0.0]]), torch.ones(1, 2), q_constant=True)
    {'kl/anchor_offset': 0.1534264087677002}
    """
    if log_q is None or not q_constant:
        return {}
    log_q = log_q.detach().masked_fill(~mask.bool(), 0.0)
    mask = mask.float()
    offset = ((log_q.exp() - 1.0 - log_q) * mask).sum() / mask.sum()
    return {"kl/anchor_offset": offset.item()}
