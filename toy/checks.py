"""The checks in five sections (a-e, see toy/__init__.py); each row proves one claim, exactly.

A check function returns ``Result`` rows. A row is one of two kinds:

* an equality (relation "<="): ``max_abs_error`` is the largest absolute difference between two
  exact computations (e.g. a numerical optimum and a closed form); it passes when it is at most
  ``tolerance``, a bound set by float64 arithmetic or by loss.py's float32 rounding;
* a separation (relation ">"): ``max_abs_error`` holds a *gap* (a distance, or how far an
  inequality holds); it passes when the gap exceeds ``tolerance``, a margin far above rounding.

``CHECKS`` is the registry (``python -m toy`` runs it; tests/test_toy.py runs each entry).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import guides
import loss
from toy import exact, problems, table
from toy.exact import DTYPE, maximize
from toy.fixed_points import (
    advantage_reward_scale,
    find_fixed_point,
    group_gradient,
    on_policy_gradient,
    per_position_solution,
)

BETA = 0.5  # KL coefficient of the toy problems (the paper's 0.05 only in the App. C example)
FIXED_POINT_TOLERANCE = (
    1e-6  # find_fixed_point stops near 1e-9 on the small problems; GRPO advantages are float32
)
SEPARATION_MARGIN = 1e-3  # a "misses" claim needs a gap 1000x above FIXED_POINT_TOLERANCE
BRANCH_TAU = guides.GuideConfig(name="branch").tau


@dataclass(frozen=True)
class Result:
    """One row of the table: a named claim, what was measured, and whether it holds."""

    name: str
    section: str  # a-e, the sections of toy/__init__.py
    quantity: str  # what max_abs_error measures, in words
    max_abs_error: float  # an error ("<=") or a gap (">")
    tolerance: float
    relation: str = "<="  # "<=": error <= tolerance; ">": gap > tolerance

    @property
    def passed(self) -> bool:
        if not math.isfinite(self.max_abs_error):
            return False
        if self.relation == "<=":
            return self.max_abs_error <= self.tolerance
        return self.max_abs_error > self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def as_float64(x) -> torch.Tensor:
    return x.to(DTYPE) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=DTYPE)


def equal(name, section, quantity, a, b, tolerance) -> Result:
    """An equality row: max |a - b|."""
    error = (as_float64(a) - as_float64(b)).abs().max().item()
    return Result(name, section, quantity, error, tolerance, "<=")


def exceeds(name, section, quantity, gap, margin=0.0) -> Result:
    """A separation row: the gap must be > margin."""
    return Result(name, section, quantity, float(gap), margin, ">")


CHECKS: list[Callable[[], list[Result]]] = []


def check(function: Callable[[], list[Result]]) -> Callable[[], list[Result]]:
    """Register a check (its rows appear in the table in registration order)."""
    CHECKS.append(function)
    return function


def run_checks(checks=None) -> list[Result]:
    return [row for function in (CHECKS if checks is None else checks) for row in function()]


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def sequence_probs(problem: problems.Problem, theta: torch.Tensor) -> torch.Tensor:
    return problem.tree.sequence_logps(theta).exp()


def maximize_over_policies(problem: problems.Problem, objective) -> torch.Tensor:
    """argmax over the tree's policies of objective(pi) -> the optimal sequence distribution [B]."""
    theta, _ = maximize(lambda th: objective(sequence_probs(problem, th)), problem.ref_theta)
    return sequence_probs(problem, theta)


def estimator_fixed_point(
    problem: problems.Problem, beta: float = BETA, **loss_options
) -> torch.Tensor:
    """Where loss.policy_loss's exact expected gradient vanishes, reached from pi_ref -> theta
    [P]."""

    def gradient(theta):
        return on_policy_gradient(
            problem.tree,
            theta,
            problem.rewards,
            problem.ref_logps,
            problem.log_q,
            beta=beta,
            **loss_options,
        )

    theta, _ = find_fixed_point(gradient, problem.ref_theta)
    return theta


# --------------------------------------------------------------------------------------------
# a. Eqs. 2, 4 (and 8): closed forms = numerical optima
# --------------------------------------------------------------------------------------------


@check
def check_eq2_eq4_simplex() -> list[Result]:
    """Eqs. 2 and 4 on the simplex: the maximizers of Eq. 1 and of Eq. 3 with Eq. 5's pseudo-KL.

    pi_ref over 5 outcomes, binary r, a q that differs per outcome; the maximum is found by LBFGS
    and Newton on the logits, independently of the closed forms.
    """
    p = problems.bandit()
    optimum_rl = maximize_over_policies(
        p, lambda pi: exact.reverse_kl_objective(pi, p.rewards, p.ref, BETA)
    )
    optimum_sage = maximize_over_policies(
        p, lambda pi: exact.sage_objective(pi, p.rewards, p.anchor, BETA)
    )
    return [
        equal(
            "eq2_reverse_kl_optimum_simplex",
            "a",
            "argmax of Eq. 1 vs Eq. 2 (5 outcomes)",
            optimum_rl,
            exact.eq2_reverse_kl_solution(p.ref, p.rewards, BETA),
            1e-9,
        ),
        equal(
            "eq4_sage_optimum_simplex",
            "a",
            "argmax of Eq. 3 (pseudo-KL, Eq. 5) vs Eq. 4",
            optimum_sage,
            exact.eq4_sage_solution(p.ref, p.q, p.rewards, BETA),
            1e-9,
        ),
    ]


