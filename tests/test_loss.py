"""Claims about loss.py, each checked against an independent computation.

Log-probs and entropies (the definition, and the chunked kernel of machinery/fast_logprobs.py
that the trainer runs) are compared with a naive float64 log_softmax and with each other;
advantages, the clipped surrogate, the anchor penalties and the aggregations with numbers worked
out by hand (in the comments); policy_loss's metrics with the same hand case. All on CPU, in
about a second.
"""

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import bounds
import loss
import sage
from machinery import UsageError, fast_logprobs
from machinery.fast_logprobs import chunked_token_logps_and_entropies

# --------------------------------------------------------------------------------------------
# 1. token_logps_and_entropies (the definition) and its chunked kernel
# --------------------------------------------------------------------------------------------

# The definition and the trainer's kernel: the claims below hold for both.
LOGPROB_PATHS = {
    "definition": loss.token_logps_and_entropies,
    "chunked": chunked_token_logps_and_entropies,
}


def naive_logps_and_entropies(logits, token_ids, temperature=1.0, min_p=0.0):
    """float64 reference: log_softmax of logits / T (min-p masked as vLLM does) and the entropy
    of that same distribution, written as sums over the kept tokens."""
    z = logits.double() / temperature
    probs = z.softmax(-1)
    keep = probs >= min_p * probs.amax(-1, keepdim=True)
    kept_probs = probs * keep / (probs * keep).sum(-1, keepdim=True)
    entropies = -torch.xlogy(kept_probs, kept_probs).sum(-1)
    logps = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    logps = logps.gather(-1, token_ids[..., None]).squeeze(-1)
    return logps, entropies


def sample_truncated(logits, temperature, min_p, generator):
    """Tokens drawn as the sampler draws them: softmax(z / T), min-p filter, renormalize (in
    float32, or float64 for float64 logits)."""
    probs = (logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature).softmax(-1)
    keep = probs >= min_p * probs.amax(-1, keepdim=True)
    truncated = probs * keep
    truncated = truncated / truncated.sum(-1, keepdim=True)
    flat = truncated.reshape(-1, truncated.shape[-1])
    token_ids = torch.multinomial(flat, 1, generator=generator).view(logits.shape[:-1])
    return token_ids, truncated


def random_logits(*shape, scale=3.0, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)


def kernel_bounds(logits, temperature, dtype, upstream=None):
    """Tolerances (values, logit gradients) for two computations of log softmax(logits / T) in
    ``dtype``: bounds.log_softmax_bound, n = vocab + 8; a gradient entry is
    upstream * (1[v = y] - p_v) / T."""
    finite = logits.detach().double()
    max_abs_z = finite[finite.isfinite()].abs().max().item() / temperature
    values = bounds.log_softmax_bound(vocab=logits.shape[-1], max_abs_logit=max_abs_z, dtype=dtype)
    scale = 1.0 if upstream is None else upstream.abs().max().item()
    return values, values * scale / temperature


@pytest.mark.parametrize("shape", [(12, 50), (2, 6, 50)], ids=["2d", "3d"])
@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 5], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.0), (0.7, 0.0), (1.0, 0.05), (1.3, 0.1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_logps_entropies_and_gradients_match_float64_reference(
    shape, chunk_rows, temperature, min_p, dtype
):
    """float64 logits: the kernel's algorithm, to float64's bound (far below any mistake);
    float32 logits: the trainer's dtype, to float32's (looser) bound."""
    # 12 rows: chunks of 4 divide them, chunks of 5 do not (a short last chunk).
    logits = random_logits(*shape, dtype=dtype).requires_grad_(True)
    token_ids, _ = sample_truncated(
        logits.detach(), temperature, max(min_p, 1e-9), torch.Generator().manual_seed(1)
    )
    upstream = torch.randn(shape[:-1], generator=torch.Generator().manual_seed(2)).to(dtype)

    reference_logits = logits.detach().double().requires_grad_(True)
    ref_logps, ref_entropies = naive_logps_and_entropies(
        reference_logits, token_ids, temperature, min_p
    )
    (ref_logps * upstream.double()).sum().backward()

    logps, entropies = chunked_token_logps_and_entropies(
        logits, token_ids, temperature, min_p, chunk_rows
    )
    (logps * upstream).sum().backward()

    assert logps.shape == entropies.shape == token_ids.shape
    assert logps.dtype == entropies.dtype == dtype
    # n = vocab + 8 (one log-softmax per row), in the kernel's dtype
    values, gradients = kernel_bounds(logits, temperature, dtype, upstream)
    torch.testing.assert_close(logps.double(), ref_logps.detach(), rtol=0, atol=values)
    torch.testing.assert_close(entropies.double(), ref_entropies.detach(), rtol=0, atol=values)
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, rtol=0, atol=gradients)


@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.0), (0.7, 0.05)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_the_definition_matches_the_float64_reference(temperature, min_p, dtype):
    logits = random_logits(2, 6, 50, dtype=dtype).requires_grad_(True)
    token_ids, _ = sample_truncated(
        logits.detach(), temperature, max(min_p, 1e-9), torch.Generator().manual_seed(1)
    )
    reference_logits = logits.detach().double().requires_grad_(True)
    ref_logps, ref_entropies = naive_logps_and_entropies(
        reference_logits, token_ids, temperature, min_p
    )
    ref_logps.sum().backward()
    logps, entropies = loss.token_logps_and_entropies(logits, token_ids, temperature, min_p)
    logps.sum().backward()
    assert logps.dtype == entropies.dtype == dtype
    values, gradients = kernel_bounds(logits, temperature, dtype)  # n = vocab + 8, upstream 1
    torch.testing.assert_close(logps.double(), ref_logps.detach(), rtol=0, atol=values)
    torch.testing.assert_close(entropies.double(), ref_entropies.detach(), rtol=0, atol=values)
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, rtol=0, atol=gradients)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["float64", "float32", "bf16"]
)
@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.0), (0.7, 0.05)])
def test_the_chunked_kernel_equals_the_definition(temperature, min_p, dtype):
    """loss.token_logps_and_entropies and machinery/fast_logprobs.py's chunked kernel: the same
    values, entropies and gradients (bf16 gradients rounded once, in the logits' dtype)."""
    logits = random_logits(3, 7, 40, dtype=dtype).requires_grad_(True)
    plain_logits = logits.detach().clone().requires_grad_(True)
    token_ids, _ = sample_truncated(
        logits.detach(), temperature, max(min_p, 1e-9), torch.Generator().manual_seed(3)
    )
    upstream = torch.randn(3, 7, generator=torch.Generator().manual_seed(4))
    plain_logps, plain_entropies = loss.token_logps_and_entropies(
        plain_logits, token_ids, temperature, min_p
    )
    (plain_logps * upstream).sum().backward()
    logps, entropies = chunked_token_logps_and_entropies(
        logits, token_ids, temperature, min_p, chunk_rows=4
    )
    (logps * upstream).sum().backward()
    # n = vocab + 8, in the arithmetic's dtype (float32 for bf16 logits)
    work = torch.promote_types(dtype, torch.float32)
    values, gradients = kernel_bounds(logits, temperature, work, upstream)
    torch.testing.assert_close(logps, plain_logps, rtol=0, atol=values)
    torch.testing.assert_close(entropies, plain_entropies, rtol=0, atol=values)
    assert logits.grad.dtype == plain_logits.grad.dtype == dtype
    if dtype != torch.bfloat16:
        torch.testing.assert_close(logits.grad, plain_logits.grad, rtol=0, atol=gradients)
    else:  # float32 arithmetic on both sides, then each rounds once to bf16 (u each)
        torch.testing.assert_close(
            logits.grad.float(),
            plain_logits.grad.float(),
            rtol=bounds.gamma(2, torch.bfloat16),
            atol=gradients,
        )


