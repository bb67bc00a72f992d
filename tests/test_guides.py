"""Claims about guides.py: the guides of Eqs. 9-11 and the cosine schedule, checked by hand.

Every guide returns log q_t that is 0 on padding, within [log q_min, log q_max], and never
carries a gradient; the schedule is a pure function of the optimizer step, so micro-batches
cannot advance it (the authors' code advanced it once per micro-batch).
"""

import math

import pytest
import torch

import guides
from guides import GuideConfig, compute_log_q, cosine_schedule

# One completion of 5 tokens and one of 3 (then 2 padding positions).
MASK = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
PADDING = ~MASK.bool()


def log_q_of(config, logps=None, entropies=None, step=0, total_steps=80, seed=0):
    logps = torch.zeros_like(MASK) if logps is None else logps
    entropies = torch.zeros_like(MASK) if entropies is None else entropies
    generator = torch.Generator().manual_seed(seed)
    return compute_log_q(config, logps, entropies, MASK, step, total_steps, generator)


# --------------------------------------------------------------------------------------------
# The cosine schedule
# --------------------------------------------------------------------------------------------


def test_cosine_schedule_by_hand():
    # 80 steps, 8 cycles of 10 steps, from 0.3 down towards 0.1, upper bound x 0.9 per cycle.
    def at(step):
        return cosine_schedule(step, 80, 0.3, 0.1)

    assert at(0) == pytest.approx(0.3)  # start of cycle 0: the upper bound
    assert at(5) == pytest.approx(0.2)  # middle: (0.3 + 0.1) / 2
    assert at(9) == pytest.approx(0.1 + 0.2 * 0.5 * (1 + math.cos(0.9 * math.pi)))
    assert at(10) == pytest.approx(0.27)  # new cycle: 0.3 * 0.9
    assert at(15) == pytest.approx(0.1 + 0.17 * 0.5)
    assert at(20) == pytest.approx(0.3 * 0.81)
    assert at(70) == pytest.approx(0.3 * 0.9**7)  # the last cycle
    last = 0.1 + (0.3 * 0.9**7 - 0.1) * 0.5 * (1 + math.cos(0.9 * math.pi))
    assert at(79) == pytest.approx(last)  # the last step
    assert at(500) == pytest.approx(last) and at(-3) == pytest.approx(0.3)  # clamped to the run
    # Cycles of 12.5 steps (100 steps, 8 cycles): step 12 ends cycle 0, step 13 starts cycle 1.
    assert cosine_schedule(12, 100, 1.0, 0.0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 12 / 12.5))
    )
    assert cosine_schedule(13, 100, 1.0, 0.0) == pytest.approx(
        0.9 * 0.5 * (1 + math.cos(math.pi * 0.5 / 12.5))
    )
    # Other cycle counts and decays.
    assert cosine_schedule(50, 100, 1.0, 0.0, num_cycles=2, cycle_decay=0.5) == pytest.approx(0.5)
    assert cosine_schedule(25, 100, 1.0, 0.0, num_cycles=1) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4))
    )