@check
def check_eq4_eq8_token_tree() -> list[Result]:
    """Eq. 4 over a token tree with a token-level q (Eq. 7), and Eq. 8's reading of it.

    Two positions, three tokens each (9 completions); q_t depends on the prefix and the token.
    The policy is autoregressive (per-node logits), as a language model is. Eq. 8 rewrites the
    pseudo-KL as KL(pi || pi_ref) - E[sum_t log q_t] + const: maximizing reverse-KL RL plus the
    guide bonus beta E[sum_t log q_t] must reach the same Eq. 4.
    """
    p = problems.two_token_tree("token")
    eq4 = exact.eq4_sage_solution(p.ref, p.q, p.rewards, BETA)
    optimum_sage = maximize_over_policies(
        p, lambda pi: exact.sage_objective(pi, p.rewards, p.anchor, BETA)
    )
    log_q_sequence = p.log_q.sum(dim=-1)  # [B] sum_t log q_t

    def reverse_kl_plus_guide_bonus(pi):
        return (
            exact.reverse_kl_objective(pi, p.rewards, p.ref, BETA)
            + BETA * (pi * log_q_sequence).sum()
        )

    optimum_bonus = maximize_over_policies(p, reverse_kl_plus_guide_bonus)
    return [
        equal(
            "eq4_sage_optimum_token_tree",
            "a",
            "argmax of Eq. 3 over a 2-token tree, token-level q, vs Eq. 4",
            optimum_sage,
            eq4,
            1e-9,
        ),
        equal(
            "eq8_guide_bonus_optimum_token_tree",
            "a",
            "argmax of E[r] - beta KL(pi||pi_ref) + beta E[sum_t log q_t] (Eq. 8) vs Eq. 4",
            optimum_bonus,
            eq4,
            1e-9,
        ),
    ]


# --------------------------------------------------------------------------------------------
# b. Eqs. 21, 27 and the comparison with forward KL (Eqs. 28-31)
# --------------------------------------------------------------------------------------------


@check
def check_eq21_eq27_simplex() -> list[Result]:
    """Eq. 21 (entropy bonus, App. A.2) and Eq. 27 (forward KL, App. A.4): closed forms = optima."""
    p = problems.bandit()
    alpha = 0.3
    optimum_entropy = maximize_over_policies(
        p, lambda pi: exact.entropy_bonus_objective(pi, p.rewards, p.ref, BETA, alpha)
    )
    optimum_forward = maximize_over_policies(
        p, lambda pi: exact.forward_kl_objective(pi, p.rewards, p.ref, BETA)
    )
    return [
        equal(
            "eq21_entropy_bonus_optimum_simplex",
            "b",
            "argmax of Eq. 19 (alpha = 0.3) vs Eq. 21",
            optimum_entropy,
            exact.eq21_entropy_bonus_solution(p.ref, p.rewards, BETA, alpha),
            1e-9,
        ),
        equal(
            "eq27_forward_kl_optimum_simplex",
            "b",
            "argmax of E[r] - beta KL(pi_ref||pi) vs Eq. 27",
            optimum_forward,
            exact.eq27_forward_kl_solution(p.ref, p.rewards, BETA),
            1e-9,
        ),
    ]


def forward_kl_reweighting(ref, q, rewards, beta):
    """Eq. 29: w(y) = q(y) exp(r/beta) (lambda - r) / (beta Z_q), so that pi_q* = pi_F w
    (Eq. 28)."""
    lam = exact.forward_kl_multiplier(ref, rewards, beta)
    z_q = (ref * q * torch.exp(rewards / beta)).sum()
    return q * torch.exp(rewards / beta) * (lam - rewards) / (beta * z_q)


@check
def check_eq28_eq31_sage_vs_forward_kl() -> list[Result]:
    """Eqs. 28-31: SAGE is forward KL reweighted by w; under the separation condition (30) it puts
    strictly less mass off-target (31). Without (30) the conclusion can fail (a counterexample).
    """
    ref = problems.tensor([0.05, 0.10, 0.30, 0.25, 0.20, 0.10])
    rewards = problems.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # C = the first two
    correct = rewards > 0
    q = problems.tensor([1.4, 1.3, 0.7, 0.8, 0.9, 0.75])  # prefers C
    pi_forward = exact.eq27_forward_kl_solution(ref, rewards, BETA)
    pi_sage = exact.eq4_sage_solution(ref, q, rewards, BETA)
    w = forward_kl_reweighting(ref, q, rewards, BETA)
    # Eq. 28 against the forward KL's optimum found by search, not Eq. 27: w's lambda (Eq. 29)
    # would cancel against Eq. 27's own and the row could not fail.
    bandit = problems.Problem(
        problems.TokenTree([(k,) for k in range(6)]), ref.log(), rewards, torch.zeros(6)
    )
    optimum_forward = maximize_over_policies(
        bandit, lambda pi: exact.forward_kl_objective(pi, rewards, ref, BETA)
    )
    separation = min(w[correct].min().item() - 1.0, 1.0 - w[~correct].max().item())
    off_forward, off_sage = pi_forward[~correct].sum().item(), pi_sage[~correct].sum().item()
    # A guide that does not separate: q = 1.2 on C and 1 elsewhere gives w < 1 on C here.
    q_flat = problems.tensor([1.2, 1.2, 1.0, 1.0, 1.0, 1.0])
    w_flat = forward_kl_reweighting(ref, q_flat, rewards, BETA)
    off_sage_flat = exact.eq4_sage_solution(ref, q_flat, rewards, BETA)[~correct].sum().item()
    return [
        equal(
            "eq28_29_sage_is_reweighted_forward_kl",
            "b",
            "Eq. 4 vs pi_F(y) w(y), pi_F the forward KL's optimum by search, w of Eq. 29",
            pi_sage,
            optimum_forward * w,
            1e-9,
        ),
        exceeds(
            "eq30_separation_condition_holds",
            "b",
            f"min(w on C) - 1 and 1 - max(w off C): w = {[round(v, 3) for v in w.tolist()]}",
            separation,
        ),
        exceeds(
            "eq31_sage_less_off_target_mass_than_forward_kl",
            "b",
            f"pi_F(not C) - pi_q*(not C) = {off_forward:.4f} - {off_sage:.4f}",
            off_forward - off_sage,
        ),
        exceeds(
            "eq31_can_fail_without_separation",
            "b",
            f"q = 1.2 on C gives w on C = {w_flat[0].item():.3f} < 1: pi_q*(not C) - pi_F(not C) "
            f"= {off_sage_flat:.4f} - {off_forward:.4f}",
            off_sage_flat - off_forward,
        ),
    ]


# --------------------------------------------------------------------------------------------
# c. Theorem 4.3 with the branch guide (App. C)
# --------------------------------------------------------------------------------------------