@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_bf16_logits_give_float32_results_and_bf16_gradients(min_p):
    logits = random_logits(3, 8, 64, dtype=torch.bfloat16).requires_grad_(True)
    token_ids, _ = sample_truncated(
        logits.detach(), 0.9, max(min_p, 1e-9), torch.Generator().manual_seed(3)
    )
    upstream = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))

    reference_logits = (
        logits.detach().double().requires_grad_(True)
    )  # the same bf16 values, exactly
    ref_logps, ref_entropies = naive_logps_and_entropies(reference_logits, token_ids, 0.9, min_p)
    (ref_logps * upstream.double()).sum().backward()
    logps, entropies = chunked_token_logps_and_entropies(
        logits, token_ids, 0.9, min_p, chunk_rows=5
    )
    (logps * upstream).sum().backward()

    # The arithmetic is float32 on the exact bf16 values: float32 accuracy (n = vocab + 8), not
    # bf16's.
    assert logps.dtype == entropies.dtype == torch.float32
    values, gradients = kernel_bounds(logits, 0.9, torch.float32, upstream)
    torch.testing.assert_close(logps.double(), ref_logps.detach(), rtol=0, atol=values)
    torch.testing.assert_close(entropies.double(), ref_entropies.detach(), rtol=0, atol=values)
    # The gradient comes back in the logits' dtype, rounded once (bf16 has 8 bits of mantissa).
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(
        logits.grad.double(),
        reference_logits.grad,
        rtol=bounds.gamma(1, torch.bfloat16),
        atol=gradients,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("path", LOGPROB_PATHS)
def test_min_p_replay_makes_the_on_policy_ratio_exactly_one(path, dtype):
    token_logps_and_entropies = LOGPROB_PATHS[path]
    temperature, min_p = 0.8, 0.1
    logits = random_logits(4, 16, 128, dtype=dtype)
    token_ids, truncated = sample_truncated(
        logits, temperature, min_p, torch.Generator().manual_seed(5)
    )
    behaviour_logps = truncated.gather(-1, token_ids[..., None]).squeeze(-1).log()

    with torch.no_grad():  # old log-probs: the trainer's own forward before the update
        old_logps, _ = token_logps_and_entropies(logits, token_ids, temperature, min_p)
    new_logps, _ = token_logps_and_entropies(
        logits.requires_grad_(True), token_ids, temperature, min_p
    )
    ratio = torch.exp(new_logps - old_logps)

    assert torch.isfinite(new_logps).all()  # every sampled token survives the replayed mask
    assert torch.equal(ratio, torch.ones_like(ratio))
    # They are the log-probs of the distribution the tokens were drawn from (the sampler's
    # softmax, sum and log: n = vocab + 8) ...
    values, _ = kernel_bounds(logits, temperature, dtype)
    torch.testing.assert_close(new_logps.detach(), behaviour_logps, rtol=0, atol=values)
    # ... and not those of the untruncated softmax that TRL uses (ratio = kept mass < 1).
    full_logps, _ = token_logps_and_entropies(logits, token_ids, temperature, 0.0)
    kept_mass = torch.exp(full_logps - new_logps.detach())
    assert (kept_mass < 1.0 - 1e-3).float().mean() > 0.9


@pytest.mark.parametrize("path", LOGPROB_PATHS)
def test_min_p_keeps_the_sampled_token_at_the_threshold(path):
    """The engine kept (it sampled) a token that the float32 replay puts just below the threshold.

    Its log-prob must stay finite (else old and new log-probs are both -inf and the ratio is
    NaN): it is that of the renormalized distribution over the kept set plus the sampled token.
    """
    min_p = 0.1
    # pi(v) / max pi = exp(z_v - 0): token 1 sits a hair below min_p, token 2 well above it.
    # float64, so that the bound stays far below the mass of the dropped token (exp(-9)).
    logits = torch.tensor([[0.0, math.log(min_p) - 1e-4, -1.0, -9.0]], dtype=torch.float64)
    token_ids = torch.tensor([1])
    logits.requires_grad_(True)
    logps, _ = LOGPROB_PATHS[path](logits, token_ids, 1.0, min_p)
    logps.sum().backward()
    kept = torch.tensor([0.0, math.log(min_p) - 1e-4, -1.0], dtype=torch.float64)
    assert torch.isfinite(logps).all() and torch.isfinite(logits.grad).all()
    values, _ = kernel_bounds(logits, 1.0, torch.float64)  # n = vocab + 8
    assert logps.item() == pytest.approx((kept.log_softmax(-1)[1]).item(), abs=values)
    assert logits.grad[0, 3].item() == 0.0  # the token min-p really dropped gets no gradient


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_the_kernels_backward_drops_the_tokens_its_forward_dropped(inplace_backward):
    """At the min-p threshold, within a rounding of it, the backward must test each token as the
    forward did: d log pi(y) / dz then sums to 0 over the vocabulary, as any softmax's gradient
    does. (The backward's test, rewritten against log pi, rounded otherwise in 589 of these
    4,096 rows, which then summed to up to min_p x max pi.)"""
    generator = torch.Generator().manual_seed(1)
    min_p, rows = 0.05, 4096
    logits = torch.randn(rows, 50, generator=generator) * 3
    at_threshold = logits.amax(-1) + math.log(min_p)  # token 1 of each row, within 1e-6 of it
    logits[:, 1] = at_threshold + torch.randn(rows, generator=generator) * 1e-6
    logits.requires_grad_(True)
    logps, _ = fast_logprobs.chunked_token_logps_and_entropies(
        logits.clone(),
        torch.zeros(rows, dtype=torch.long),
        min_p=min_p,
        inplace_backward=inplace_backward,
    )
    logps.sum().backward()
    assert logits.grad.sum(-1).abs().max() < 1e-5  # float32 sums of 50 terms of at most 1


@pytest.mark.parametrize("path", LOGPROB_PATHS)
def test_entropies_closed_forms_and_no_gradient(path):
    token_logps_and_entropies = LOGPROB_PATHS[path]
    vocab = 8
    logits = torch.zeros(2, vocab, dtype=torch.float64)  # float64: its bound, n = vocab + 8
    logits[1] = float("-inf")  # a one-hot distribution, written with -inf logits (masked vocab)
    logits[1, 3] = 5.0
    logits.requires_grad_(True)
    logps, entropies = token_logps_and_entropies(logits, torch.tensor([0, 3]), temperature=0.5)
    values, _ = kernel_bounds(logits, 0.5, torch.float64)
    assert entropies.tolist() == pytest.approx([math.log(vocab), 0.0], abs=values)
    assert logps.tolist() == pytest.approx([-math.log(vocab), 0.0], abs=values)
    # Eq. 12's H_t is a detached signal: it carries no gradient even from logits that do.
    assert logps.requires_grad and not entropies.requires_grad
    assert entropies.grad_fn is None

    # Temperature: H of softmax(z / T) for two logits (0, 1) at T = 2 is the binary entropy of
    # p = sigmoid(1/2).
    p = 1.0 / (1.0 + math.exp(-0.5))
    two_logits = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    _, entropy = token_logps_and_entropies(two_logits, torch.tensor([0]), temperature=2.0)
    values, _ = kernel_bounds(two_logits, 2.0, torch.float64)  # n = 2 + 8
    assert entropy.item() == pytest.approx(
        -(p * math.log(p) + (1 - p) * math.log(1 - p)), abs=values
    )


class LargeAllocations(TorchDispatchMode):
    """Records (op, dtype, numel) of each op output owning fresh storage of >= ``numel`` elements.

    Views (reshape, slicing) share their input's storage and are not counted; ``out=`` results
    write into an input and are not counted either.
    """

    def __init__(self, numel):
        super().__init__()
        self.numel, self.allocations = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.numel() >= self.numel
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.allocations.append((str(func), t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_chunked_path_never_materializes_a_float32_rows_by_vocab_tensor(min_p, monkeypatch):
    batch, length, vocab = 2, 32, 2048
    rows_per_chunk = 8
    monkeypatch.setattr(
        fast_logprobs, "CHUNK_BYTES", 4 * vocab * rows_per_chunk
    )  # the default chunking
    logits = random_logits(batch, length, vocab, dtype=torch.bfloat16).requires_grad_(True)
    token_ids, _ = sample_truncated(
        logits.detach(), 0.9, max(min_p, 1e-9), torch.Generator().manual_seed(6)
    )

    # Anything of more than two chunks' size, forward and backward.
    with LargeAllocations(2 * rows_per_chunk * vocab + 1) as seen:
        logps, entropies = chunked_token_logps_and_entropies(logits, token_ids, 0.9, min_p)
        logps.sum().backward()
    # No float32 work space beyond a couple of chunks; the only large allocation allowed is the
    # gradient that the bf16 logits need anyway, in bf16.
    assert all(
        dtype == torch.bfloat16 and numel == batch * length * vocab
        for _, dtype, numel in seen.allocations
    ), seen.allocations
    assert torch.isfinite(logps).all() and torch.isfinite(entropies).all()


@pytest.mark.xfail(
    strict=True,
    reason="known: reshape(-1, V) copies non-contiguous logits once; "
    "slice the hidden states before lm_head instead (see chunked_token_logps_and_entropies)",
)
def test_completion_slice_of_float32_logits_is_not_copied():
    """logits[:, prompt_len - 1 : -1] (the ValueError's advice) is not contiguous: no full copy."""
    batch, length, vocab, prompt_len = 2, 40, 2048, 9
    full_logits = random_logits(batch, length, vocab)
    token_ids = torch.randint(
        vocab, (batch, length - prompt_len), generator=torch.Generator().manual_seed(7)
    )
    completion_logits = full_logits[:, prompt_len - 1 : -1]
    assert not completion_logits.is_contiguous()
    with LargeAllocations(completion_logits.numel() // 2) as seen, torch.no_grad():
        logps, _ = chunked_token_logps_and_entropies(
            completion_logits, token_ids, 1.0, 0.0, chunk_rows=8
        )
    assert seen.allocations == []
    ref_logps, _ = naive_logps_and_entropies(completion_logits, token_ids)
    values, _ = kernel_bounds(completion_logits, 1.0, torch.float32)  # n = vocab + 8: loose
    torch.testing.assert_close(logps.double(), ref_logps, rtol=0, atol=values)


def test_bad_logits_raise_clear_errors():
    logits = torch.randn(3, 4, 10)
    with pytest.raises(ValueError, match="disagree"):
        chunked_token_logps_and_entropies(logits, torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logps_and_entropies(
            logits, torch.zeros(3, 4, dtype=torch.long), temperature=0.0
        )
    with pytest.raises(ValueError, match="min_p"):
        chunked_token_logps_and_entropies(logits, torch.zeros(3, 4, dtype=torch.long), min_p=1.0)
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[1, 2, 7] = bad
        for min_p in (0.0, 0.1):
            with pytest.raises(FloatingPointError, match="NaN or inf"):  # sage.py: one line
                chunked_token_logps_and_entropies(
                    broken, torch.zeros(3, 4, dtype=torch.long), min_p=min_p
                )


# --------------------------------------------------------------------------------------------
# 2. Advantages
# --------------------------------------------------------------------------------------------

# Three prompts x four rollouts: 1 of 4 correct, 2 of 4 correct, all correct.
REWARDS = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1])


def test_grpo_advantages_by_hand():
    # Group 1: mean 1/4, Bessel std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 1/2.
    # Group 2: mean 1/2, Bessel std sqrt(4 * 0.25 / 3) = 1/sqrt(3). Group 3: all equal -> 0.
    eps = 1e-4
    s1, s2 = 0.5 + eps, 1 / math.sqrt(3) + eps
    expected = [
        0.75 / s1,
        -0.25 / s1,
        -0.25 / s1,
        -0.25 / s1,
        0.5 / s2,
        0.5 / s2,
        -0.5 / s2,
        -0.5 / s2,
        0,
        0,
        0,
        0,
    ]
    assert loss.grpo_advantages(REWARDS, 4).tolist() == pytest.approx(expected, abs=1e-6)
    assert loss.compute_advantages(REWARDS, 4, "grpo").tolist() == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_and_rloo_advantages_by_hand():
    # Dr. GRPO: r - mean(r). RLOO: r_i - mean of the other three.
    dr_grpo = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0]
    rloo = [1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3, 0, 0, 0, 0]
    assert loss.compute_advantages(REWARDS, 4, "dr_grpo").tolist() == pytest.approx(
        dr_grpo, abs=1e-6
    )
    assert loss.compute_advantages(REWARDS, 4, "rloo").tolist() == pytest.approx(rloo, abs=1e-6)


def test_bnpo_beta_parameters_and_advantages_by_hand():
    # Groups with success rates p^ = 1/4, 1/4, 1/2: mu = 1/3, population variance
    # s2 = (2 (1/12)^2 + (1/6)^2) / 3 = 1/72, mu (1 - mu) / s2 - 1 = (2/9) * 72 - 1 = 15,
    # a = 15/3 = 5, b = 15 * 2/3 = 10, alpha = 1 + 5/3 = 8/3, beta = 1 + 10/3 = 13/3.
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0])
    p_hat = torch.tensor([0.25, 0.25, 0.5])
    alpha, beta = loss.bnpo_beta_parameters(p_hat)
    assert (alpha, beta) == (pytest.approx(8 / 3), pytest.approx(13 / 3))

    def density(p):  # f_Beta(p; 8/3, 13/3), with B(a, b) = Gamma(a) Gamma(b) / Gamma(a + b)
        a, b = 8 / 3, 13 / 3
        return (
            p ** (a - 1) * (1 - p) ** (b - 1) * math.gamma(a + b) / (math.gamma(a) * math.gamma(b))
        )

    f1, f2 = density(0.25), density(0.5)
    expected = [
        0.75 / f1,
        -0.25 / f1,
        -0.25 / f1,
        -0.25 / f1,
        -0.25 / f1,
        -0.25 / f1,
        0.75 / f1,
        -0.25 / f1,
        0.5 / f2,
        -0.5 / f2,
        0.5 / f2,
        -0.5 / f2,
    ]
    assert loss.compute_advantages(rewards, 4, "bnpo").tolist() == pytest.approx(expected, rel=1e-5)
    assert loss.beta_density(p_hat, alpha, beta).tolist() == pytest.approx([f1, f1, f2], rel=1e-5)
    # float64 rewards keep float64 advantages, to float64's rounding (float32's was 6e-8)
    exact = loss.compute_advantages(rewards.double(), 4, "bnpo")
    assert exact.dtype == torch.float64 and exact.tolist() == pytest.approx(expected, rel=1e-12)