def test_a_cycle_that_starts_on_a_step_starts_at_its_upper_bound():
    # Where cycle k starts exactly on a step (k * total / N whole), that step has the cycle's upper
    # bound, upper * decay**k, also where total / N has no exact float (100 / 6, 10 / 6).
    for total in (10, 50, 100, 200, 1000):
        for cycles in range(1, 13):
            for k in range(cycles):
                if k * total % cycles == 0:
                    value = cosine_schedule(k * total // cycles, total, 0.3, 0.1, cycles)
                    assert value == pytest.approx(0.3 * 0.9**k), (total, cycles, k)


def test_cosine_schedule_rejects_an_empty_run():
    with pytest.raises(ValueError, match="total_steps"):
        cosine_schedule(0, 0, 0.3, 0.1)


def test_the_schedule_flags_set_the_bounds_and_can_hold_a_guide_constant():
    """--token-alpha UPPER LOWER (a pair, as the field is) and --guide-cycles / --guide-cycle-decay
    shape the schedule; equal bounds with decay 1 hold alpha and sigma at one value every step."""
    import sage

    flags = ["--model", "m", "--guide", "token", "--token-alpha", "0.3", "0.3"]
    held = sage.parse_config([*flags, "--token-sigma", "0.25", "0.25", "--guide-cycle-decay", "1"])
    assert held.guide.token_alpha == (0.3, 0.3) and held.guide.cycle_decay == 1.0
    values = {
        tuple(guides.scheduled_values(held.guide, step, 1200).values()) for step in range(1200)
    }
    assert values == {(0.3, 0.25)}
    decaying = sage.parse_config(flags).guide  # decay 0.9: the upper bound falls each cycle
    assert guides.scheduled_values(decaying, 150, 1200)["alpha"] == pytest.approx(0.27)
    one_cycle = sage.parse_config(["--model", "m", "--guide", "token", "--guide-cycles", "1"])
    assert guides.scheduled_values(one_cycle.guide, 150, 1200)["alpha"] == pytest.approx(
        0.1 + 0.2 * 0.5 * (1 + math.cos(math.pi * 150 / 1200))
    )


def test_scheduled_values_of_each_guide():
    assert guides.scheduled_values(GuideConfig("random"), 0, 80) == pytest.approx(
        {"eps": 0.1, "sigma": 0.15}
    )
    assert guides.scheduled_values(GuideConfig("token"), 5, 80) == pytest.approx(
        {"alpha": 0.2, "sigma": 0.175}
    )
    assert guides.scheduled_values(GuideConfig("branch"), 5, 80) == {}
    assert guides.scheduled_values(GuideConfig("none"), 5, 80) == {}


def test_schedule_is_a_pure_function_of_the_optimizer_step():
    """Many calls at one step (micro-batches) give the same guide; only the step moves it."""
    config = GuideConfig("token", token_alpha=(0.3, 0.1), token_sigma=(0.0, 0.0))  # deterministic
    logps = -torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0], [0.5, 2.5, 1.5, 0.0, 0.0]])
    first = log_q_of(config, logps=logps, step=3)
    for _ in range(20):
        assert torch.equal(log_q_of(config, logps=logps, step=3), first)
    # It is the step's scheduled alpha, not one advanced by the calls above.
    w = guides.normalize_per_completion(-logps, MASK)
    alpha_at_3 = cosine_schedule(3, 80, 0.3, 0.1)
    torch.testing.assert_close(first, torch.log1p(alpha_at_3 * w) * MASK)
    assert not torch.equal(log_q_of(config, logps=logps, step=13), first)
    # The same holds for the random guide's eps and sigma, given the same generator seed.
    random_config = GuideConfig("random", random_eps=(0.5, 0.1))
    draws = [log_q_of(random_config, step=7, seed=11) for _ in range(5)]
    assert all(torch.equal(d, draws[0]) for d in draws)


# --------------------------------------------------------------------------------------------
# Branch (Eq. 11)
# --------------------------------------------------------------------------------------------


def test_branch_guide_by_hand():
    # q = 1 + 0.3 * max(0, H - 1.2), clamped to [0.6, 1.4]; padding entropies are ignored.
    entropies = torch.tensor([[0.5, 1.2, 2.2, 2.5, 5.0], [1.3, 0.0, 1.2, 9.0, 9.0]])
    expected_q = torch.tensor([[1.0, 1.0, 1.3, 1.39, 1.4], [1.03, 1.0, 1.0, 1.0, 1.0]])
    log_q = log_q_of(GuideConfig("branch"), entropies=entropies)
    torch.testing.assert_close(log_q, expected_q.log())
    assert log_q.dtype == torch.float32
    # Other tau / ratio (the App. D grid) move the threshold and the slope.
    log_q = log_q_of(GuideConfig("branch", tau=0.8, ratio=0.5), entropies=entropies)
    assert log_q[0, :3].exp().tolist() == pytest.approx([1.0, 1.2, 1.4])