def branch_guide_log_q(problem: problems.Problem, config: guides.GuideConfig) -> torch.Tensor:
    """log q_t of every token of the tree from our code: entropies by the trainer's kernel
    (machinery/fast_logprobs.py) at every node under pi_ref (the guide of the first update, when
    pi = pi_ref), then guides.compute_log_q. [B, T] float64 (in float32, as in training)."""
    from machinery.fast_logprobs import chunked_token_logps_and_entropies

    tree = problem.tree
    node_entropies = []
    for offset, children in zip(tree.offsets, tree.children):
        # [1, n], in float32 as the trainer's logits (float64 would stay float64)
        logits = problem.ref_theta[offset : offset + len(children)][None].float()
        _, entropy = chunked_token_logps_and_entropies(logits, torch.zeros(1, dtype=torch.long))
        node_entropies.append(entropy[0])
    node_of_token = tree.node_of_param[tree.param_index]  # [B, T]
    entropies = torch.stack(node_entropies)[node_of_token] * tree.completion_mask.float()  # [B, T]
    logps = tree.token_logps(problem.ref_theta).float()
    log_q = guides.compute_log_q(
        config, logps, entropies, tree.completion_mask.float(), step=0, total_steps=1
    )
    return log_q.to(DTYPE)


@check
def check_thm43_appendix_c_branch_guide() -> list[Result]:
    """Theorem 4.3 (and Eqs. 23-24) on an App. C example built with the branch guide (Eq. 11).

    The guide is our code with its defaults (tau = 1.2, ratio = 0.3, clamp [0.6, 1.4]), fed the
    entropies (Eq. 12) of pi_ref. beta = 0.05 (the paper's), delta = 0.01. Then, exactly:
    y2 is outside supp_delta(pi_RL) (Eq. 2), the condition q(y2) / E_pi_RL[q] >= delta / pi_RL(y2)
    holds, pi_q* (Eq. 4) equals pi_RL q / E_pi_RL[q] (Eqs. 23-24), and y2 is inside
    supp_delta(pi_q*).
    """
    beta, delta = 0.05, 0.01
    p = problems.appendix_c_tree()
    config = guides.GuideConfig(name="branch")
    log_q = branch_guide_log_q(p, config)  # [B, T]
    # The same guide by hand from float64 entropies: q(s) = clamp(1 + ratio max(0, H(s) - tau)).
    node_q = 1.0 + config.ratio * (p.tree.node_entropies(p.ref_theta) - config.tau).clamp_min(0.0)
    node_q = node_q.clamp(config.q_min, config.q_max)
    expected_log_q = p.tree.per_token(node_q.log()[p.tree.node_of_param])

    q = log_q.sum(dim=-1).exp()  # [B] q(y), Eq. 7
    pi_rl = exact.eq2_reverse_kl_solution(p.ref, p.rewards, beta)
    pi_sage = exact.eq4_sage_solution(p.ref, q, p.rewards, beta)
    expected_q_rl = (pi_rl * q).sum()
    y2 = p.tree.completions.index((1, 0))
    entropy = p.tree.node_entropies(p.ref_theta)[p.tree.node_id[(1,)]].item()
    return [
        equal(
            "appC_branch_guide_amplifies_only_the_branching_node",
            "c",
            "log q_t of guides.compute_log_q vs log(1 + 0.3 max(0, H_t - 1.2)); "
            f"H(branch) = {entropy:.3f}, "
            f"q(y2) = {q[y2].item():.4f}, q(y1) = {q[0].item():.4f}",
            log_q,
            expected_log_q,
            1e-6,
        ),
        exceeds(
            "thm4.3_y2_outside_supp_delta_pi_rl",
            "c",
            f"delta - pi_RL(y2) = {delta} - {pi_rl[y2].item():.5f}",
            delta - pi_rl[y2].item(),
        ),
        exceeds(
            "thm4.3_condition_holds_for_branch_guide",
            "c",
            f"q(y2)/E_RL[q] - delta/pi_RL(y2) = {(q[y2] / expected_q_rl).item():.4f} - "
            f"{delta / pi_rl[y2].item():.4f}",
            (q[y2] / expected_q_rl - delta / pi_rl[y2]).item(),
        ),
        equal(
            "eq23_24_sage_is_rl_reweighted_by_q",
            "c",
            "Eq. 4 vs pi_RL(y) q(y) / E_pi_RL[q]",
            pi_sage,
            pi_rl * q / expected_q_rl,
            1e-12,
        ),
        exceeds(
            "thm4.3_branch_guide_support_expansion",
            "c",
            f"pi_q*(y2) - delta = {pi_sage[y2].item():.5f} - {delta}",
            pi_sage[y2].item() - delta,
        ),
    ]


# --------------------------------------------------------------------------------------------
# d. Fixed points of loss.py's estimators (exact expected gradients of policy_loss)
# --------------------------------------------------------------------------------------------


