"""Input checks with one-line errors, kept out of the chapters they guard.

A bad input to the loss (a shape off by one, a NaN from a diverged forward pass, an all-zero
mask) would otherwise surface as a wrong number or a broadcasting error far from its cause;
these functions name the argument and what is wrong with it, in one line.
"""

from __future__ import annotations

import dataclasses
import math

import torch


def check_loss_config(config, choices: dict[str, tuple[str, ...]]) -> None:
    """One-line errors for a ``loss.LossConfig`` that cannot run, naming each field by its flag:
    unknown names (each field of ``choices`` checked against its allowed values), a clip range
    that is not one, a negative or infinite beta or importance-sampling cap."""
    flags = {f.name: f.metadata.get("flag") or f.name for f in dataclasses.fields(config)}
    flags = {name: "--" + flag.replace("_", "-") for name, flag in flags.items()}
    for name, allowed in choices.items():
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(f"unknown {flags[name]} {value!r}: choose one of {', '.join(allowed)}")
    if not (0.0 <= config.eps_low < 1.0 and config.eps_high >= 0.0):
        raise ValueError(
            "the clip range [1 - eps_low, 1 + eps_high] needs 0 <= eps_low < 1 and eps_high >= 0 "
            f"(--eps-low, --eps-high); got eps_low={config.eps_low}, eps_high={config.eps_high}"
        )
    for name in ("beta", "tis_cap"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{flags[name]} must be finite and >= 0, got {value}")


def check_policy_loss_inputs(logps, advantages, completion_mask, fixed, config) -> None:
    """One-line errors for inputs ``loss.policy_loss`` cannot use: shapes, NaN/inf on completion
    tokens, an empty mask, a missing reference or missing engine log-probs.

    ``fixed`` is a ``loss.HeldFixed``, ``config`` a ``loss.LossConfig`` (checked when it was
    made, by ``check_loss_config``).
    """
    per_token = {
        "logps": logps,
        "old_logps": fixed.old_logps,
        "ref_logps": fixed.ref_logps,
        "log_q": fixed.log_q,
        "entropies": fixed.entropies,
        "importance_weights": fixed.importance_weights,
    }
    shape = tuple(completion_mask.shape)
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must be [batch, length], got shape {shape}")
    if fixed.old_logps is None:
        raise ValueError("old_logps is None: pass pi_old's log-probs (logps.detach() on-policy)")
    for name, tensor in {**per_token, "engine_logps": fixed.engine_logps}.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but completion_mask has {shape}"
            )
    if completion_mask.sum() == 0:
        raise ValueError("completion_mask is all zeros: no completion token to train on")
    for name, tensor in per_token.items():
        if tensor is not None and not torch.isfinite(tensor.detach()[completion_mask.bool()]).all():
            raise ValueError(
                f"{name} has NaN or inf on completion tokens (check the logits and the dtype)"
            )
    if advantages.shape != completion_mask.shape[:1]:
        raise ValueError(f"advantages must be [batch] = {shape[:1]}, got {tuple(advantages.shape)}")
    if not torch.isfinite(advantages.detach()).all():
        raise ValueError("advantages has NaN or inf (check the rewards)")
    if config.kl != "none" and config.beta != 0.0 and fixed.ref_logps is None:
        raise ValueError(
            f"kl={config.kl!r} with beta={config.beta} needs ref_logps (or set beta=0 / kl='none')"
        )
    check_importance_inputs(completion_mask, fixed, config.tis_cap)


def check_importance_inputs(completion_mask, fixed, tis_cap: float) -> None:
    """--tis-cap needs the engine's log-probs, without NaN on completion tokens (a NaN weight);
    and weights come from one source, the cap or precomputed ones, not both."""
    if tis_cap <= 0:
        return
    if fixed.engine_logps is None:
        raise ValueError(f"tis_cap={tis_cap} needs engine_logps, the rollout engine's log-probs")
    if fixed.importance_weights is not None:
        raise ValueError("pass importance_weights or set tis_cap > 0, not both")
    if torch.isnan(fixed.engine_logps.detach()[completion_mask.bool()]).any():
        raise ValueError("engine_logps has NaN on completion tokens (check the rollout engine)")