# --------------------------------------------------------------------------------------------
# Random (Eq. 9)
# --------------------------------------------------------------------------------------------


def random_config(eps, sigma):
    return GuideConfig("random", random_eps=(eps, eps), random_sigma=(sigma, sigma))


def test_random_guide_eps_one_perturbs_every_token_eps_zero_none():
    big = torch.ones(64, 128)
    generator = torch.Generator().manual_seed(0)
    # eps = 1: every completion token perturbed, with q - 1 = sigma * xi, xi ~ N(0, 1).
    sigma = 0.01  # small enough that the clamp never bites (|xi| < 40)
    log_q = compute_log_q(random_config(1.0, sigma), big, big, big, 0, 10, generator)
    xi = (log_q.exp() - 1) / sigma
    assert (log_q != 0).float().mean().item() == 1.0
    assert abs(xi.mean().item()) < 0.05 and abs(xi.std().item() - 1) < 0.05  # 8192 draws
    # eps = 0.25: about a quarter of the tokens (8192 coins: std of the fraction 0.005).
    log_q = compute_log_q(random_config(0.25, 0.1), big, big, big, 0, 10, generator)
    assert abs((log_q != 0).float().mean().item() - 0.25) < 0.025
    # eps = 0: q = 1 everywhere.
    log_q = compute_log_q(random_config(0.0, 0.1), big, big, big, 0, 10, generator)
    assert torch.equal(log_q, torch.zeros_like(log_q))


def test_random_guide_is_reproducible_from_the_generator_seed():
    config = random_config(0.5, 0.15)
    same = [log_q_of(config, seed=3), log_q_of(config, seed=3)]
    assert torch.equal(same[0], same[1])
    assert not torch.equal(same[0], log_q_of(config, seed=4))


# --------------------------------------------------------------------------------------------
# Token (Eq. 10) and its normalizations
# --------------------------------------------------------------------------------------------

# Surprisals of a 5-token completion, and a 3-token one followed by padding holding garbage.
SURPRISAL = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0], [2.0, 0.5, 1.0, 0.0, 0.0]])


def with_padding(values, fill):
    return values.masked_fill(PADDING, fill)


def test_percentile_normalization_by_hand():
    # Row 1: 5th percentile (linear) at 0.05 * 4 = 0.2 -> 0.2; 95th at 3.8 -> 3 + 0.8 * 6 = 7.8;
    # clip to [0.2, 7.8], then min-max: (x - 0.2) / 7.6.
    # Row 2 (valid 2, 0.5, 1): sorted 0.5, 1, 2; 5th at 0.1 -> 0.55; 95th at 1.9 -> 1.9.
    expected = torch.tensor(
        [[0.0, 0.8 / 7.6, 1.8 / 7.6, 2.8 / 7.6, 1.0], [1.0, 0.0, 0.45 / 1.35, 0.0, 0.0]]
    )
    for fill in (0.0, 1e6, float("inf"), float("nan")):
        w = guides.normalize_per_completion(with_padding(SURPRISAL, fill), MASK, "percentile")
        torch.testing.assert_close(w, expected, msg=f"padding {fill}")


def test_rank_normalization_by_hand():
    expected = torch.tensor([[0.0, 0.25, 0.5, 0.75, 1.0], [1.0, 0.0, 0.5, 0.0, 0.0]])
    for fill in (0.0, -1e6, float("inf"), float("nan")):
        w = guides.normalize_per_completion(with_padding(SURPRISAL, fill), MASK, "rank")
        torch.testing.assert_close(w, expected, msg=f"padding {fill}")
    # Ties (tokens with log pi = 0 are common) share their mean rank: three 0s hold ranks 0-2 -> 1.
    ties = torch.tensor([[0.0, 7.0, 0.0, 3.0, 0.0], [1.0, 1.0, 2.0, 0.0, 0.0]])
    expected = torch.tensor([[0.25, 1.0, 0.25, 0.75, 0.25], [0.25, 0.25, 1.0, 0.0, 0.0]])
    torch.testing.assert_close(guides.normalize_per_completion(ties, MASK, "rank"), expected)