def test_bnpo_without_spread_in_success_rates_is_dr_grpo():
    # One group (or all groups alike): the moments are undefined, alpha = beta = 1, f = 1.
    rewards = torch.tensor([1.0, 0, 0, 0])
    assert loss.bnpo_beta_parameters(torch.tensor([0.25])) == (1.0, 1.0)
    assert loss.bnpo_advantages(rewards, 4).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_bnpo_refuses_returns_outside_the_unit_interval_in_one_line():
    # An overlong penalty of -0.75 (or a plug-in reward) takes a group's mean below 0, where the
    # Beta density is NaN: that group's advantages were the 1e6 clamp's (about 9e4), not order 1.
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0] * 7 + [0.0] * 7 + [-0.75])
    with pytest.raises(UsageError, match=r"mean rewards run from -0.0938 to 0.5, outside \[0, 1\]"):
        loss.compute_advantages(rewards, 8, "bnpo")


@pytest.mark.parametrize("kind", loss.ADVANTAGES)
def test_a_group_of_equal_rewards_has_advantages_of_exactly_zero(kind):
    # sixteen rewards of 0.7: their float32 mean is a rounding off 0.7, which GRPO's eps of 1e-4
    # turned into advantages of 6e-4
    rewards = torch.tensor([0.7] * 16 + [1.0] + [0.0] * 15)
    advantages = loss.compute_advantages(rewards, 16, kind)
    assert advantages[:16].tolist() == [0.0] * 16
    assert advantages[16] > 0 > advantages[17]


