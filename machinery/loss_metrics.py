"""What ``loss.policy_loss`` logs: clip fractions, entropy, KL estimates and the guide's q."""

from __future__ import annotations

import torch


def loss_metrics(logps, advantages, mask, held, anchor_logps, config):
    """Clip fractions, entropy, KL estimates and q statistics of ``policy_loss``, no gradient.

    kl/ref_k3 estimates KL(pi || pi_ref). kl/anchor_k3, k3 against p~, has the expectation
    KL(pi || pi_ref) + Z - 1 - E_pi[log q], with Z = E_ref[q] the anchor's mass at a position
    (``anchor_offset``).
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
        metrics["kl/ref_k3"] = mean(k3(logps, held.ref_logps))
    if anchor_logps is not None:
        metrics["kl/anchor_k3"] = mean(k3(logps, anchor_logps))
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

    log_q, mask: [B, C]."""
    if log_q is None or not q_constant:
        return {}
    log_q = log_q.detach().masked_fill(~mask.bool(), 0.0)
    mask = mask.float()
    offset = ((log_q.exp() - 1.0 - log_q) * mask).sum() / mask.sum()
    return {"kl/anchor_offset": offset.item()}


def k3(logps: torch.Tensor, anchor_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 = u - 1 - log u, u = anchor / pi: the KL estimate that is logged (the same
    value as ``loss.anchor_penalty(..., "reverse", "k3")``, which tests check)."""
    log_u = anchor_logps - logps
    return log_u.exp() - 1.0 - log_u
