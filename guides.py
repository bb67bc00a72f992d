"""Guide functions q(x, y) of SAGE (paper section 4.3, Eqs. 9-12).

SAGE replaces the reverse-KL anchor pi_ref by the unnormalized p~ = pi_ref * q (Eq. 3, 5) and,
because q factorizes over tokens (Eq. 7), the whole method needs only a per-token
``log_q[b, t] = log q_t(x, y_<t, y_t)``. This module computes it, for the four guides:

    none    q_t = 1                                          (plain GRPO anchor)
    random  q_t = 1 + sigma * xi_t  with probability eps     (Eq. 9)
    token   q_t = 1 + alpha * w_t + sigma * w_t * xi_t       (Eq. 10, w_t = normalized surprisal)
    branch  q_t = 1 + ratio * max(0, H_t - tau)              (Eq. 11, H_t the entropy of Eq. 12)

then clamps q_t to [q_min, q_max] = [0.6, 1.4] and sets log q_t = 0 on padding.

Conventions that matter:

* The guide is a fixed anchor during an update (Eq. 3): ``log_q`` is computed under
  ``torch.no_grad()`` from detached signals, once per optimizer step, and never carries a
  gradient.
* Schedules (cosine decay over N cycles, section 4.3) are *pure functions of the optimizer
  step*. Nothing here counts calls, so a trainer that runs several micro-batches per step cannot
  advance the schedule too fast. (The authors' code advances it once per micro-batch.)
* The signals (surprisal -log pi(y_t), entropy H_t) come from the policy's own forward pass
  (``loss.token_logps_and_entropies``); the guide adds no forward pass.
* Randomness (xi_t, the eps coin) is drawn from a caller-supplied ``torch.Generator`` so that a
  resumed run reproduces the same guide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from machinery import cli

GUIDES = ("none", "random", "token", "branch")
NORMALIZATIONS = ("percentile", "rank", "sigmoid")


@dataclass(frozen=True)
class GuideConfig:
    """Parameters of every guide; the defaults are the paper's (section 4.3, App. D)."""

    name: str = field(default="branch", metadata={"flag": "guide", "choices": GUIDES})
    """branch (Eq. 11, the paper's main variant) | token (Eq. 10) | random (Eq. 9) | none
    (GRPO's anchor pi_ref)."""
    q_min: float = field(default=0.6, metadata={"range": "in (0, 1]"})
    """Guide clamp, lower (paper: 0.6)."""
    q_max: float = field(default=1.4, metadata={"range": ">= 1"})
    """Guide clamp, upper (paper: 1.4)."""
    # branch (Eq. 11)
    tau: float = field(default=1.2, metadata={"range": ">= 0"})
    """Branch guide: entropy threshold in nats above which a position is amplified (paper: 1.2)."""
    ratio: float = field(default=0.3, metadata={"range": ">= 0"})
    """Branch guide: slope of q_t in the entropy excess H_t - tau (paper: 0.3)."""
    # random (Eq. 9)
    random_eps: tuple[float, float] = field(default=(0.1, 0.0), metadata={"range": "in [0, 1]"})
    """Random: probability that a token is perturbed, (upper, lower) of its cosine schedule
    (equal bounds and --guide-cycle-decay 1: a constant)."""
    random_sigma: tuple[float, float] = field(default=(0.15, 0.05), metadata={"range": ">= 0"})
    """Random: noise scale, (upper, lower) of its cosine schedule."""
    # token (Eq. 10)
    token_alpha: tuple[float, float] = field(default=(0.3, 0.1), metadata={"range": ">= 0"})
    """Token: weight of the normalized surprisal, (upper, lower) of its cosine schedule (equal
    bounds and --guide-cycle-decay 1: a constant)."""
    token_sigma: tuple[float, float] = field(default=(0.25, 0.1), metadata={"range": ">= 0"})
    """Token: noise scale on the normalized surprisal, (upper, lower) of its cosine schedule."""
    token_normalization: str = field(default="percentile", metadata={"choices": NORMALIZATIONS})
    """Token: how surprisal becomes w_t in [0,1] per completion: percentile | rank | sigmoid."""
    entropy: str = field(
        default="policy", metadata={"flag": "guide-entropy", "choices": ("policy", "reference")}
    )
    """Whose signals feed the guide: policy (the paper's) | reference (pi_ref's, from the
    reference pass at no extra cost: Theorem 4.3's q, fixed during the run)."""
    # schedule
    num_cycles: int = field(default=8, metadata={"flag": "guide-cycles", "range": ">= 1"})
    """Cosine schedule: the run's optimizer steps are cut into this many cycles."""
    cycle_decay: float = field(
        default=0.9, metadata={"flag": "guide-cycle-decay", "range": "in (0, 1]"}
    )
    """Cosine schedule: the upper bound is multiplied by this at each new cycle (1 with equal
    bounds: a constant)."""

    def __post_init__(self):
        if (problem := cli.field_problem(self)) is not None:  # the fields' choices and ranges
            raise ValueError(problem)