@pytest.mark.parametrize("kind", loss.ADVANTAGES)
def test_float64_rewards_give_float64_advantages(kind):
    # the exact checks feed float64 returns; their advantages were cast to float32
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float64)
    assert loss.compute_advantages(rewards, 4, kind).dtype == torch.float64


def test_bnpo_at_alpha_beta_three_halves_is_proportional_to_grpo():
    # f(p; 3/2, 3/2) = sqrt(p (1 - p)) / B(3/2, 3/2) = (8 / pi) sqrt(p (1 - p)), and a binary
    # group's Bessel std is sqrt(G / (G - 1) p (1 - p)): the two advantages differ by a constant.
    group_size = 8
    ratios = []
    for successes in range(1, group_size):
        rewards = torch.tensor([1.0] * successes + [0.0] * (group_size - successes))
        p = successes / group_size
        density = loss.beta_density(torch.tensor([p]), 1.5, 1.5).item()
        assert density == pytest.approx(8 / math.pi * math.sqrt(p * (1 - p)), rel=1e-6)
        bnpo = (rewards - p) / density
        grpo = loss.grpo_advantages(rewards, group_size, eps=0.0)
        ratios.append((bnpo / grpo).tolist())
    constant = math.pi / 8 * math.sqrt(group_size / (group_size - 1))
    assert [r for row in ratios for r in row] == pytest.approx(
        [constant] * (group_size - 1) * group_size, rel=1e-5
    )


@pytest.mark.parametrize("kind", loss.ADVANTAGES)
def test_all_equal_groups_give_zero_advantage(kind):
    # Mixed groups elsewhere in the batch so that BNPO's Beta is not the degenerate one.
    rewards = torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0])
    advantages = loss.compute_advantages(rewards, 4, kind)
    assert advantages[:8].tolist() == [0.0] * 8
    assert torch.isfinite(advantages).all() and advantages[8:].abs().sum() > 0


def test_bad_advantage_inputs_raise():
    with pytest.raises(ValueError, match="divisible"):
        loss.compute_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="1-D"):
        loss.compute_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="RLOO"):
        loss.compute_advantages(torch.zeros(4), 1, "rloo")
    with pytest.raises(ValueError, match="unknown advantage"):
        loss.compute_advantages(torch.zeros(4), 4, "ppo")