@check
def check_thm43_under_the_trained_estimators() -> list[Result]:
    """Theorem 4.3 on the App. C tree under loss.py's own expected gradient (toy/table.py).

    Four claims about the trained estimators, each decided for both readings of "the branch guide":
    q fixed at pi_ref's entropies (the theorem's q, and a trainer's first step) and q recomputed
    from the policy at the point (self-consistent, what a trainer that recomputes q converges to).

    * k1 in the return: its fixed points are Eq. 2 and Eq. 4, so the fixed guide lifts y2 into
      supp_delta as the theorem says; the self-consistent guide does not (below).
    * k2 and ratio_k3: a position-constant q cancels, the guide changes nothing.
    * k3 (the paper's) and the forward baseline: the fixed guide *lowers* pi(y2) (a forward pull
      of strength beta q toward pi_ref at the branching node); the self-consistent one does not.
    * Every per-token penalty puts y2 above delta without any guide (it sees no KL of later
      tokens), so the theorem's premise (y2 outside supp_delta of plain RLVR) fails for them.
    * Recomputed from the policy, the guide acts at no fixed point: the branching node's entropy
      falls below tau there (check_table_solver: whatever q the guide gave it), so q = 1.
    """
    rows = {row.estimator: row for row in table.estimator_table()}
    closed = table.exact_objective_pi_y2()
    pi = {name: row.pi_y2 for name, row in rows.items()}
    per_token = ("k2", "k3", "ratio_k3", "forward")
    margin, delta = SEPARATION_MARGIN, table.DELTA
    k1, k3, fw = pi["k1_return"], pi["k3"], pi["forward"]
    return [
        equal(
            "table_gradient_norms_at_reported_points",
            "d",
            "max |expected gradient|_inf over the table's points",
            max(max(row.gradient.values()) for row in rows.values()),
            0.0,
            1e-8,
        ),
        equal(
            "k1_return_fixed_points_are_eq2_and_eq4",
            "d",
            "pi(y2) of k1 in the return vs Eq. 2 / Eq. 4 (fixed q) / "
            "Eq. 4 (q of its own entropies)",
            [k1[g] for g in table.GUIDES],
            [closed[g] for g in table.GUIDES],
            1e-9,
        ),
        exceeds(
            "k1_return_without_guide_y2_outside_supp_delta",
            "d",
            f"delta - pi(y2) = {delta} - {k1['none']:.5f}",
            delta - k1["none"],
        ),
        exceeds(
            "k1_return_fixed_branch_guide_lifts_y2_into_supp_delta",
            "d",
            f"pi(y2) with the fixed branch guide - delta = {k1['fixed']:.5f} - {delta}",
            k1["fixed"] - delta,
        ),
        exceeds(
            "k1_return_self_consistent_guide_leaves_y2_outside_supp_delta",
            "d",
            f"delta - pi(y2) with q recomputed from the policy = {delta} - {k1['self']:.5f}",
            delta - k1["self"],
        ),
        equal(
            "k2_and_ratio_k3_ignore_the_branch_guide",
            "d",
            "pi(y2) with the branch guide (fixed, self-consistent) vs without, k2 and ratio_k3",
            [pi[e][g] for e in ("k2", "ratio_k3") for g in ("fixed", "self")],
            [pi[e]["none"] for e in ("k2", "ratio_k3") for _ in ("fixed", "self")],
            1e-9,
        ),
        exceeds(
            "k3_fixed_branch_guide_lowers_y2",
            "d",
            f"pi(y2) without - with the fixed branch guide = {k3['none']:.5f} - {k3['fixed']:.5f}",
            k3["none"] - k3["fixed"],
            margin,
        ),
        exceeds(
            "forward_baseline_fixed_branch_guide_lowers_y2",
            "d",
            f"pi(y2) without - with the fixed branch guide = {fw['none']:.5f} - {fw['fixed']:.5f}",
            fw["none"] - fw["fixed"],
            margin,
        ),
        exceeds(
            "per_token_penalties_put_y2_in_supp_delta_without_a_guide",
            "d",
            "min over k2, k3, ratio_k3, forward of pi(y2) - delta, no guide",
            min(pi[name]["none"] for name in per_token) - delta,
        ),
        equal(
            "self_consistent_branch_guide_is_inactive_at_every_fixed_point",
            "d",
            "pi(y2) with q recomputed from the policy vs without a guide, every estimator",
            [pi[name]["self"] for name in rows],
            [pi[name]["none"] for name in rows],
            1e-9,
        ),
    ]


@check
def check_table_solver() -> list[Result]:
    """The table's points are the fixed points a trainer heads to, checked independently.

    (1) loss.py's expected gradient, divided by the probability of reaching each node and taking
    each token there (``table.node_residual``), vanishes at the backward-induction points: every
    node is stationary, not only the well-visited ones. (2) Newton's method on loss.py's expected
    gradient, from a start that is not the answer, finds the same points. (3) Each point attracts
    gradient descent (``table.slowest_rate`` > 0). (4) The self-consistent guide is unique: at
    the fixed point for *any* q in [1, 1.4] at y2's branching node (all Eq. 11 can give), that
    node's entropy is below tau, so Eq. 11 gives q = 1 and only the unguided point is consistent.
    Why |g| alone is not enough: a policy that has all but abandoned the branch (pi(1) ~ 1e-14 at
    the root, the branching node left at pi_ref) has |g| < 1e-8 but is not stationary there.
    """
    problem = problems.appendix_c_tree()
    rows = table.estimator_table()
    residuals, gaps, rates, entropies = [], [], [], []
    for row in rows:
        for guide in table.GUIDES:
            theta = row.theta[guide]
            residuals.append(
                table.node_residual(problem, theta, row.estimator, guide).abs().max().item()
            )
            newton = table.newton_point(problem, row.estimator, guide)
            gaps.append(
                (sequence_probs(problem, newton) - sequence_probs(problem, theta))
                .abs()
                .max()
                .item()
            )
            rates.append(table.slowest_rate(problem, theta, row.estimator, guide))
        entropies.append(table.branch_entropy_over_q(problem, row.estimator).max().item())
    # An abandoned branch: k2's fixed point with the root's token 1 pushed to ~1e-14, node (1,) at
    # pi_ref.
    tree, branch = problem.tree, problem.tree.node_id[(1,)]
    abandoned = next(row for row in rows if row.estimator == "k2").theta["none"].clone()
    abandoned[tree.offsets[0] + 1] -= 30.0
    node = slice(tree.offsets[branch], tree.offsets[branch] + len(tree.children[branch]))
    abandoned[node] = problem.ref_theta[node]
    abandoned_gradient = (
        table.expected_gradient(problem, abandoned, "k2", "none").abs().max().item()
    )
    abandoned_residual = table.node_residual(problem, abandoned, "k2", "none").abs().max().item()
    return [
        equal(
            "table_points_are_stationary_at_every_node",
            "d",
            "max |expected gradient / (rho(s) pi(a|s))| at the table's 15 points",
            max(residuals),
            0.0,
            1e-8,
        ),
        equal(
            "newton_on_policy_loss_finds_the_backward_induction_points",
            "d",
            "max |pi(y)| difference, Newton on loss.py's expected gradient vs backward induction, "
            "15 points",
            max(gaps),
            0.0,
            1e-10,
        ),
        exceeds(
            "table_points_attract_gradient_descent",
            "d",
            "smallest real part of d(residual)/d theta's eigenvalues off the flat directions, "
            "15 points",
            min(rates),
            1e-3,
        ),
        exceeds(
            "self_consistent_branch_guide_is_unique",
            "d",
            "tau - max entropy of the branching node over q in [1, 1.4] = "
            f"{BRANCH_TAU} - {max(entropies):.3f}",
            BRANCH_TAU - max(entropies),
            0.1,
        ),
        equal(
            "abandoned_branch_has_a_tiny_gradient",
            "d",
            "|expected gradient|_inf, k2, pi(1) ~ 1e-14 at the root, y2's node at pi_ref",
            abandoned_gradient,
            0.0,
            1e-8,
        ),
        exceeds(
            "abandoned_branch_is_not_stationary",
            "d",
            "max |expected gradient / (rho pi)| at that policy",
            abandoned_residual,
            0.1,
        ),
    ]