# --------------------------------------------------------------------------------------------
# The cosine schedule with decaying restarts (section 4.3)
# --------------------------------------------------------------------------------------------


def cosine_schedule(
    step: int,
    total_steps: int,
    upper: float,
    lower: float,
    num_cycles: int = 8,
    cycle_decay: float = 0.9,
) -> float:
    """Value at optimizer ``step`` (0-based) of a cosine decay restarted ``num_cycles`` times.

    Inside cycle k (k = 0..N-1) the value goes from ``upper * cycle_decay**k`` down towards
    ``lower`` as ``lower + (ub_k - lower) * 0.5 * (1 + cos(pi * t))``, t in [0, 1) the position
    in the cycle.

    >>> cosine_schedule(0, 80, 0.3, 0.1)              # start of cycle 0: the upper bound
    0.3
    >>> round(cosine_schedule(5, 80, 0.3, 0.1), 6)    # middle of cycle 0: the midpoint
    0.2
    >>> round(cosine_schedule(10, 80, 0.3, 0.1), 6)   # start of cycle 1: upper bound * 0.9
    0.27
    >>> round(cosine_schedule(5, 10, 0.3, 0.1, num_cycles=6), 6)  # start of cycle 3: 0.3 * 0.9**3
    0.2187
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    step = min(max(int(step), 0), total_steps - 1)
    # In integers: a cycle is total_steps / num_cycles steps, which a float may round (100 / 6)
    # and so put a cycle's first step at the end of the one before.
    cycle = min(step * num_cycles // total_steps, num_cycles - 1)
    t = (step * num_cycles - cycle * total_steps) / total_steps
    upper_k = upper * cycle_decay**cycle
    return lower + (upper_k - lower) * 0.5 * (1.0 + math.cos(math.pi * t))


def scheduled_values(config: GuideConfig, step: int, total_steps: int) -> dict[str, float]:
    """The guide's scheduled parameters at this optimizer step (empty for none/branch)."""

    def value(bounds: tuple[float, float]) -> float:
        return cosine_schedule(step, total_steps, *bounds, config.num_cycles, config.cycle_decay)

    if config.name == "random":
        return {"eps": value(config.random_eps), "sigma": value(config.random_sigma)}
    if config.name == "token":
        return {"alpha": value(config.token_alpha), "sigma": value(config.token_sigma)}
    return {}


# --------------------------------------------------------------------------------------------
# Normalizing surprisal to w_t in [0, 1] within each completion (Eq. 10)
# --------------------------------------------------------------------------------------------


def normalize_per_completion(
    values: torch.Tensor, completion_mask: torch.Tensor, method: str = "percentile"
) -> torch.Tensor:
    """Map each row's valid entries to [0, 1]; padding gets 0.

    percentile: clip to the row's 5th-95th percentile, then min-max (the default);
    rank:       rank among the row's valid tokens / (count - 1), ties sharing their mean rank;
    sigmoid:    sigmoid of the row's z-score.
    A row whose valid values are all equal maps to 0 (percentile) or 0.5 (rank, sigmoid).
    What padding holds (even inf or NaN) never matters.

    >>> s = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0]]); m = torch.ones_like(s)
    >>> normalize_per_completion(s, m, "rank")
    tensor([[0.0000, 0.2500, 0.5000, 0.7500, 1.0000]])
    >>> normalize_per_completion(torch.tensor([[0.0, 0.0, 5.0]]), torch.ones(1, 3), "rank")
    tensor([[0.2500, 0.2500, 1.0000]])
    """
    mask = completion_mask.bool()
    dtype = torch.promote_types(values.dtype, torch.float32)  # float32, or float64 for exact checks
    values = values.to(dtype).masked_fill(~mask, 0.0)
    if method == "percentile":
        with_nan = values.masked_fill(~mask, float("nan"))
        low = torch.nanquantile(with_nan, 0.05, dim=-1, keepdim=True).nan_to_num(0.0)
        high = torch.nanquantile(with_nan, 0.95, dim=-1, keepdim=True).nan_to_num(0.0)
        span = high - low
        w = (values.clamp(min=low, max=high) - low) / span.clamp_min(1e-12)
        w = torch.where(span > 0, w, torch.zeros_like(w))
    elif method == "rank":
        # Padding sorts last (+inf), so ranks 0..count-1 belong to the valid tokens. Equal values
        # (e.g. the many tokens with log pi = 0) share the mean of their ranks: (first + last) / 2.
        padded = values.masked_fill(~mask, float("inf"))
        ordered = padded.sort(dim=-1).values
        first = torch.searchsorted(ordered, padded, side="left")
        last = torch.searchsorted(ordered, padded, side="right") - 1
        ranks = (first + last).to(dtype) / 2
        count = mask.sum(dim=-1, keepdim=True).to(dtype)
        w = torch.where(count > 1, ranks / (count - 1).clamp_min(1), torch.full_like(ranks, 0.5))
    elif method == "sigmoid":
        count = mask.sum(dim=-1, keepdim=True).clamp_min(1)
        mean = (values * mask).sum(dim=-1, keepdim=True) / count
        var = (((values - mean) * mask) ** 2).sum(dim=-1, keepdim=True) / count
        w = torch.sigmoid((values - mean) / var.sqrt().clamp_min(1e-6))
        # a row of equal values is 0.5: its mean's rounding error over the 1e-6 floor is no z-score
        low = values.masked_fill(~mask, math.inf).amin(dim=-1, keepdim=True)
        high = values.masked_fill(~mask, -math.inf).amax(dim=-1, keepdim=True)
        w = torch.where(high > low, w, torch.full_like(w, 0.5))
    else:
        raise ValueError(
            f"unknown normalization {method!r}: choose one of {', '.join(NORMALIZATIONS)}"
        )
    return w * mask