def test_kl_shaped_rewards_by_hand():
    # r - beta * sum over completion tokens of (log pi - log pi_ref - log q).
    rewards = torch.tensor([1.0, 0.0])
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 99.0]])
    ref_logps = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -0.5, 99.0]])
    log_q = torch.tensor([[0.1, 0.0, 0.2], [0.0, 0.3, 99.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    # Row 1: (0.5 - 0.1) + (-1 - 0) + (0 - 0.2) = -0.8;  row 2: (0.5 - 0) + (0 - 0.3) = 0.2.
    shaped = loss.kl_shaped_rewards(rewards, logps, ref_logps, log_q, mask, beta=0.5)
    assert shaped.tolist() == pytest.approx([1.0 + 0.4, 0.0 - 0.1])


# --------------------------------------------------------------------------------------------
# 3. The clipped surrogate
# --------------------------------------------------------------------------------------------


def test_clipped_surrogate_by_hand_with_asymmetric_eps():
    eps_low, eps_high = 0.1, 0.3  # ratio clipped to [0.9, 1.3]
    ratios = torch.tensor([[1.1, 1.5, 0.5], [1.1, 1.5, 0.5]], dtype=torch.float64)
    advantages = torch.tensor([2.0, -2.0], dtype=torch.float64)
    logps = ratios.log().requires_grad_(True)
    per_token = loss.clipped_surrogate(
        logps, torch.zeros_like(logps), advantages, eps_low=eps_low, eps_high=eps_high
    )
    # A > 0: -min(rho A, clip(rho) A): 1.1 inside -> -2.2; 1.5 above -> -1.3 * 2 (clipped);
    #        0.5 below -> -0.5 * 2 (the min keeps the unclipped, worse value).
    # A < 0: 1.1 inside -> 2.2; 1.5 above -> 1.5 * 2 (unclipped); 0.5 below -> 0.9 * 2 (clipped).
    expected = [[-2.2, -2.6, -1.0], [2.2, 3.0, 1.8]]
    assert per_token.tolist() == [pytest.approx(row) for row in expected]
    # d/dlogp of -rho A is -rho A where unclipped, 0 where the clip is active.
    per_token.sum().backward()
    expected_grad = [[-2.2, 0.0, -1.0], [2.2, 3.0, 0.0]]
    assert logps.grad.tolist() == [pytest.approx(row) for row in expected_grad]


# --------------------------------------------------------------------------------------------
# 4. The anchor penalty
# --------------------------------------------------------------------------------------------

LOG_U = [-1.0, -0.2, 0.0, 0.5, 2.0]  # log u = log p~ - log pi


def penalty_and_grad(log_u, kl, estimator):
    logps = torch.zeros(len(log_u), dtype=torch.float64, requires_grad=True)
    anchor_logps = torch.tensor(log_u, dtype=torch.float64)
    value = loss.anchor_penalty(logps, anchor_logps, kl, estimator)
    grad = (
        torch.autograd.grad(value.sum(), logps, allow_unused=True)[0]
        if value.requires_grad
        else None
    )
    return value.detach(), grad


def test_anchor_penalty_values_by_hand():
    k2 = [x * x / 2 for x in LOG_U]
    k3 = [math.exp(x) - 1 - x for x in LOG_U]
    forward = [math.exp(x) * x - math.exp(x) + 1 for x in LOG_U]
    assert penalty_and_grad(LOG_U, "reverse", "k2")[0].tolist() == pytest.approx(k2)
    assert penalty_and_grad(LOG_U, "reverse", "k3")[0].tolist() == pytest.approx(k3)
    assert penalty_and_grad(LOG_U, "reverse", "ratio_k3")[0].tolist() == pytest.approx(k3)
    assert penalty_and_grad(LOG_U, "forward", "k3")[0].tolist() == pytest.approx(forward)
    assert penalty_and_grad(LOG_U, "reverse", "k1_return")[0].tolist() == [0.0] * len(LOG_U)
    assert penalty_and_grad(LOG_U, "none", "k3")[0].tolist() == [0.0] * len(LOG_U)


def test_ratio_k3_off_policy_is_trls_bias_corrected_kl():
    # From the second --ppo-epochs pass pi != pi_old: TRL's use_bias_correction_kl weighs k3 by
    # pi / pi_old (the samples are pi_old's), in value and in gradient, wherever policy_loss runs.
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old_logps = torch.tensor([[-1.3, -1.8, -0.5]], dtype=torch.float64)
    ref_logps = torch.tensor([[-1.2, -2.5, -0.1]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    config = loss.LossConfig(kl_estimator="ratio_k3", beta=1.0)
    fixed = loss.HeldFixed(old_logps=old_logps, ref_logps=ref_logps)
    value, _ = loss.policy_loss(logps, torch.zeros(1, dtype=torch.float64), mask, fixed, config)
    (gradient,) = torch.autograd.grad(value, logps)

    def trl(logps):  # per token exp(log pi - log pi_old) * k3, then GRPO's mean over the tokens
        log_u = ref_logps - logps
        return (torch.exp(logps - old_logps) * (log_u.exp() - 1 - log_u)).mean()

    expected = trl(logps)
    (expected_gradient,) = torch.autograd.grad(expected, logps)
    assert value.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-12, atol=0)


def test_anchor_penalty_gradients():
    # d/dlog pi with u = exp(log p~ - log pi): k2 -> -log u; k3 -> 1 - u;
    # ratio_k3 -> k3 + (1 - u) = -log u, the gradient of k2 (docs/fixed-points.md).
    _, k2_grad = penalty_and_grad(LOG_U, "reverse", "k2")
    _, k3_grad = penalty_and_grad(LOG_U, "reverse", "k3")
    _, ratio_k3_grad = penalty_and_grad(LOG_U, "reverse", "ratio_k3")
    assert k2_grad.tolist() == pytest.approx([-x for x in LOG_U])
    assert k3_grad.tolist() == pytest.approx([1 - math.exp(x) for x in LOG_U])
    torch.testing.assert_close(ratio_k3_grad, k2_grad)
    assert not torch.allclose(k3_grad, k2_grad)
    # k1_return puts nothing in the loss: no gradient at all.
    assert penalty_and_grad(LOG_U, "reverse", "k1_return")[1] is None


def test_forward_and_k3_estimators_are_nonnegative_and_zero_at_u_one():
    log_u = torch.cat(
        [torch.linspace(-6, 6, 240, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    )
    for kl, estimator in [("forward", "k3"), ("reverse", "k3"), ("reverse", "k2")]:
        value = loss.anchor_penalty(torch.zeros_like(log_u), log_u, kl, estimator)
        assert (value >= 0).all()
        assert value[-1].item() == 0.0  # u = 1


def test_anchor_penalty_rejects_unknown_modes():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown kl"):
        loss.anchor_penalty(x, x, "sideways", "k3")
    with pytest.raises(ValueError, match="unknown kl estimator"):
        loss.anchor_penalty(x, x, "reverse", "k4")


# --------------------------------------------------------------------------------------------
# 5. Aggregation
# --------------------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, 70.0, 80.0, 90.0], [5.0, 6.0, 10.0, 0.0]])
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0]])  # 3 + 1 + 3 = 7 tokens, sum 31


def test_aggregations_by_hand():
    assert loss.aggregate(PER_TOKEN, MASK, "grpo").item() == pytest.approx((2.0 + 4.0 + 7.0) / 3)
    assert loss.aggregate(PER_TOKEN, MASK, "batch_token_mean").item() == pytest.approx(31 / 7)
    assert loss.aggregate(
        PER_TOKEN, MASK, "dr_grpo", max_completion_length=5
    ).item() == pytest.approx(31 / 15)
    assert loss.aggregate(PER_TOKEN, MASK, "dapo").item() == pytest.approx(31 / 7)
    assert loss.aggregate(PER_TOKEN, MASK, "dapo", global_num_tokens=10).item() == pytest.approx(
        3.1
    )


def test_dapo_micro_batches_sum_to_the_token_mean_of_the_whole_batch():
    per_token = PER_TOKEN.clone().requires_grad_(True)
    global_num_tokens = int(MASK.sum())
    micro_batches = [slice(0, 1), slice(1, 3)]
    total = sum(
        loss.aggregate(per_token[rows], MASK[rows], "dapo", global_num_tokens=global_num_tokens)
        for rows in micro_batches
    )
    total.backward()
    whole = PER_TOKEN.clone().requires_grad_(True)
    expected = loss.aggregate(whole, MASK, "batch_token_mean")
    expected.backward()
    assert total.item() == pytest.approx(expected.item())
    torch.testing.assert_close(per_token.grad, whole.grad)
    # The per-micro-batch token mean (no global count) does not have this property.
    naive = sum(loss.aggregate(PER_TOKEN[rows], MASK[rows], "dapo") for rows in micro_batches)
    assert naive.item() != pytest.approx(expected.item())


def test_bad_aggregation_arguments_raise():
    with pytest.raises(ValueError, match="max_completion_length"):
        loss.aggregate(PER_TOKEN, MASK, "dr_grpo")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        loss.aggregate(PER_TOKEN, MASK, "sum")


# --------------------------------------------------------------------------------------------
# policy_loss
# --------------------------------------------------------------------------------------------


def hand_case():
    """Two completions (3 and 2 tokens), ratios inside and outside [0.8, 1.2], a guide q."""
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    ratios = torch.tensor([[1.0, 1.5, 0.7], [0.7, 1.1, 1.0]])
    old_logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, 0.0]])
    logps = old_logps + ratios.log()
    ref_logps = torch.tensor([[-1.2, -1.5, -0.4], [-1.0, -0.3, 0.0]])
    q = torch.tensor([[1.0, 1.3, 1.0], [0.8, 1.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0])
    entropies = torch.tensor([[0.5, 2.0, 0.1], [1.5, 0.3, 7.0]])
    return dict(
        logps=logps,
        old_logps=old_logps,
        advantages=advantages,
        completion_mask=mask,
        ref_logps=ref_logps,
        log_q=q.log(),
        entropies=entropies,
    )


def run_loss(case, engine_logps=None, weights=None, q_constant=False, **options):
    """policy_loss on a ``hand_case``-shaped dict; ``options`` are LossConfig's fields."""
    fixed = loss.HeldFixed(
        case["old_logps"],
        case.get("ref_logps"),
        case.get("log_q"),
        case.get("entropies"),
        engine_logps=engine_logps,
        importance_weights=weights,
    )
    total, metrics = loss.policy_loss(
        case["logps"],
        case["advantages"],
        case["completion_mask"],
        fixed,
        loss.LossConfig(**options),
    )
    offset = loss.anchor_offset(fixed.log_q, case["completion_mask"], q_constant=q_constant)
    return total, metrics | offset


def test_policy_loss_and_metrics_by_hand():
    case = hand_case()
    beta = 0.1
    logps = case["logps"].clone().requires_grad_(True)
    total, metrics = run_loss({**case, "logps": logps}, beta=beta, q_constant=True)

    # Independently, in float64, token by token (eps = 0.2 both sides, grpo aggregation).
    mask = case["completion_mask"].double()
    new, old, ref, log_q = (case[k].double() for k in ("logps", "old_logps", "ref_logps", "log_q"))
    rho = torch.exp(new - old)
    a = case["advantages"].double()[:, None]
    surrogate = -torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a)
    log_u = ref + log_q - new
    k3 = log_u.exp() - 1 - log_u
    per_token = (surrogate + beta * k3) * mask
    expected_loss = (per_token.sum(-1) / mask.sum(-1)).mean()
    assert total.item() == pytest.approx(expected_loss.item(), rel=1e-5)

    def token_mean(x):
        return ((x * mask).sum() / mask.sum()).item()

    ref_log_u = ref - new
    q = log_q.exp()
    expected = {
        "loss": expected_loss.item(),
        "kl/ref_k3": token_mean(ref_log_u.exp() - 1 - ref_log_u),
        "kl/anchor_k3": token_mean(k3),
        "kl/anchor_offset": token_mean(q - 1 - log_q),  # E[k3] - KL = q - 1 - log q per token
        "q/mean": (1.0 + 1.3 + 1.0 + 0.8 + 1.0) / 5,
        "q/min": 0.8,
        "q/max": 1.3,
        "q/frac_active": 2 / 5,
        # Low: rho < 0.8 with A < 0 -> token (1, 0). High: rho > 1.2 with A > 0 -> token (0, 1).
        "clip_ratio/low": 1 / 5,
        "clip_ratio/high": 1 / 5,
        "clip_ratio/region": 2 / 5,
        "entropy": (0.5 + 2.0 + 0.1 + 1.5 + 0.3) / 5,
    }
    assert set(expected) <= set(metrics)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize(
    "eps_low,eps_high,low,high",
    [
        (0.1, 0.3, 1 / 5, 1 / 5),
        (0.35, 0.6, 0.0, 0.0),
        (0.2, 0.6, 1 / 5, 0.0),
        (0.4, 0.28, 0.0, 1 / 5),
    ],
)
def test_clip_fractions_count_only_the_clipped_side_of_each_advantage_sign(
    eps_low, eps_high, low, high
):
    # Ratios 1.5 (A > 0) and 0.7 (A < 0) can clip; 0.7 with A > 0 never does (the min keeps it).
    _, metrics = run_loss(hand_case(), beta=0.0, eps_low=eps_low, eps_high=eps_high)
    assert metrics["clip_ratio/low"] == pytest.approx(low)
    assert metrics["clip_ratio/high"] == pytest.approx(high)
    assert metrics["clip_ratio/region"] == pytest.approx(low + high)