@check
def check_table_under_group_advantages() -> list[Result]:
    """The table's advantage is RLOO's in expectation; a group's own mean or std moves the points.

    (1) With Dr. GRPO's group mean or GRPO's std, loss.py's exact expected gradient (every group
    of G = 4 completions enumerated, ``table.group_residual``) vanishes node by node at the
    table's point for beta / Delta_G(p*) (``table.advantage_point``), for k2, k3 and the forward
    baseline, no guide and the fixed branch guide; (2) it does not vanish at the table's own
    point. ratio_k3 is left out of (1): its gradient is k2's (``check_estimator_gradients``), but
    its k3 value cancels u - 1 ~ 1e13 at the wrong tokens there, a float64 residual of ~1e-5.
    (3) At the paper's G = 8, under both normalizations, the table's orderings still hold: k2 and
    ratio_k3 ignore the fixed branch guide, k3 and the forward baseline are lowered by it, and
    every per-token penalty puts y2 above delta without a guide.
    """
    problem, group_size = problems.appendix_c_tree(), 4
    at_points, at_table = [], []
    for advantage in ("dr_grpo", "grpo"):
        for estimator in ("k2", "k3", "forward"):
            for guide in ("none", "fixed"):
                _, theta = table.advantage_point(problem, estimator, guide, advantage, group_size)
                at_points.append(
                    table.group_residual(problem, theta, estimator, guide, advantage, group_size)
                )
                table_theta = next(
                    r for r in table.estimator_table() if r.estimator == estimator
                ).theta[guide]
                at_table.append(
                    table.group_residual(
                        problem, table_theta, estimator, guide, advantage, group_size
                    )
                )
    pi = {
        (adv, est): {g: pi_y2 for g, (_, pi_y2) in row.items()}
        for adv, rows in table.advantage_table().items()
        for est, row in rows.items()
    }
    return [
        equal(
            "group_advantages_move_the_table_to_beta_over_delta",
            "d",
            "max |group expected gradient / (rho pi)|, Dr. GRPO and GRPO std, G = 4, "
            "at beta / Delta_G(p*)",
            max(r.abs().max().item() for r in at_points),
            0.0,
            1e-8,
        ),
        exceeds(
            "group_advantages_table_points_are_not_stationary",
            "d",
            "min over the same 12 cases of max |group expected gradient / (rho pi)| "
            "at the table's point",
            min(r.abs().max().item() for r in at_table),
            0.01,
        ),
        equal(
            "group_advantages_k2_and_ratio_k3_ignore_the_branch_guide",
            "d",
            "pi(y2) with the fixed branch guide vs without, k2 and ratio_k3, G = 8, mean and std",
            [pi[key]["fixed"] for key in pi if key[1] in ("k2", "ratio_k3")],
            [pi[key]["none"] for key in pi if key[1] in ("k2", "ratio_k3")],
            1e-9,
        ),
        exceeds(
            "group_advantages_k3_and_forward_fixed_branch_guide_lowers_y2",
            "d",
            "min over k3, forward, G = 8 mean and std of pi(y2) without - with the fixed "
            "branch guide",
            min(pi[key]["none"] - pi[key]["fixed"] for key in pi if key[1] in ("k3", "forward")),
            SEPARATION_MARGIN,
        ),
        exceeds(
            "group_advantages_per_token_penalties_put_y2_in_supp_delta_without_a_guide",
            "d",
            "min over the per-token penalties, G = 8 mean and std, of pi(y2) - delta, no guide",
            min(row["none"] for row in pi.values()) - table.DELTA,
        ),
    ]


@check
def check_one_token_fixed_points() -> list[Result]:
    """Single-token completions (App. E.5's estimators): k2 in the loss, k1 in the return and
    ratio_k3 reach Eq. 4; k3 in the loss reaches beta p~ / (lambda - r), the form of Eq. 27 with
    the anchor p~, because its gradient is that of the forward divergence.
    """
    p = problems.bandit()
    eq4 = exact.eq4_sage_solution(p.ref, p.q, p.rewards, BETA)
    forward_form = exact.eq27_forward_kl_solution(p.anchor, p.rewards, BETA)
    pi = {
        estimator: sequence_probs(p, estimator_fixed_point(p, kl_estimator=estimator))
        for estimator in ("k2", "k1_return", "ratio_k3", "k3")
    }
    tol = FIXED_POINT_TOLERANCE
    return [
        equal(
            "k2_in_loss_reaches_eq4_one_token",
            "d",
            "fixed point of policy_loss(k2) vs Eq. 4",
            pi["k2"],
            eq4,
            tol,
        ),
        equal(
            "k1_return_reaches_eq4_one_token",
            "d",
            "fixed point of kl_shaped_rewards + policy_loss vs Eq. 4",
            pi["k1_return"],
            eq4,
            tol,
        ),
        equal(
            "ratio_k3_in_loss_reaches_eq4_one_token",
            "d",
            "fixed point of policy_loss(ratio_k3) vs Eq. 4",
            pi["ratio_k3"],
            eq4,
            tol,
        ),
        equal(
            "k3_in_loss_reaches_forward_kl_fixed_point",
            "d",
            "fixed point of policy_loss(k3) vs beta p~/(lambda - r)",
            pi["k3"],
            forward_form,
            tol,
        ),
        exceeds(
            "k3_in_loss_misses_eq4_one_token",
            "d",
            "max |fixed point of k3 - Eq. 4|",
            (pi["k3"] - eq4).abs().max().item(),
            SEPARATION_MARGIN,
        ),
    ]


