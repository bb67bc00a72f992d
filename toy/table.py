"""Theorem 4.3 under the losses people train with: the stationary pi(y2) of each estimator.

Theorem 4.3 is about the exact objective (Eq. 3), whose optimum is Eq. 4. A trainer follows
loss.py's per-token loss instead, and each KL estimator has a fixed point of its own. This module
computes, on the App. C tree (``problems.appendix_c_tree``, beta = 0.05, delta = 0.01), the point
where loss.py's *own* expected gradient vanishes, for every estimator (k1 in the return, k2, k3,
ratio_k3, and the forward-KL baseline), without a guide and with the branch guide (Eq. 11), and
reports pi(y2) there: is the rare solution y2 inside supp_delta?

Definitions, so the numbers mean one thing:

* The expected gradient is ``fixed_points.on_policy_gradient``: the exact expectation over the
  tree's completions of the gradient of ``loss.policy_loss`` (on-policy, every ratio 1), with the
  advantage A = R - E_pi[R]. A constant baseline moves no expected gradient, so this is the fixed
  point of a group-mean or leave-one-out baseline too; GRPO's std normalization would rescale the
  reward and move it (``fixed_points.group_gradient``).
* The guide is self-consistent: the trainer recomputes q from the current policy's entropies at
  every step and holds it fixed inside the step, so at its fixed point theta*, q = q(theta*) and
  the gradient with that q held fixed is 0. Here q(theta) is Eq. 11 on the node entropies (Eq. 12)
  of pi_theta, in float64, with guides.GuideConfig's defaults (tau 1.2, ratio 0.3, clamp [0.6, 1.4]).
* The solver is backward induction, then Newton: per-token estimators act at each node through
  Q(s, a), the reward to go, so the nodes are solved from the leaves up in their closed forms
  (Eq. 4 at one position for k2 and ratio_k3, the forward form of Eq. 27 for k3), which puts the
  start next to the root; Newton's method on the full expected gradient (finite-difference
  Jacobian, minimum-norm steps: each node's logits have one flat direction) then converges,
  quadratically, to |g| <= 1e-12. The gradient's infinity norm at each reported point is printed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import guides
from toy import exact, problems
from toy.exact import DTYPE
from toy.fixed_points import finite_difference_jacobian, on_policy_gradient, per_position_solution

BETA, DELTA = 0.05, 0.01
ESTIMATORS = ("k1_return", "k2", "k3", "ratio_k3", "forward")


def branch_log_q(problem: problems.Problem, theta: torch.Tensor, config: guides.GuideConfig) -> torch.Tensor:
    """Eq. 11's log q_t of every token from the entropies of pi_theta at its node, float64. [B, T]"""
    tree = problem.tree
    node_q = (1.0 + config.ratio * (tree.node_entropies(theta) - config.tau).clamp_min(0.0))
    node_q = node_q.clamp(config.q_min, config.q_max)
    return tree.per_token(node_q.log()[tree.node_of_param])


def guide_log_q(problem: problems.Problem, theta: torch.Tensor, guide: str) -> torch.Tensor:
    """log q_t [B, T] of a guide: "none", "fixed" (Eq. 11 on pi_ref's entropies, the q of the first
    update and of Theorem 4.3) or "self" (Eq. 11 on pi_theta's own entropies, recomputed)."""
    config = guides.GuideConfig(name="branch")
    if guide == "none":
        return torch.zeros(problem.tree.shape, dtype=DTYPE)
    return branch_log_q(problem, problem.ref_theta if guide == "fixed" else theta, config)


def expected_gradient(problem: problems.Problem, theta: torch.Tensor, estimator: str, guided: str,
                      beta: float = BETA) -> torch.Tensor:
    """loss.py's exact expected gradient at theta, with the guide ``guided`` (see guide_log_q). [P]"""
    log_q = guide_log_q(problem, theta, guided)
    kl, kl_estimator = ("forward", "k3") if estimator == "forward" else ("reverse", estimator)
    return on_policy_gradient(problem.tree, theta, problem.rewards, problem.ref_logps, log_q, beta=beta, kl=kl,
                              kl_estimator=kl_estimator)


def backward_induction(problem: problems.Problem, estimator: str, guided: str, beta: float = BETA,
                       sweeps: int = 8) -> torch.Tensor:
    """A start next to the fixed point: every node's per-position closed form, given the reward to
    go Q(s, a) under the current policy, swept until the deeper nodes (solved first) settle. [P]"""
    tree = problem.tree
    theta = problem.ref_theta.clone()
    form = "forward" if estimator in ("k3", "forward") else "reverse"
    for _ in range(sweeps):
        per_token = guide_log_q(problem, theta, guided)  # per token; back to per (node, child)
        log_q = torch.zeros(tree.num_params, dtype=DTYPE).index_put_((tree.param_index.flatten(),), per_token.flatten())
        theta = per_position_solution(problem.with_log_q(log_q), theta, beta, form).log()
    return theta