def test_branch_guide_from_the_policys_own_forward_pass_sends_gradient_only_to_the_logits():
    """End to end: logits -> (logps, H_t) -> log_q (Eq. 11) -> policy_loss; q and H_t stay fixed."""
    import guides

    logits = random_logits(2, 6, 16, scale=0.5).requires_grad_(True)  # high entropy: log 16 = 2.77
    token_ids, _ = sample_truncated(logits.detach(), 1.0, 1e-9, torch.Generator().manual_seed(8))
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2])
    logps, entropies = chunked_token_logps_and_entropies(logits, token_ids)  # the trainer's path
    log_q = guides.compute_log_q(
        guides.GuideConfig("branch"), logps, entropies, mask, step=0, total_steps=10
    )
    assert not log_q.requires_grad and not entropies.requires_grad
    expected_q = (1 + 0.3 * (entropies - 1.2).clamp_min(0)).clamp(0.6, 1.4)
    torch.testing.assert_close(log_q, expected_q.log() * mask)
    fixed = loss.HeldFixed(
        logps.detach(), ref_logps=logps.detach(), log_q=log_q, entropies=entropies
    )
    total, metrics = loss.policy_loss(
        logps,
        torch.tensor([1.0, -1.0]),
        mask,
        fixed,
        loss.LossConfig(),
    )
    metrics |= loss.anchor_offset(log_q, mask, q_constant=True)
    total.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert metrics["q/frac_active"] == 1.0 and metrics["q/min"] > 1.0  # every H_t > tau here
    assert metrics["kl/ref_k3"] == 0.0  # pi = pi_ref
    # ... while k3 against p~ = pi_ref q reads q - 1 - log q per token (docs/fixed-points.md).
    assert metrics["kl/anchor_k3"] == pytest.approx(metrics["kl/anchor_offset"], rel=1e-5)


def test_the_k3_offset_is_logged_only_where_it_is_defined():
    """The token guide gives q only to the sampled token: E_ref[q] at a position, and so the offset
    E[k3 against p~] - KL = E_ref[q] - 1 - E_pi[log q], cannot be computed from the samples."""
    case = hand_case()
    _, metrics = run_loss(case, beta=0.1)
    assert "kl/anchor_offset" not in metrics and "q/mean" in metrics


def test_negative_clip_epsilons_are_rejected():
    """eps_high = -1 would clip the ratio to [0.8, 0.0], dropping every A > 0 gradient."""
    with pytest.raises(ValueError, match="--eps-high -1.0: must be a finite number >= 0"):
        loss.LossConfig(eps_high=-1.0)
    with pytest.raises(ValueError, match=r"--eps-low 1.5: must be a finite number in \[0, 1\)"):
        loss.LossConfig(eps_low=1.5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("advantage", "ppo", "unknown --advantage 'ppo'"),
        ("aggregation", "sum", "unknown --loss-agg 'sum'"),
        ("kl", "sideways", "unknown --kl 'sideways'"),
        ("kl_estimator", "k4", "unknown --kl-estimator 'k4'"),
        ("beta", -0.1, "--beta -0.1: must be a finite number >= 0"),
        ("beta", float("inf"), "--beta inf: must be a finite number >= 0"),
        ("tis_cap", float("nan"), "--tis-cap nan: must be a finite number >= 0"),
        ("tis_cap", -1.0, "--tis-cap -1.0: must be a finite number >= 0"),
    ],
)
def test_a_loss_config_that_cannot_run_is_rejected_in_one_line(field, value, message):
    with pytest.raises(ValueError, match=message):
        loss.LossConfig(**{field: value})
    assert loss.LossConfig() == loss.LossConfig(
        advantage="grpo",
        aggregation="grpo",
        eps_low=0.2,
        eps_high=0.2,
        kl="reverse",
        kl_estimator="k3",
        beta=0.05,
        tis_cap=0.0,
    )


def test_policy_loss_gradient_never_flows_into_the_anchor_or_the_signals():
    """log_q, ref_logps, old_logps and the entropies are held fixed (Eq. 3), even with a grad."""
    case = hand_case()
    fixed = {
        k: case[k].clone().requires_grad_(True)
        for k in ("old_logps", "ref_logps", "log_q", "entropies")
    }
    logps = case["logps"].clone().requires_grad_(True)
    total, _ = run_loss({**case, **fixed, "logps": logps}, beta=0.5)
    total.backward()
    assert logps.grad is not None and logps.grad.abs().sum() > 0
    for name, tensor in fixed.items():
        assert tensor.grad is None, f"gradient flowed into {name}"