@check
def check_forward_kl_baseline() -> list[Result]:
    """The forward-KL baseline of the paper's comparison (App. A.4): the per-token penalty
    u log u - u + 1, u = pi_ref / pi, estimates KL(pi_ref || pi) without bias, but as a loss term
    on on-policy samples its expected gradient is -sum_y pi_ref log(pi_ref / pi) grad log pi, the
    gradient of (1/2) sum_y pi_ref (log pi_ref - log pi)^2, not of the forward KL. So its fixed
    point is the optimum of E[r] - beta/2 sum pi_ref (log pi_ref - log pi)^2 and misses Eq. 27;
    the exact forward-KL gradient is k3's (check_one_token_fixed_points).
    """
    p = problems.bandit()
    p = p.with_log_q(torch.zeros_like(p.log_q_param))  # the baseline anchors to pi_ref itself

    def squared_log_ratio(pi):
        return 0.5 * (p.ref * (p.ref.log() - pi.log()) ** 2).sum()

    # Expected gradient of the penalty alone at an arbitrary policy.
    theta = problems.tensor([0.3, -0.2, 0.5, 0.0, -0.4]).requires_grad_(True)
    logps = p.tree.token_logps(theta)  # [B, 1]
    pi = logps.sum(-1).exp().detach()
    penalty = loss.anchor_penalty(logps, p.ref_logps, "forward")[:, 0]  # [B]
    (expected_gradient,) = torch.autograd.grad((pi * penalty).sum(), theta)
    (squared_gradient,) = torch.autograd.grad(
        squared_log_ratio(p.tree.sequence_logps(theta).exp()), theta
    )
    (forward_kl_gradient,) = torch.autograd.grad(
        exact.kl(p.ref, p.tree.sequence_logps(theta).exp()), theta
    )
    pi_fixed = sequence_probs(p, estimator_fixed_point(p, kl="forward"))
    optimum = maximize_over_policies(
        p, lambda pi: (pi * p.rewards).sum() - BETA * squared_log_ratio(pi)
    )
    eq27 = exact.eq27_forward_kl_solution(p.ref, p.rewards, BETA)
    return [
        equal(
            "forward_penalty_expected_gradient_is_squared_log_ratio_gradient",
            "d",
            "E_pi[grad anchor_penalty(kl='forward')] vs grad 1/2 sum pi_ref (log pi_ref/pi)^2",
            expected_gradient,
            squared_gradient,
            1e-12,
        ),
        exceeds(
            "forward_penalty_gradient_is_not_forward_kl_gradient",
            "d",
            "max |E_pi[grad penalty] - grad KL(pi_ref||pi)|",
            (expected_gradient - forward_kl_gradient).abs().max().item(),
            SEPARATION_MARGIN,
        ),
        equal(
            "forward_penalty_fixed_point_is_squared_log_ratio_optimum",
            "d",
            "fixed point of policy_loss(kl='forward') vs "
            "argmax E[r] - beta/2 sum pi_ref (log pi_ref/pi)^2",
            pi_fixed,
            optimum,
            FIXED_POINT_TOLERANCE,
        ),
        exceeds(
            "forward_penalty_misses_eq27",
            "d",
            "max |fixed point of policy_loss(kl='forward') - Eq. 27|",
            (pi_fixed - eq27).abs().max().item(),
            SEPARATION_MARGIN,
        ),
    ]


@check
def check_two_token_tree_fixed_points() -> list[Result]:
    """Multi-token completions: only k1 counted in the sequence return reaches
    Eq. 4. A per-token penalty sees the reward to go Q(s, a) but not the KL of later tokens, so
    per-token k2 reaches Eq. 4 *at each position* with Q in place of the soft value, and
    per-token k3 the per-position forward form beta p~(a|s) / (lambda_s - Q(s, a)) (Eq. 27's
    form at one position).
    """
    p = problems.two_token_tree("token")
    eq4 = exact.eq4_sage_solution(p.ref, p.q, p.rewards, BETA)
    theta = {e: estimator_fixed_point(p, kl_estimator=e) for e in ("k1_return", "k2", "k3")}
    pi = {e: sequence_probs(p, t) for e, t in theta.items()}
    node_probs = {e: p.tree.param_log_probs(t).exp() for e, t in theta.items()}
    tol = FIXED_POINT_TOLERANCE
    return [
        equal(
            "k1_return_reaches_eq4_two_token_tree",
            "d",
            "fixed point of k1 in the return vs Eq. 4",
            pi["k1_return"],
            eq4,
            tol,
        ),
        exceeds(
            "k2_in_loss_misses_eq4_two_token_tree",
            "d",
            "max |fixed point of per-token k2 - Eq. 4|",
            (pi["k2"] - eq4).abs().max().item(),
            SEPARATION_MARGIN,
        ),
        equal(
            "k2_in_loss_reaches_per_position_eq4_two_token_tree",
            "d",
            "pi(a|s) of per-token k2 vs softmax(log p~(a|s) + Q(s,a)/beta) at every node",
            node_probs["k2"],
            per_position_solution(p, theta["k2"], BETA, "reverse"),
            tol,
        ),
        exceeds(
            "k3_in_loss_misses_eq4_two_token_tree",
            "d",
            "max |fixed point of per-token k3 - Eq. 4|",
            (pi["k3"] - eq4).abs().max().item(),
            SEPARATION_MARGIN,
        ),
        equal(
            "k3_in_loss_reaches_per_position_forward_kl_fixed_point",
            "d",
            "pi(a|s) of per-token k3 vs beta p~(a|s)/(lambda_s - Q(s,a)) at every node",
            node_probs["k3"],
            per_position_solution(p, theta["k3"], BETA, "forward"),
            tol,
        ),
    ]


@check
def check_position_constant_guide() -> list[Result]:
    """A guide constant over the tokens at a position (branch, random: Eqs. 9 and 11).

    Per-token k2: log p~_t = log pi_ref_t + log q_s, and E_a[log q_s grad log pi(a|s)] = 0, so q
    cancels: the fixed point is the q = 1 one. k1 in the return: beta sum_t log q_t is a bonus for
    reaching the favoured states, Eq. 4 with that q, away from the q = 1 optimum. Per-token k3:
    a forward pull of strength beta q_s, so q does not cancel either.
    """
    guided, unguided = problems.two_token_tree("position"), problems.two_token_tree("none")
    pi_k2_guided = sequence_probs(guided, estimator_fixed_point(guided, kl_estimator="k2"))
    pi_k2_unguided = sequence_probs(unguided, estimator_fixed_point(unguided, kl_estimator="k2"))
    pi_k3_guided = sequence_probs(guided, estimator_fixed_point(guided, kl_estimator="k3"))
    pi_k3_unguided = sequence_probs(unguided, estimator_fixed_point(unguided, kl_estimator="k3"))
    pi_k1_guided = sequence_probs(guided, estimator_fixed_point(guided, kl_estimator="k1_return"))
    eq4 = exact.eq4_sage_solution(guided.ref, guided.q, guided.rewards, BETA)
    eq2 = exact.eq2_reverse_kl_solution(guided.ref, guided.rewards, BETA)
    return [
        equal(
            "k2_in_loss_position_constant_q_cancels",
            "d",
            "fixed point of per-token k2 with q_s vs with q = 1",
            pi_k2_guided,
            pi_k2_unguided,
            FIXED_POINT_TOLERANCE,
        ),
        exceeds(
            "k3_in_loss_position_constant_q_does_not_cancel",
            "d",
            "max |fixed point of per-token k3 with q_s - with q = 1|",
            (pi_k3_guided - pi_k3_unguided).abs().max().item(),
            SEPARATION_MARGIN,
        ),
        equal(
            "k1_return_position_constant_q_reaches_eq4",
            "d",
            "fixed point of k1 in the return vs Eq. 4",
            pi_k1_guided,
            eq4,
            FIXED_POINT_TOLERANCE,
        ),
        exceeds(
            "k1_return_position_constant_q_moves_the_optimum",
            "d",
            "max |Eq. 4 with q_s - Eq. 2 (q = 1)|",
            (eq4 - eq2).abs().max().item(),
            SEPARATION_MARGIN,
        ),
    ]