def newton(gradient_fn, theta: torch.Tensor, tolerance: float = 1e-12, max_steps: int = 40) -> tuple[torch.Tensor, float]:
    """Newton's method on g(theta) = 0 from a nearby start, with step halving. Returns (theta, |g|_inf)."""
    gradient = gradient_fn(theta)
    for _ in range(max_steps):
        if gradient.abs().max() <= tolerance:
            break
        jacobian = finite_difference_jacobian(gradient_fn, theta, gradient, 1e-7)
        step = torch.linalg.lstsq(jacobian, -gradient[:, None], rcond=1e-10, driver="gelsd").solution[:, 0]
        for _ in range(30):
            candidate = theta + step
            candidate_gradient = gradient_fn(candidate)
            if candidate_gradient.norm() < gradient.norm():
                break
            step = step / 2
        else:
            break  # no step lowers |g|: the floor of float64 arithmetic
        theta, gradient = candidate, candidate_gradient
    return theta, gradient.abs().max().item()


GUIDES = ("none", "fixed", "self")


@dataclass(frozen=True)
class Row:
    estimator: str
    pi_y2: dict  # guide ("none", "fixed", "self") -> pi(y2) at the estimator's fixed point
    gradient: dict  # guide -> |expected gradient|_inf at that point


def stationary_pi_y2(problem: problems.Problem, estimator: str, guided: str) -> tuple[float, float, torch.Tensor]:
    """(pi(y2), |g|_inf, theta) at the fixed point of the estimator's expected gradient."""
    start = backward_induction(problem, estimator, guided)
    theta, norm = newton(lambda t: expected_gradient(problem, t, estimator, guided), start)
    y2 = problem.tree.completions.index((1, 0))
    return problem.tree.sequence_logps(theta).exp()[y2].item(), norm, theta


def estimator_table() -> list[Row]:
    """One row per estimator: pi(y2) at its fixed point with no guide, with the branch guide fixed
    at pi_ref's entropies, and with the branch guide recomputed from the policy (self-consistent)."""
    problem, rows = problems.appendix_c_tree(), []
    for estimator in ESTIMATORS:
        points = {guide: stationary_pi_y2(problem, estimator, guide) for guide in GUIDES}
        rows.append(Row(estimator, {g: p[0] for g, p in points.items()}, {g: p[1] for g, p in points.items()}))
    return rows


def exact_objective_pi_y2() -> dict:
    """pi(y2) of the exact objectives: Eq. 2 without a guide, Eq. 4 with the branch guide fixed at
    pi_ref's entropies, and Eq. 4 with q recomputed from its own solution's entropies."""
    problem = problems.appendix_c_tree()
    y2 = problem.tree.completions.index((1, 0))
    pi_rl = exact.eq2_reverse_kl_solution(problem.ref, problem.rewards, BETA)
    fixed_q = guide_log_q(problem, problem.ref_theta, "fixed").sum(-1).exp()
    pi_fixed = exact.eq4_sage_solution(problem.ref, fixed_q, problem.rewards, BETA)
    theta = problem.ref_theta
    for _ in range(50):  # Eq. 4 with q from its own entropies, iterated to a fixed point
        q = guide_log_q(problem, theta, "self").sum(-1).exp()
        pi_self = exact.eq4_sage_solution(problem.ref, q, problem.rewards, BETA)
        theta = problem.tree.theta_from_node_probs(node_probs_of(problem.tree, pi_self))
    return {"none": pi_rl[y2].item(), "fixed": pi_fixed[y2].item(), "self": pi_self[y2].item()}


def node_probs_of(tree: exact.TokenTree, pi: torch.Tensor) -> dict[tuple, list[float]]:
    """The next-token probabilities of a sequence distribution, node by node."""
    probs = {}
    for s, children in zip(tree.nodes, tree.children):
        mass = [sum(p.item() for y, p in zip(tree.completions, pi) if y[: len(s) + 1] == s + (a,)) for a in children]
        total = sum(mass)
        probs[s] = [m / total for m in mass]
    return probs


def format_table(rows: list[Row]) -> str:
    """The table ``python -m toy --table`` prints."""
    exact_row = exact_objective_pi_y2()
    lines = [f"App. C tree, beta = {BETA}, delta = {DELTA}: pi(y2) where loss.py's expected gradient vanishes",
             "guides: none | branch with q fixed at pi_ref's entropies (Theorem 4.3's q) | branch recomputed "
             "from the policy (self-consistent)",
             f"{'estimator':<13}{'none':>9}{'fixed q':>9}{'self q':>9}   {'|g| at each point':<27}in supp_delta"]
    for row in rows:
        values = "".join(f"{row.pi_y2[g]:>9.5f}" for g in GUIDES)
        norms = " ".join(f"{row.gradient[g]:.0e}" for g in GUIDES)
        inside = " / ".join("yes" if row.pi_y2[g] >= DELTA else "no" for g in GUIDES)
        lines.append(f"{row.estimator:<13}{values}   {norms:<27}{inside}")
    values = "".join(f"{exact_row[g]:>9.5f}" for g in GUIDES)
    inside = " / ".join("yes" if exact_row[g] >= DELTA else "no" for g in GUIDES)
    lines.append(f"{'Eq. 2 / 4':<13}{values}   {'(closed forms)':<27}{inside}")
    return "\n".join(lines)