def test_k1_return_contributes_nothing_to_the_loss():
    case = hand_case()
    results = []
    for beta, estimator in [(0.0, "k3"), (5.0, "k1_return")]:
        logps = case["logps"].clone().requires_grad_(True)
        total, _ = run_loss({**case, "logps": logps}, beta=beta, kl_estimator=estimator)
        total.backward()
        results.append((total.item(), logps.grad))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


def test_beta_zero_or_kl_none_needs_no_reference():
    case = {**hand_case(), "ref_logps": None}
    with_beta_zero, metrics = run_loss(case, beta=0.0)
    with_kl_none, _ = run_loss(case, kl="none")
    assert with_beta_zero.item() == with_kl_none.item()
    assert "kl/ref_k3" not in metrics
    with pytest.raises(AssertionError, match="needs ref_logps"):
        run_loss(case, beta=0.05)


def test_importance_weights_scale_the_surrogate():
    case = hand_case()
    weights = torch.full_like(case["logps"], 2.0)
    plain, _ = run_loss(case, beta=0.0)
    weighted, _ = run_loss(case, beta=0.0, weights=weights)
    assert weighted.item() == pytest.approx(2 * plain.item())


def test_tis_cap_weights_the_surrogate_by_min_of_pi_old_over_pi_engine_and_the_cap():
    """--tis-cap C: the weights are min(pi_old / pi_engine, C) on completion tokens, as the trainer
    made them before they moved into policy_loss; 0 turns them off."""
    case = hand_case()
    mask = case["completion_mask"]
    engine_logps = case["old_logps"] - torch.tensor([[math.log(3.0), 0.0, -0.5], [0.2, 0.0, 0.0]])
    capped, _ = run_loss(case, engine_logps=engine_logps, beta=0.1, tis_cap=2.0)
    weights = torch.exp(case["old_logps"] - engine_logps).clamp(max=2.0) * mask
    expected, _ = run_loss(case, weights=weights, beta=0.1)
    assert capped.item() == expected.item()
    assert weights[0, 0].item() == 2.0  # pi_old / pi_engine = 3, capped
    off, _ = run_loss(case, engine_logps=engine_logps, beta=0.1)
    plain, _ = run_loss(case, beta=0.1)
    assert off.item() == plain.item() != capped.item()
    with pytest.raises(AssertionError, match="needs the engine.s log-probs"):
        run_loss(case, tis_cap=2.0)
    with pytest.raises(AssertionError, match="from --tis-cap or given"):
        run_loss(case, engine_logps=engine_logps, weights=weights, tis_cap=2.0)


def test_padding_content_never_changes_the_loss_or_its_gradient():
    case = hand_case()
    padding = ~case["completion_mask"].bool()

    def run(fill):
        inputs = {
            k: (v.masked_fill(padding, fill) if v.dim() == 2 and k != "completion_mask" else v)
            for k, v in case.items()
        }
        logps = inputs["logps"].clone().requires_grad_(True)
        total, metrics = run_loss({**inputs, "logps": logps}, beta=0.1, kl="reverse")
        total.backward()
        return total.item(), logps.grad[~padding], metrics

    clean_loss, clean_grad, clean_metrics = run(0.0)
    for fill in (-1e4, float("-inf"), float("nan")):
        dirty_loss, dirty_grad, dirty_metrics = run(fill)
        assert dirty_loss == clean_loss, fill
        assert torch.equal(dirty_grad, clean_grad), fill
        assert dirty_metrics == clean_metrics, fill


def test_policy_loss_bad_inputs_fail_its_asserts_and_a_nan_makes_the_loss_nan():
    case = hand_case()
    with pytest.raises(AssertionError, match="old_logps"):
        run_loss({**case, "old_logps": case["old_logps"][:, :2]})
    with pytest.raises(AssertionError, match="advantages"):
        run_loss({**case, "advantages": torch.zeros(3)})
    with pytest.raises(AssertionError, match="no completion token"):
        run_loss({**case, "completion_mask": case["completion_mask"][0]})
    with pytest.raises(AssertionError, match="no completion token"):
        run_loss({**case, "completion_mask": torch.zeros(2, 3)})
    for name in ("logps", "old_logps", "ref_logps", "log_q"):  # the trainer refuses such a loss
        broken = case[name].clone()
        broken[1, 0] = float("nan")
        assert not torch.isfinite(run_loss({**case, name: broken}, beta=0.1)[0]), name
    assert not torch.isfinite(
        run_loss({**case, "advantages": torch.tensor([1.0, float("nan")])})[0]
    )


# ---- batches and log-probs of a model (collate, completion_logps) ----


def test_left_padding_does_not_change_log_probs(tiny, float64_qwen2):
    # float64: float32's bound over a forward pass would hide a real mistake
    model, tokenizer = copy.deepcopy(tiny[0]).double(), tiny[1]
    prompt = tokenizer("What is 3 + 4?")["input_ids"]
    completion = tokenizer("<start_working_out>3+4=7")["input_ids"]
    alone = loss.collate([prompt], [completion], tokenizer.pad_token_id, "cpu")
    padded = loss.collate(
        [[1, 2, 3, 4, 5] + prompt, prompt],
        [completion[:3], completion],
        tokenizer.pad_token_id,
        "cpu",
    )
    with torch.no_grad():
        logps_alone, entropies_alone = loss.completion_logps(model, alone, 1.0, 0.0)
        logps_padded, entropies_padded = loss.completion_logps(model, padded, 1.0, 0.0)
    tolerance = bounds.model_bound(model, padded)
    torch.testing.assert_close(logps_padded[1], logps_alone[0], atol=tolerance, rtol=0)
    torch.testing.assert_close(entropies_padded[1], entropies_alone[0], atol=tolerance, rtol=0)
    assert padded["completion_mask"][0].tolist() == [1.0] * 3 + [0.0] * (len(completion) - 3)