@check
def check_unequal_lengths() -> list[Result]:
    """k1 in the return reaches Eq. 4 with completions of different lengths, under both the
    per-sequence token mean (grpo) and the constant divisor (dr_grpo): at Eq. 4 the shaped return
    r - beta log(pi / p~) = beta log Z is the same for every completion, so every advantage is 0
    whatever the per-completion weighting of the aggregation.
    """
    p = problems.unequal_lengths_tree()
    eq4 = exact.eq4_sage_solution(p.ref, p.q, p.rewards, BETA)
    rows = []
    for aggregation in ("grpo", "dr_grpo"):
        pi = sequence_probs(
            p, estimator_fixed_point(p, kl_estimator="k1_return", aggregation=aggregation)
        )
        rows.append(
            equal(
                f"k1_return_reaches_eq4_unequal_lengths_{aggregation}_aggregation",
                "d",
                f"fixed point of k1 in the return, aggregation={aggregation}, "
                "lengths 1 and 2, vs Eq. 4",
                pi,
                eq4,
                FIXED_POINT_TOLERANCE,
            )
        )
    return rows


@check
def check_advantage_scaling() -> list[Result]:
    """Advantage normalization moves the fixed point of an in-loss penalty.

    Every group of G = 8 rollouts is enumerated. With k2 in the loss (Eq. 4 with Delta = 1):
    RLOO keeps Delta = 1; Dr. GRPO's group mean, which includes the sample, gives
    pi ∝ p~ exp(((G-1)/G) r / beta); GRPO's std gives Delta_G(p) at the fixed point's success
    rate p. k1 in the return is immune: at Eq. 4 its shaped returns are equal, so A = 0 under any
    normalization; shown with Dr. GRPO's 7/8, which moves k2's fixed point. (With GRPO's std, Eq. 4
    is still the only root, but the std makes the update scale-free near it -- A jumps to +-1
    as soon as the returns differ by more than eps -- so plain iteration circles around it.)
    """
    p = problems.small_bandit()
    group_size = 8

    def fixed_point(advantage, estimator):
        def gradient(theta):
            return group_gradient(
                p.tree,
                theta,
                p.rewards,
                p.ref_logps,
                p.log_q,
                group_size,
                advantage,
                beta=BETA,
                kl_estimator=estimator,
            )

        theta, _ = find_fixed_point(gradient, p.ref_theta)
        return sequence_probs(p, theta)

    def tilted(scale):  # pi ∝ p~ exp(scale r / beta)
        return exact.eq4_sage_solution(p.ref, p.q, scale * p.rewards, BETA)

    pi_rloo, pi_dr_grpo = fixed_point("rloo", "k2"), fixed_point("dr_grpo", "k2")
    pi_grpo, pi_dr_grpo_k1 = fixed_point("grpo", "k2"), fixed_point("dr_grpo", "k1_return")
    scale = advantage_reward_scale((pi_grpo * p.rewards).sum().item(), group_size, "grpo")
    tol = FIXED_POINT_TOLERANCE
    return [
        equal(
            "rloo_advantage_k2_reaches_eq4",
            "d",
            "fixed point (RLOO, k2, G = 8) vs Eq. 4",
            pi_rloo,
            tilted(1.0),
            tol,
        ),
        equal(
            "dr_grpo_advantage_k2_reaches_eq4_with_reward_scaled_by_7_8",
            "d",
            "fixed point (Dr. GRPO, k2, G = 8) vs p~ exp((7/8) r / beta)",
            pi_dr_grpo,
            tilted((group_size - 1) / group_size),
            tol,
        ),
        equal(
            "grpo_std_advantage_k2_reaches_eq4_with_reward_scaled_by_delta_g",
            "d",
            "fixed point (GRPO std, k2, G = 8) vs p~ exp(Delta r / beta), "
            f"Delta_8(p) = {scale:.4f}",
            pi_grpo,
            tilted(scale),
            tol,
        ),
        equal(
            "k1_return_dr_grpo_advantage_reaches_eq4",
            "d",
            "fixed point (Dr. GRPO, k1 in the return, G = 8) vs Eq. 4",
            pi_dr_grpo_k1,
            tilted(1.0),
            tol,
        ),
    ]


