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
  advantage A = R - E_pi[R]. A constant baseline moves no expected gradient, and a leave-one-out
  baseline (RLOO) is that constant in expectation, so this is RLOO's fixed point too. A group's
  own mean (Dr. GRPO) or std (GRPO) is not: it multiplies the reward by Delta_G(p)
  (``fixed_points.advantage_reward_scale``: (G - 1) / G, or about 2.47 near p = 1 for G = 8),
  which moves every in-loss penalty's point to the table's point at beta / Delta_G(p*) and leaves
  k1 in the return where it is (its whole return is scaled). ``advantage_point`` solves that,
  ``advantage_table`` reports pi(y2) there, and ``toy.checks`` holds loss.py's exact group
  gradient (every group of G = 4 enumerated) to it.
* The guide is self-consistent: the trainer recomputes q from the current policy's entropies at
  every step and holds it fixed inside the step, so at its fixed point theta*, q = q(theta*) and
  the gradient with that q held fixed is 0. Here q(theta) is Eq. 11 on the node entropies (Eq. 12)
  of pi_theta, in float64, with guides.GuideConfig's defaults (tau 1.2, ratio 0.3, clamp
  [0.6, 1.4]).
* The solver is backward induction (``toy.backward``): every node's stationarity condition,
  derived by hand and solved in float64 from the leaves up -- Eq. 4 at one position for k2 and
  ratio_k3, the forward form of Eq. 27 for k3, a per-node root find in lambda for the forward
  baseline, the soft values of Eq. 4 for k1 in the return. It never calls loss.py; loss.py's
  expected gradient is then *evaluated* at its answer, and its infinity norm is the |g| the
  table prints. A small |g| alone would prove little (a policy that has all but abandoned a
  branch has a tiny gradient at every node behind it, since each node's gradient carries the
  probability of reaching it); a per-node solution is stationary whatever that probability.