def test_sigmoid_normalization_by_hand():
    # Row 1: mean 3, population variance (9 + 4 + 1 + 0 + 36) / 5 = 10.
    # Row 2: mean 7/6, population variance ((5/6)^2 + (2/3)^2 + (1/6)^2) / 3 = 7/18.
    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    row1 = [sigmoid((x - 3) / math.sqrt(10)) for x in (0.0, 1.0, 2.0, 3.0, 9.0)]
    row2 = [sigmoid((x - 7 / 6) / math.sqrt(7 / 18)) for x in (2.0, 0.5, 1.0)] + [0.0, 0.0]
    expected = torch.tensor([row1, row2])
    for fill in (0.0, 1e6, float("inf"), float("nan")):
        w = guides.normalize_per_completion(with_padding(SURPRISAL, fill), MASK, "sigmoid")
        torch.testing.assert_close(w, expected, msg=f"padding {fill}")


def test_constant_rows_and_single_tokens():
    values = torch.tensor([[2.0, 2.0, 2.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    assert guides.normalize_per_completion(values, mask, "percentile").tolist() == [
        [0.0] * 3,
        [0.0] * 3,
    ]
    assert guides.normalize_per_completion(values, mask, "rank").tolist() == [
        [0.5] * 3,
        [0.5, 0, 0],
    ]
    assert guides.normalize_per_completion(values, mask, "sigmoid").tolist() == [
        [0.5] * 3,
        [0.5, 0, 0],
    ]
    # equal values whose float32 mean is not exact (7 x 7.3): still 0.5, not rounding / 1e-6
    for method, expected in (("percentile", 0.0), ("rank", 0.5), ("sigmoid", 0.5)):
        w = guides.normalize_per_completion(torch.full((1, 7), 7.3), torch.ones(1, 7), method)
        assert w.tolist() == [[expected] * 7], method


@pytest.mark.parametrize("normalization", guides.NORMALIZATIONS)
def test_token_guide_is_one_plus_alpha_w_without_noise(normalization):
    logps = -with_padding(SURPRISAL, 3.0)
    config = GuideConfig(
        "token", token_alpha=(0.3, 0.1), token_sigma=(0.0, 0.0), token_normalization=normalization
    )
    w = guides.normalize_per_completion(SURPRISAL, MASK, normalization)
    assert ((w >= 0) & (w <= 1)).all()
    log_q = log_q_of(config, logps=logps, step=0)  # alpha = 0.3 at step 0
    torch.testing.assert_close(log_q, torch.log1p(0.3 * w) * MASK)


def test_token_guide_noise_is_sigma_w_xi():
    logps = -torch.rand(64, 128, generator=torch.Generator().manual_seed(0)) * 5
    mask = torch.ones_like(logps)
    config = GuideConfig(
        "token", token_alpha=(0.0, 0.0), token_sigma=(0.05, 0.05), token_normalization="rank"
    )
    log_q = compute_log_q(
        config, logps, torch.zeros_like(logps), mask, 0, 10, torch.Generator().manual_seed(1)
    )
    w = guides.normalize_per_completion(-logps, mask, "rank")
    xi = ((log_q.exp() - 1) / (0.05 * w))[w > 0.1]
    assert abs(xi.mean().item()) < 0.05 and abs(xi.std().item() - 1) < 0.05


# --------------------------------------------------------------------------------------------
# Properties shared by every guide
# --------------------------------------------------------------------------------------------

EXTREME = {
    "none": GuideConfig("none"),
    "random": GuideConfig("random", random_eps=(1.0, 1.0), random_sigma=(2.0, 2.0)),
    "token": GuideConfig("token", token_alpha=(3.0, 3.0), token_sigma=(3.0, 3.0)),
    "branch": GuideConfig("branch", ratio=10.0),
}


@pytest.mark.parametrize("name", guides.GUIDES)
def test_every_guide_is_clamped_zero_on_padding_and_without_gradient(name):
    generator = torch.Generator().manual_seed(0)
    logps = (-5 * torch.rand(8, 40, generator=generator)).requires_grad_(True)
    entropies = (4 * torch.rand(8, 40, generator=generator)).requires_grad_(True)
    mask = (torch.arange(40) < torch.randint(1, 41, (8, 1), generator=generator)).float()
    log_q = compute_log_q(EXTREME[name], logps, entropies, mask, 0, 10, generator)

    assert log_q.shape == mask.shape and log_q.dtype == torch.float32
    assert not log_q.requires_grad and log_q.grad_fn is None  # even from inputs that require grad
    assert torch.equal(log_q[mask == 0], torch.zeros_like(log_q[mask == 0]))
    q = log_q.exp()
    assert (q >= 0.6 - 1e-6).all() and (q <= 1.4 + 1e-6).all()
    if name != "none":  # these settings push q past both ends (branch: past the top only)
        assert q.max().item() == pytest.approx(1.4)
        if name != "branch":
            assert q.min().item() == pytest.approx(0.6)


def test_custom_clamp_is_respected():
    config = GuideConfig("branch", ratio=10.0, q_min=0.9, q_max=1.1)
    log_q = log_q_of(config, entropies=torch.full_like(MASK, 5.0))
    assert log_q[MASK.bool()].exp().tolist() == pytest.approx([1.1] * 8)


def test_none_guide_is_zero():
    assert torch.equal(log_q_of(GuideConfig("none")), torch.zeros_like(MASK))


def test_defaults_are_the_papers():
    config = GuideConfig()
    assert config.name == "branch"  # the paper's main variant (Eq. 11)
    assert (config.q_min, config.q_max, config.tau, config.ratio) == (0.6, 1.4, 1.2, 0.3)
    assert (config.random_eps, config.random_sigma) == ((0.1, 0.0), (0.15, 0.05))
    assert (config.token_alpha, config.token_sigma) == ((0.3, 0.1), (0.25, 0.1))
    assert (config.num_cycles, config.cycle_decay, config.token_normalization) == (
        8,
        0.9,
        "percentile",
    )


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(name="entropy"), "unknown --guide"),
        (dict(name="branch", q_min=1.1), r"--q-min 1.1: must be a finite number in \(0, 1\]"),
        (dict(name="branch", q_max=0.9), "--q-max 0.9: must be a finite number >= 1"),
        (dict(name="branch", q_min=0.0), r"--q-min 0.0: must be a finite number in \(0, 1\]"),
        (dict(name="token", token_normalization="zscore"), "normalization"),
        (dict(name="random", num_cycles=0), "--guide-cycles 0: must be a finite number >= 1"),
        (dict(name="token", token_alpha=(0.3, -0.1)), "--token-alpha 0.3 -0.1: each must be"),
        (dict(name="random", random_eps=(1.5, 0.0)), r"--random-eps 1.5 0.0: each .* in \[0, 1\]"),
    ],
)
def test_bad_config_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GuideConfig(**kwargs)


def test_mismatched_shapes_raise():
    with pytest.raises(AssertionError, match="not one"):
        compute_log_q(GuideConfig("branch"), torch.zeros(2, 5), torch.zeros(2, 4), MASK, 0, 10)
    with pytest.raises(ValueError, match="unknown normalization"):
        guides.normalize_per_completion(SURPRISAL, MASK, "zscore")