@check
def check_estimator_gradients() -> list[Result]:
    """Per-sample gradient identities of the estimators (App. E.5), single token.

    ratio_k3 = (pi / sg(pi)) k3 has the gradient of k2 at every sample; k1 = log(pi / p~) in the
    loss has zero expected gradient (why loss.py offers k1 only in the return); k3 in the loss
    has the expected gradient of the forward divergence D~(p~ || pi).
    """
    p = problems.bandit()
    theta = problems.tensor([0.3, -0.2, 0.5, 0.0, -0.4]).requires_grad_(True)
    anchor_logps = p.ref_logps + p.log_q  # [B, 1] log p~

    def expected_penalty_gradient(penalty_fn):
        logps = p.tree.token_logps(theta)  # [B, 1]
        pi = logps.sum(-1).exp().detach()  # the sampler's weights, no gradient
        (gradient,) = torch.autograd.grad((pi * penalty_fn(logps)[:, 0]).sum(), theta)
        return gradient

    logps = torch.linspace(-3.0, -0.1, 12, dtype=DTYPE).requires_grad_(True)
    anchors = torch.linspace(-0.5, -4.0, 12, dtype=DTYPE)
    (ratio_k3_grad,) = torch.autograd.grad(
        loss.anchor_penalty(logps, anchors, "reverse", "ratio_k3").sum(), logps
    )
    (k2_grad,) = torch.autograd.grad(
        loss.anchor_penalty(logps, anchors, "reverse", "k2").sum(), logps
    )

    k1_in_loss = expected_penalty_gradient(lambda logps: logps - anchor_logps)
    k3_in_loss = expected_penalty_gradient(
        lambda logps: loss.anchor_penalty(logps, anchor_logps, "reverse", "k3")
    )
    pi_theta = p.tree.sequence_logps(theta).exp()
    (forward_divergence_grad,) = torch.autograd.grad(exact.pseudo_kl(p.anchor, pi_theta), theta)
    return [
        equal(
            "ratio_k3_gradient_equals_k2_gradient",
            "d",
            "d/dlogp of anchor_penalty ratio_k3 vs k2, 12 points",
            ratio_k3_grad,
            k2_grad,
            1e-12,
        ),
        equal(
            "k1_in_loss_has_zero_expected_gradient",
            "d",
            "E_pi[grad (log pi - log p~)] vs 0",
            k1_in_loss,
            torch.zeros_like(k1_in_loss),
            1e-15,
        ),
        equal(
            "k3_in_loss_expected_gradient_is_forward_divergence_gradient",
            "d",
            "E_pi[grad anchor_penalty(k3)] vs grad D~(p~ || pi)",
            k3_in_loss,
            forward_divergence_grad,
            1e-12,
        ),
    ]


# --------------------------------------------------------------------------------------------
# e. The value of k3, and BNPO vs GRPO
# --------------------------------------------------------------------------------------------


@check
def check_k3_value() -> list[Result]:
    """E_pi[k3] = KL(pi || p) + (Z - 1 - log Z), p = p~ / Z (Eq. 5's pseudo-KL and k3).

    So a logged k3 against p~ is offset even at pi = pi_ref; with a position-constant q (branch
    guide) the offset of a token is q - 1 - log q, what the trainer logs as kl/anchor_offset
    (``loss.anchor_offset``, beside policy_loss's metrics): held here to the expectation of the
    loss's own k3 penalties, with and without q.
    """
    p = problems.bandit()
    pi = torch.softmax(problems.tensor([0.3, -0.2, 0.5, 0.0, -0.4]), dim=0)
    logps = pi.log()[:, None]  # [B, 1]
    z = p.anchor.sum()
    k3 = loss.anchor_penalty(logps, p.anchor.log()[:, None], "reverse", "k3")[:, 0]
    q_position = 1.3
    k3_guided = loss.anchor_penalty(logps, p.ref_logps + math.log(q_position), "reverse", "k3")[
        :, 0
    ]
    k3_plain = loss.anchor_penalty(logps, p.ref_logps, "reverse", "k3")[:, 0]
    log_q = torch.full_like(logps, math.log(q_position))
    logged = loss.anchor_offset(log_q, torch.ones_like(logps), q_constant=True)
    offset = q_position - 1.0 - math.log(q_position)
    return [
        equal(
            "k3_expectation_equals_kl_plus_offset",
            "e",
            f"E_pi[k3 vs p~] vs KL(pi||p~/Z) + Z - 1 - log Z, Z = {z:.3f}",
            (pi * k3).sum(),
            exact.kl(pi, p.anchor / z) + z - 1.0 - z.log(),
            1e-12,
        ),
        equal(
            "k3_offset_of_position_constant_q",
            "e",
            "E_pi[k3 vs pi_ref q] - E_pi[k3 vs pi_ref] vs q - 1 - log q, q = 1.3",
            (pi * (k3_guided - k3_plain)).sum(),
            offset,
            1e-12,
        ),
        equal(
            "k3_offset_logged_beside_policy_loss",
            "e",
            "logged kl/anchor_offset vs E_pi[k3 vs pi_ref q] - E_pi[k3 vs pi_ref]",
            logged["kl/anchor_offset"],
            (pi * (k3_guided - k3_plain)).sum(),
            1e-6,
        ),
    ]


@check
def check_bnpo_vs_grpo() -> list[Result]:
    """BNPO (Xiao et al. 2025, arXiv 2506.02864): its moment matching gives alpha = beta = 3/2 for a
    batch of group success rates with mean 1/2 and variance 1/16, and then its advantage is
    GRPO's times one constant: f_Beta(p; 3/2, 3/2) = (8/pi) sqrt(p(1-p)), GRPO's (Bessel) std is
    sqrt(G/(G-1) p(1-p)), so A_bnpo / A_grpo = (pi/8) sqrt(G/(G-1)) for every group.
    """
    group_size = 8
    successes = [7, 1, 5, 3, 4]  # p^ = 7/8, 1/8, 5/8, 3/8, 1/2: mean 1/2, variance 1/16
    rewards = torch.tensor([1.0 if i < s else 0.0 for s in successes for i in range(group_size)])
    p_hat = rewards.view(-1, group_size).mean(dim=1)
    alpha, beta = loss.bnpo_beta_parameters(p_hat)
    ratio = loss.bnpo_advantages(rewards, group_size) / loss.grpo_advantages(
        rewards, group_size, eps=0.0
    )
    constant = math.pi / 8 * math.sqrt(group_size / (group_size - 1))
    return [
        equal(
            "bnpo_moments_give_alpha_beta_3_2",
            "e",
            f"(alpha, beta) = ({alpha:.6f}, {beta:.6f}) vs (1.5, 1.5)",
            torch.tensor([alpha, beta], dtype=DTYPE),
            torch.tensor([1.5, 1.5], dtype=DTYPE),
            1e-6,
        ),
        equal(
            "bnpo_alpha_beta_3_2_proportional_to_grpo_std",
            "e",
            f"A_bnpo / A_grpo over 5 groups vs (pi/8) sqrt(8/7) = {constant:.6f}",
            ratio.double(),
            torch.full_like(ratio, constant, dtype=DTYPE),
            1e-6,
        ),
    ]