# --------------------------------------------------------------------------------------------
# The guides (Eqs. 9, 10, 11) and the entry point
# --------------------------------------------------------------------------------------------


def random_guide(
    shape,
    eps: float,
    sigma: float,
    generator: torch.Generator | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Eq. 9: q_t = 1 + sigma * xi_t with probability eps, else 1 (xi_t ~ N(0, 1)).

    The draws are float32 whatever ``dtype`` (one random stream); q is computed in ``dtype``."""
    coin = torch.rand(shape, generator=generator) < eps
    noise = torch.randn(shape, generator=generator).to(dtype)
    return torch.where(coin, 1.0 + sigma * noise, torch.ones(shape, dtype=dtype))


def token_guide(
    logps: torch.Tensor,
    completion_mask: torch.Tensor,
    alpha: float,
    sigma: float,
    normalization: str,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Eq. 10: q_t = 1 + alpha * w_t + sigma * w_t * xi_t, w_t = normalized surprisal -log pi."""
    w = normalize_per_completion(-logps, completion_mask, normalization)
    noise = torch.randn(w.shape, generator=generator).to(device=w.device, dtype=w.dtype)
    return 1.0 + alpha * w + sigma * w * noise


def branch_guide(entropies: torch.Tensor, tau: float, ratio: float) -> torch.Tensor:
    """Eq. 11: q_t = 1 + ratio * max(0, H_t - tau), H_t the policy entropy of Eq. 12 (nats).

    >>> branch_guide(torch.tensor([0.5, 1.2, 2.2]), tau=1.2, ratio=0.3)
    tensor([1.0000, 1.0000, 1.3000])
    """
    dtype = torch.promote_types(entropies.dtype, torch.float32)  # float64 kept for exact checks
    return 1.0 + ratio * (entropies.to(dtype) - tau).clamp_min(0.0)


@torch.no_grad()
def compute_log_q(
    config: GuideConfig,
    logps: torch.Tensor,
    entropies: torch.Tensor,
    completion_mask: torch.Tensor,
    step: int,
    total_steps: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Per-token log q_t of a batch of completions (Eq. 7's factors), clamped to [q_min, q_max],
    0 on padding, detached, on ``logps``' device: float32 (float64 for float64 inputs, as the
    exact checks use).

    logps [B, C] are log pi(y_t) of the sampled tokens (the token guide's signal), entropies
    [B, C] the entropies H_t in nats (the branch guide's, Eq. 12), completion_mask [B, C] 1 on
    completion tokens. ``step`` (0-based) of ``total_steps`` is the schedules' only clock;
    ``generator`` draws the random and token guides' noise on the CPU.
    """
    shapes = [tuple(t.shape) for t in (logps, entropies, completion_mask)]
    assert shapes[0] == shapes[1] == shapes[2], f"logps, entropies, mask: {shapes}, not one [B, C]"
    device = logps.device
    dtype = torch.promote_types(torch.promote_types(logps.dtype, entropies.dtype), torch.float32)
    mask = completion_mask.bool()
    if config.name == "none":
        return torch.zeros(mask.shape, dtype=dtype, device=device)
    values = scheduled_values(config, step, total_steps)
    if config.name == "random":
        q = random_guide(tuple(mask.shape), values["eps"], values["sigma"], generator, dtype)
        q = q.to(device)
    elif config.name == "token":
        q = token_guide(
            logps.detach().to(dtype).cpu(),
            mask.cpu(),
            values["alpha"],
            values["sigma"],
            config.token_normalization,
            generator,
        ).to(device)
    else:  # branch
        q = branch_guide(entropies.detach().to(dtype), config.tau, config.ratio)
    q = q.clamp(config.q_min, config.q_max)
    return torch.where(mask, q.log(), torch.zeros_like(q)).to(dtype)