* Cross-checks (``toy.checks``): Newton's method on loss.py's expected gradient from a rough start
  lands on the same points; each point attracts gradient descent (the Jacobian's eigenvalues are
  positive off each node's flat direction); and the branch node's entropy stays below tau at the
  fixed point for every q the guide can give it, so the self-consistent guide is unique.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import guides
from toy import backward, exact, problems
from toy.exact import DTYPE
from toy.fixed_points import (
    advantage_reward_scale,
    finite_difference_jacobian,
    group_gradient,
    on_policy_gradient,
)

BETA, DELTA = 0.05, 0.01
ESTIMATORS = ("k1_return", "k2", "k3", "ratio_k3", "forward")
GUIDES = ("none", "fixed", "self")
PER_TOKEN = (
    "k2",
    "k3",
    "ratio_k3",
    "forward",
)  # the estimators whose point a group's advantage moves
GROUP_SIZE = 8  # rollouts per prompt (the paper's G)
BRANCH = guides.GuideConfig(name="branch")  # Eq. 11 with the paper's defaults
Q_GRID = torch.linspace(
    1.0, BRANCH.q_max, 9, dtype=DTYPE
)  # every q Eq. 11 can give (>= 1, clamped)


def guide_log_q_param(problem: problems.Problem, theta: torch.Tensor, guide: str) -> torch.Tensor:
    """log q per (node, child) [P] of a guide: "none", "fixed" (Eq. 11 on pi_ref's entropies, the
    q of the first update and of Theorem 4.3) or "self" (Eq. 11 on pi_theta's own entropies,
    recomputed)."""
    if guide == "none":
        return torch.zeros(problem.tree.num_params, dtype=DTYPE)
    return backward.branch_log_q_param(
        problem.tree, problem.ref_theta if guide == "fixed" else theta, BRANCH
    )


def expected_gradient(
    problem: problems.Problem,
    theta: torch.Tensor,
    estimator: str,
    guide: str,
    beta: float = BETA,
    log_q_param: torch.Tensor | None = None,
) -> torch.Tensor:
    """loss.py's exact expected gradient at theta, the guide's q computed at theta (or given as
    ``log_q_param``) and held fixed. [P]"""
    if log_q_param is None:
        log_q_param = guide_log_q_param(problem, theta, guide)
    kl, kl_estimator = ("forward", "k3") if estimator == "forward" else ("reverse", estimator)
    return on_policy_gradient(
        problem.tree,
        theta,
        problem.rewards,
        problem.ref_logps,
        problem.tree.per_token(log_q_param),
        beta=beta,
        kl=kl,
        kl_estimator=kl_estimator,
    )


def node_residual(
    problem: problems.Problem,
    theta: torch.Tensor,
    estimator: str,
    guide: str,
    log_q_param: torch.Tensor | None = None,
) -> torch.Tensor:
    """loss.py's expected gradient divided, entry by entry, by rho(s) pi(a|s), the probability of
    reaching node s and taking a there. [P]

    The gradient of the logit of child a at node s is rho(s) pi(a|s) (c(s, a) - mean_pi c(s, .))
    (``toy.backward``), so this is c(s, a)'s deviation from its node's mean: zero exactly where
    every node is stationary, however rarely it is reached, and of order one where it is not.
    """
    gradient = expected_gradient(problem, theta, estimator, guide, log_q_param=log_q_param)
    return gradient / visit_probabilities(problem.tree, theta)


def visit_probabilities(tree: exact.TokenTree, theta: torch.Tensor) -> torch.Tensor:
    """rho(s) pi(a|s) for every (node s, child a): the probability of taking a at s. [P]"""
    log_probs = tree.param_log_probs(theta)  # [P]
    log_reach = torch.zeros(len(tree.nodes), dtype=DTYPE)  # log rho(s)
    for i, s in enumerate(tree.nodes[1:], start=1):
        parent = tree.node_id[s[:-1]]
        child = tree.offsets[parent] + tree.children[parent].index(s[-1])
        log_reach[i] = log_reach[parent] + log_probs[child]  # nodes are sorted by depth
    return (log_reach[tree.node_of_param] + log_probs).exp()


def group_residual(
    problem: problems.Problem,
    theta: torch.Tensor,
    estimator: str,
    guide: str,
    advantage: str,
    group_size: int,
    beta: float = BETA,
) -> torch.Tensor:
    """``node_residual`` of loss.py's exact expected gradient with a group's advantage
    (``fixed_points.group_gradient``: every group of ``group_size`` completions enumerated). [P]"""
    kl, kl_estimator = ("forward", "k3") if estimator == "forward" else ("reverse", estimator)
    log_q = problem.tree.per_token(guide_log_q_param(problem, theta, guide))
    gradient = group_gradient(
        problem.tree,
        theta,
        problem.rewards,
        problem.ref_logps,
        log_q,
        group_size,
        advantage,
        beta=beta,
        kl=kl,
        kl_estimator=kl_estimator,
    )
    return gradient / visit_probabilities(problem.tree, theta)


def solve(
    problem: problems.Problem, estimator: str, guide: str, beta: float = BETA
) -> torch.Tensor:
    """The estimator's fixed point [P] by backward induction (``toy.backward``), with the guide's q
    fixed (none, pi_ref's) or self-consistent (q of the point's own entropies)."""
    tree, ref, rewards = problem.tree, problem.ref_theta, problem.rewards
    if guide == "self":
        theta, _ = backward.self_consistent_fixed_point(tree, ref, rewards, estimator, beta, BRANCH)
        return theta
    return backward.fixed_point(
        tree, ref, rewards, guide_log_q_param(problem, ref, guide), estimator, beta
    )


def rough_start(
    problem: problems.Problem, estimator: str, guide: str, beta: float = BETA, sweeps: int = 3
) -> torch.Tensor:
    """A start for Newton that is not the answer: a few sweeps of per-node forms over all nodes at
    once, Q(s, a) the reward to go under the previous sweep, k1 in the return and the forward
    baseline given the wrong forms (k2's, k3's). [P]"""
    tree = problem.tree
    theta = problem.ref_theta.clone()
    form = "k3" if estimator in ("k3", "forward") else "k2"
    for _ in range(sweeps):
        anchors = (
            tree.param_log_probs(problem.ref_theta) + guide_log_q_param(problem, theta, guide)
        ).exp()
        q_values = tree.action_values(theta, problem.rewards)
        theta = torch.cat(
            [
                backward.node_solution(
                    anchors[o : o + len(c)], q_values[o : o + len(c)], beta, form
                ).log()
                for o, c in zip(tree.offsets, tree.children)
            ]
        )
    return theta


def newton(
    gradient_fn, theta: torch.Tensor, tolerance: float = 1e-12, max_steps: int = 40
) -> tuple[torch.Tensor, float]:
    """Newton's method on g(theta) = 0 from a nearby start, with step halving. Returns
    (theta, |g|_inf)."""
    gradient = gradient_fn(theta)
    for _ in range(max_steps):
        if gradient.abs().max() <= tolerance:
            break
        jacobian = finite_difference_jacobian(gradient_fn, theta, gradient, 1e-7)
        step = torch.linalg.lstsq(
            jacobian, -gradient[:, None], rcond=1e-10, driver="gelsd"
        ).solution[:, 0]
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


def newton_point(problem: problems.Problem, estimator: str, guide: str) -> torch.Tensor:
    """The root Newton's method finds on loss.py's expected gradient from ``rough_start``. [P]"""
    start = rough_start(problem, estimator, guide)
    theta, _ = newton(lambda t: expected_gradient(problem, t, estimator, guide), start)
    return theta


def slowest_rate(
    problem: problems.Problem, theta: torch.Tensor, estimator: str, guide: str
) -> float:
    """The smallest real part of the eigenvalues of d(node_residual)/d theta at a fixed point theta,
    leaving out one eigenvalue per node (a node's logits all shifted: no change). Positive: the
    point attracts gradient descent.

    Why the residual and not the gradient: at a fixed point the gradient's Jacobian is D times the
    residual's, D = diag(rho(s) pi(a|s)) > 0, and is block-triangular over the nodes (a node's
    condition does not involve its parent) with symmetric diagonal blocks (each the Hessian of a
    node objective). So both have eigenvalues of the same signs (Sylvester's law of inertia), but
    the gradient's are as small as rho pi ~ 1e-10 here, below a finite difference's rounding,
    while the residual's are of order beta.
    """
    log_q = guide_log_q_param(problem, theta, guide)  # held fixed, as inside a trainer's step

    def residual(t):
        return node_residual(problem, t, estimator, guide, log_q_param=log_q)

    jacobian = finite_difference_jacobian(residual, theta, residual(theta), 1e-6)
    real_parts = torch.linalg.eigvals(jacobian).real.sort().values
    return real_parts[len(problem.tree.nodes) :].min().item()


def branch_entropy_over_q(problem: problems.Problem, estimator: str) -> torch.Tensor:
    """H (Eq. 12) at y2's branching node of the fixed point whose guide puts q there, for every q
    of Q_GRID (1 elsewhere: the other nodes have two children, H <= ln 2 < tau, so Eq. 11 gives 1).
    [9]"""
    tree = problem.tree
    branch = tree.node_id[(1,)]
    entropies = []
    for q in Q_GRID:
        log_q = torch.where(tree.node_of_param == branch, q.log(), torch.zeros((), dtype=DTYPE))
        theta = backward.fixed_point(
            tree, problem.ref_theta, problem.rewards, log_q, estimator, BETA
        )
        entropies.append(tree.node_entropies(theta)[branch])
    return torch.stack(entropies)


@dataclass(frozen=True)
class Row:
    estimator: str
    pi_y2: dict  # guide ("none", "fixed", "self") -> pi(y2) at the estimator's fixed point
    gradient: dict  # guide -> |loss.py's expected gradient|_inf at that point
    theta: dict  # guide -> the point's logits [P]


def pi_y2_of(problem: problems.Problem, theta: torch.Tensor) -> float:
    return problem.tree.sequence_logps(theta).exp()[problem.tree.completions.index((1, 0))].item()


def success_rate(problem: problems.Problem, theta: torch.Tensor) -> float:
    """p = E_pi[r], the success rate a group's advantage depends on."""
    return (problem.tree.sequence_logps(theta).exp() * problem.rewards).sum().item()


def advantage_point(
    problem: problems.Problem,
    estimator: str,
    guide: str,
    advantage: str,
    group_size: int = GROUP_SIZE,
    iterations: int = 50,
) -> tuple[float, torch.Tensor]:
    """A per-token estimator's fixed point under a group's advantage: the table's point at
    beta' = BETA / Delta_G(p), p the success rate at that point itself (iterated; Dr. GRPO's
    Delta does not depend on p). Returns (beta', theta [P])."""
    beta = BETA
    for _ in range(iterations):
        theta = solve(problem, estimator, guide, beta)
        new_beta = BETA / advantage_reward_scale(
            success_rate(problem, theta), group_size, advantage
        )
        if abs(new_beta - beta) <= 1e-13:  # each pass shrinks the change ~400-fold here
            return beta, theta
        beta = new_beta
    raise ValueError(
        f"beta / Delta_G(p) did not settle for {estimator!r} with the {advantage} advantage"
    )


@functools.lru_cache(maxsize=1)
def advantage_table() -> dict:
    """pi(y2) of the per-token estimators under the paper's G = 8 groups: {advantage: {estimator:
    {guide: (beta', pi(y2))}}} for Dr. GRPO's group mean and GRPO's std, no guide and the branch
    guide fixed at pi_ref's entropies (k1 in the return is not moved)."""
    problem = problems.appendix_c_tree()
    result = {}
    for advantage in ("dr_grpo", "grpo"):
        result[advantage] = {}
        for estimator in PER_TOKEN:
            points = {
                guide: advantage_point(problem, estimator, guide, advantage)
                for guide in ("none", "fixed")
            }
            result[advantage][estimator] = {
                g: (beta, pi_y2_of(problem, t)) for g, (beta, t) in points.items()
            }
    return result


@functools.lru_cache(maxsize=1)
def estimator_table() -> tuple[Row, ...]:
    """One row per estimator: pi(y2) at its fixed point with no guide, with the branch guide fixed
    at pi_ref's entropies, and with the branch guide recomputed from the policy (self-consistent),
    and the size of loss.py's expected gradient at each point."""
    problem, rows = problems.appendix_c_tree(), []
    for estimator in ESTIMATORS:
        thetas = {guide: solve(problem, estimator, guide) for guide in GUIDES}
        norms = {
            g: expected_gradient(problem, t, estimator, g).abs().max().item()
            for g, t in thetas.items()
        }
        rows.append(
            Row(estimator, {g: pi_y2_of(problem, t) for g, t in thetas.items()}, norms, thetas)
        )
    return tuple(rows)


@functools.lru_cache(maxsize=1)
def exact_objective_pi_y2() -> dict:
    """pi(y2) of the exact objectives: Eq. 2 without a guide, Eq. 4 with the branch guide fixed at
    pi_ref's entropies, and Eq. 4 with q recomputed from its own solution's entropies (iterated)."""
    problem = problems.appendix_c_tree()
    tree, y2 = problem.tree, problem.tree.completions.index((1, 0))
    pi_rl = exact.eq2_reverse_kl_solution(problem.ref, problem.rewards, BETA)
    fixed_q = tree.per_token(guide_log_q_param(problem, problem.ref_theta, "fixed")).sum(-1).exp()
    pi_fixed = exact.eq4_sage_solution(problem.ref, fixed_q, problem.rewards, BETA)
    theta = problem.ref_theta
    for _ in range(50):  # Eq. 4 with q from its own entropies, iterated to a fixed point
        q = tree.per_token(guide_log_q_param(problem, theta, "self")).sum(-1).exp()
        pi_self = exact.eq4_sage_solution(problem.ref, q, problem.rewards, BETA)
        theta = tree.theta_from_node_probs(node_probs_of(tree, pi_self))
    return {"none": pi_rl[y2].item(), "fixed": pi_fixed[y2].item(), "self": pi_self[y2].item()}


def node_probs_of(tree: exact.TokenTree, pi: torch.Tensor) -> dict[tuple, list[float]]:
    """The next-token probabilities of a sequence distribution, node by node."""
    probs = {}
    for s, children in zip(tree.nodes, tree.children):
        mass = [
            sum(p.item() for y, p in zip(tree.completions, pi) if y[: len(s) + 1] == s + (a,))
            for a in children
        ]
        total = sum(mass)
        probs[s] = [m / total for m in mass]
    return probs


def format_table(rows) -> str:
    """The table ``python -m toy --table`` prints."""
    problem = problems.appendix_c_tree()
    exact_row = exact_objective_pi_y2()
    branch = problem.tree.node_id[(1,)]
    fixed_q = guide_log_q_param(problem, problem.ref_theta, "fixed").exp()[
        problem.tree.node_of_param == branch
    ][0]
    lines = [
        f"App. C tree, beta = {BETA}, delta = {DELTA}: "
        "pi(y2) where loss.py's expected gradient vanishes",
        "guides: none | branch, q fixed at pi_ref's entropies "
        f"(Theorem 4.3's q; {fixed_q:.4f} at y2's "
        "branching node) | branch recomputed from the policy (self-consistent)",
        f"{'estimator':<13}{'none':>9}{'fixed q':>9}{'self q':>9}   "
        f"{'|g| at each point':<27}in supp_delta",
    ]
    for row in rows:
        values = "".join(f"{row.pi_y2[g]:>9.5f}" for g in GUIDES)
        norms = " ".join(f"{row.gradient[g]:.0e}" for g in GUIDES)
        inside = " / ".join("yes" if row.pi_y2[g] >= DELTA else "no" for g in GUIDES)
        lines.append(f"{row.estimator:<13}{values}   {norms:<27}{inside}")
    values = "".join(f"{exact_row[g]:>9.5f}" for g in GUIDES)
    inside = " / ".join("yes" if exact_row[g] >= DELTA else "no" for g in GUIDES)
    lines.append(f"{'Eq. 2 / 4':<13}{values}   {'(closed forms)':<27}{inside}")
    entropies = ", ".join(
        f"{row.estimator} {problem.tree.node_entropies(row.theta['self'])[branch]:.3f}"
        for row in rows
    )
    lines.append(
        f"self q: entropy of y2's branching node at each point ({entropies}) "
        f"< tau = {BRANCH.tau}, so q = 1"
    )
    lines.append(
        "solver: backward induction over the tree (per-node conditions, float64); "
        "|g|: infinity norm of loss.py's exact expected gradient there"
    )
    return "\n".join(lines)
