"""Float tolerances from error bounds, not from what passed once.

Two computations of the same number that differ only in rounding (another summation order, a
chunked kernel, a shared prompt's cache) differ by at most the sum of their rounding errors. For a
sum of n terms in any order, that error is at most gamma_(n-1) * sum |x_i|, with
gamma_k = k u / (1 - k u) and u the unit roundoff of the dtype (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., eq. 4.4). A test names n, the longest chain of rounded operations
behind the number it checks (reduction lengths add along a chain), and a bound on sum |x_i|.

Where a float32 bound would be too loose to catch a real error, the test runs the same code in
float64 (u = 1.1e-16) instead, so that the tolerance stays far below any mistake and no CPU's
kernels (AVX2, AVX-512, AMX) can reach it.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one rounded operation.

    >>> unit_roundoff(torch.float32), unit_roundoff(torch.float64)
    (5.960464477539063e-08, 1.1102230246251565e-16)
    """
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n chained rounded operations.

    >>> round(gamma(1000, torch.float32) / 1000 / unit_roundoff(torch.float32), 4)
    1.0001
    """
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"n u = {nu} >= 1: no bound for {n} operations in {dtype}")
    return nu / (1 - nu)


def sum_error_bound(n: int, magnitude: float, dtype: torch.dtype) -> float:
    """The rounding error of a sum of ``n`` terms each at most ``magnitude`` in size, in any order:
    gamma_(n-1) * n * magnitude.

    >>> sum_error_bound(1, 3.0, torch.float32)  # one term: no rounding
    0.0
    >>> f"{sum_error_bound(128, 1.0, torch.float32):.2e}"
    '9.69e-04'
    """
    return gamma(n - 1, dtype) * n * magnitude


def difference_bound(n: int, magnitude: float, dtype: torch.dtype) -> float:
    """The most two computations of one sum, each in its own order, can differ: twice
    ``sum_error_bound``."""
    return 2 * sum_error_bound(n, magnitude, dtype)


def log_softmax_bound(vocab: int, max_abs_logit: float, dtype: torch.dtype) -> float:
    """How far two computations of one value of log softmax(z) over ``vocab`` logits (a log-prob,
    an entropy, or p_v - 1[v = y], a gradient entry), |z| <= max_abs_logit, can differ.

    Each is a chain of vocab - 1 additions (the sum of exp(z - max z)) and at most 8 more rounded
    operations (1 / T, the shift, exp, a product, log, a division, two subtractions), on terms of
    size at most max(2 max|z|, 1) (z - max z, and exp(.) <= 1).

    >>> f"{log_softmax_bound(50, 10.0, torch.float64):.1e}"
    '1.5e-11'
    """
    return difference_bound(n=vocab + 8, magnitude=max(2 * max_abs_logit, 1.0), dtype=dtype)


def forward_length(config, tokens: int) -> int:
    """n for a log-prob of a decoder's forward pass (a Hugging Face config) over ``tokens``
    positions: per layer the reductions along its longest chain (the norm, the q/k/v projection,
    the o projection and the MLP's input over hidden; the scores over head_dim; the softmax and
    the sum of values over tokens; the MLP's output over intermediate), then the final norm and
    lm_head (hidden twice) and the log-softmax (vocab).

    >>> from types import SimpleNamespace
    >>> tiny = SimpleNamespace(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
    ...                        head_dim=64, vocab_size=320)
    >>> forward_length(tiny, tokens=20)
    3088
    """
    per_layer = 5 * config.hidden_size + config.head_dim + 2 * tokens + config.intermediate_size
    return config.num_hidden_layers * per_layer + 2 * config.hidden_size + config.vocab_size


def gradient_length(config, tokens: int) -> int:
    """n for a weight's gradient through that forward pass: the backward retraces the forward's
    reductions (twice its length, forward included) and sums the contributions of ``tokens``.

    >>> from types import SimpleNamespace
    >>> tiny = SimpleNamespace(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
    ...                        head_dim=64, vocab_size=320)
    >>> gradient_length(tiny, tokens=20)
    6196
    """
    return 2 * forward_length(config, tokens) + tokens


def activation_magnitude(outputs) -> float:
    """The largest |x| among a forward pass's hidden states and logits (a Hugging Face output
    with ``output_hidden_states=True``): the size of the terms of its reductions.

    >>> from types import SimpleNamespace
    >>> hidden = (torch.tensor([1.0, -3.0]), torch.tensor([0.5]))
    >>> activation_magnitude(SimpleNamespace(hidden_states=hidden, logits=torch.tensor([2.0])))
    3.0
    """
    tensors = (*outputs.hidden_states, outputs.logits)
    return max(t.detach().abs().max().item() for t in tensors)


def model_bound(model, batch, magnitude=None, gradient=False, dtype=torch.float64) -> float:
    """How far two computations of one log-prob or entropy (or, with ``gradient``, one entry of a
    weight's gradient) of ``model`` (a Hugging Face decoder) on ``batch`` (``input_ids``,
    ``attention_mask``) can differ by rounding alone: another padding, another path, another
    summation order. n = ``forward_length`` over the batch's positions (with ``gradient``: the
    backward retraces it, 2 n, and sums the contributions of every token of the batch); terms at
    most ``magnitude``, by default the forward pass's largest activation.

    For a float64 model use the ``float64_qwen2`` fixture (tests/conftest.py): without it Qwen2's
    RMSNorm and rotary angles stay float32 and no float64 bound holds."""
    if magnitude is None:
        with torch.no_grad():
            outputs = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                output_hidden_states=True,
            )
        magnitude = activation_magnitude(outputs)
    n = forward_length(model.config, tokens=batch["input_ids"].shape[1])
    if gradient:
        n = 2 * n + batch["input_ids"].numel()
    return difference_bound(n=n, magnitude=magnitude, dtype=dtype)