def test_completion_logps_match_a_full_forward(tiny, float64_qwen2):
    model, tokenizer = copy.deepcopy(tiny[0]).double(), tiny[1]  # float64, as above
    prompt, completion = tokenizer("Add 2 and 5.")["input_ids"], tokenizer("2+5=7")["input_ids"]
    batch = loss.collate([prompt], [completion], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logps, _ = loss.completion_logps(model, batch, 0.7, 0.05)
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / 0.7
        keep = logits.softmax(-1) >= 0.05 * logits.softmax(-1).max(-1, keepdim=True).values
        expected = (
            logits.masked_fill(~keep, float("-inf"))
            .log_softmax(-1)
            .gather(-1, torch.tensor(completion)[:, None])
        )
    tolerance = bounds.model_bound(model, batch)
    torch.testing.assert_close(logps[0], expected[:, 0], atol=tolerance, rtol=0)


def perturbed_lora(tiny, dtype=torch.float64):
    """The tiny model in ``dtype`` with LoRA adapters whose A and B are seeded and B non-zero (the
    adapters change the output), in train mode: the same weights whatever ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # peft draws A from the global RNG
        model = sage.wrap_lora(copy.deepcopy(tiny[0]), rank=4, alpha=8)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
    return model.to(dtype).train()


def logps_entropies_and_gradients(model, batch: dict, fast: bool = True):
    """loss.completion_logps of ``batch`` (temperature 0.8, min-p 0.05) and the trained
    parameters' gradients of the completion tokens' summed log-probs."""
    logps, entropies = loss.completion_logps(model, batch, temperature=0.8, min_p=0.05, fast=fast)
    (logps * batch["completion_mask"]).sum().backward()
    gradients = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    return logps.detach(), entropies, gradients


def assert_equal_up_to_rounding(got: list, expected: list, model, batch: dict) -> None:
    for got_tensor, expected_tensor in zip(got, expected):
        magnitude = expected_tensor.abs().max().item()
        tolerance = bounds.model_bound(model, batch, magnitude=magnitude, gradient=True)
        torch.testing.assert_close(got_tensor, expected_tensor, atol=tolerance, rtol=0)


def test_a_shared_prompt_gives_the_log_probs_and_gradients_of_separate_copies(tiny, float64_qwen2):
    """G completions of one prompt: running the prompt once and repeating its cache must change
    nothing but the cost (log-probs, entropies and the gradient through the prompt positions).
    In float64, so that the two summation orders differ by float64's rounding bound, far below
    any mistake, on every CPU."""
    import random

    model = perturbed_lora(tiny)
    rng, prompts, completions = random.Random(0), [], []
    for _ in range(3):
        prompt = [
            rng.randrange(5, 300) for _ in range(rng.randint(5, 12))
        ]  # prompts of different lengths
        for _ in range(4):
            prompts.append(prompt)
            completions.append([rng.randrange(5, 300) for _ in range(rng.randint(1, 9))])
    results = []
    for group_size in (1, 4):
        batch = loss.collate(prompts, completions, 0, "cpu", group_size=group_size)
        assert batch["group_size"] == group_size
        results.append(logps_entropies_and_gradients(model, batch))
    mask = batch["completion_mask"].bool()
    (plain_logps, plain_entropies, plain_grads), (logps, entropies, grads) = results
    assert logps.dtype == torch.float64
    assert_equal_up_to_rounding(
        [logps[mask], entropies[mask], *grads],
        [plain_logps[mask], plain_entropies[mask], *plain_grads],
        model=model,
        batch=batch,
    )
    assert max(g.abs().max() for g in grads) > 0
    assert (
        loss.collate(prompts[1:] + prompts[:1], completions, 0, "cpu", group_size=4)["group_size"]
        == 1
    )


@pytest.mark.parametrize("group_size", [1, 4])
def test_the_fast_path_and_the_definition_give_the_same_logps_and_gradients(
    tiny, group_size, float64_qwen2
):
    """loss.completion_logps has two paths, one switch (--no-fast-logprobs): the chunked kernel
    (with a group's shared prompt run once) and token_logps_and_entropies on the plain logits.
    In float64, held to float64's rounding bound."""
    model = perturbed_lora(tiny)
    prompts = [[11, 12, 13, 14, 15]] * 4 + [[21, 22, 23]] * 4
    completions = [[30 + i, 40 + i, 50 + i][: 1 + i % 3] for i in range(8)]
    batch = loss.collate(prompts, completions, 0, "cpu", group_size=group_size)
    assert batch["group_size"] == group_size
    results = [logps_entropies_and_gradients(model, batch, fast=fast) for fast in (True, False)]
    mask = batch["completion_mask"].bool()
    (fast_logps, fast_entropies, fast_grads), (logps, entropies, grads) = results
    assert fast_logps.dtype == logps.dtype == torch.float64
    assert_equal_up_to_rounding(
        [fast_logps[mask], fast_entropies[mask], *fast_grads],
        [logps[mask], entropies[mask], *grads],
        model=model,
        batch=batch,
    )
    assert max(g.abs().max() for g in grads) > 0


def test_the_logged_k3_is_the_penalty_k3():
    case = hand_case()
    _, metrics = run_loss(case, beta=0.1, kl="reverse")
    mask = case["completion_mask"]
    k3 = loss.anchor_penalty(case["logps"], case["ref_logps"], "reverse", "k3")
    assert metrics["kl/ref_k3"] == pytest.approx(((k3 * mask).sum() / mask.sum()).item())


@pytest.mark.cuda_kernels  # on a GPU node CUDA's fused SDPA kernels, else the CPU's
@pytest.mark.parametrize("group_size", [1, 2], ids=["one-pass", "shared-prompt-cache"])
def test_a_left_pads_attention_row_attends_somewhere_and_nothing_else_moves(
    group_size, tiny_model_dir, monkeypatch
):
    """Prompts of different lengths in one micro-batch are left-padded (``collate``): a pad's
    query row has no key to attend to, and CUDA's fused SDPA kernels give NaN for such a row,
    which the backward pass spreads to every gradient (docs/gpu.md). The trainer's and the hf
    engine's loaders install a mask (``attend_somewhere_under_sdpa``) under which every row SDPA
    gets attends to some key and every gradient is finite: through checkpointed layers in one
    pass, and through a shared prompt's cache; on the CPU the log-probs and gradients are bit for
    bit those of transformers' own mask."""
    from transformers import masking_utils

    from extras import hf_engine

    mapping = masking_utils.AttentionMaskInterface._global_mapping  # restored after the test
    monkeypatch.setitem(mapping, "sdpa", masking_utils.sdpa_mask)
    config = sage.Config(model=tiny_model_dir, gradient_checkpointing=group_size == 1)
    policy = sage.load_policy(config, tiny_model_dir, pad_id=0).policy  # the trainer's, LoRA
    attending = mapping["sdpa"]
    assert attending is not masking_utils.sdpa_mask  # the trainer's loader installed it
    mapping["sdpa"] = masking_utils.sdpa_mask
    hf_engine.HFEngine(tiny_model_dir, max_model_len=1024, model=policy)
    assert mapping["sdpa"] is not masking_utils.sdpa_mask  # and the hf backend's
    prompts, completions = [[5, 6, 7, 8, 9], [7, 8]], [[10, 11], [12]]
    if group_size == 2:  # two completions of each prompt: the prompt runs once, then its cache
        prompts, completions = [p for p in prompts for _ in "ab"], [*completions, *completions]
    device = policy.device
    batch = loss.collate(prompts, completions, pad_id=0, device=device, group_size=group_size)
    assert batch["group_size"] == group_size
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masks = []

    def recording_sdpa(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    def logps_and_gradients(mask_function):
        mapping["sdpa"] = mask_function
        masks.clear()
        policy.zero_grad(set_to_none=True)
        logps, _ = loss.completion_logps(policy, batch, temperature=1.0, min_p=0.0)
        (logps * batch["completion_mask"]).sum().backward()
        trained = [p for p in policy.parameters() if p.requires_grad]
        return logps.detach(), [p.grad.clone() for p in trained]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    own_logps, own_gradients = logps_and_gradients(masking_utils.sdpa_mask)
    assert any((~mask.any(dim=-1)).any() for mask in masks)  # a pad's row with no key
    logps, gradients = logps_and_gradients(attending)
    assert masks and all(mask.any(dim=-1).all() for mask in masks)  # every row attends
    assert torch.isfinite(logps).all() and all(torch.isfinite(g).all() for g in gradients)
    assert any(g.abs().sum() > 0 for g in gradients)
    if device.type == "cpu":
        assert torch.equal(logps, own_logps)
        assert all(torch.equal(g, own) for g, own in zip(gradients, own_gradients))
