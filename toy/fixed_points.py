"""Fixed points of loss.py's estimators, from exact expected gradients.

A trainer never sees the objective of Eq. 3; it sees a per-token loss on samples of pi. What that
loss converges to is the point where its *expected gradient* vanishes:

    g(theta) = sum_y w(y) * grad_theta loss(y; theta),     w(y) = pi_theta(y), pi_old = pi_theta

(on-policy: the sampler is the current policy, detached, so every ratio is 1). Here the sum runs
over every completion of a token tree, and ``loss(y; theta)`` is ``loss.policy_loss`` itself on a
batch holding y alone -- the clipped surrogate plus beta times the anchor penalty of the chosen
estimator (k1 counted in the return through ``loss.kl_shaped_rewards``, k2, k3, ratio_k3, or the
forward-KL baseline), aggregated as the trainer does. No formula of the estimators is repeated
here, so the fixed points found are those of *our* code.

How the weighting by w(y) is done: every aggregation used here (grpo, dr_grpo) is a sum of one
term per completion divided by the number of completions N, and every per-token term depends on
its own log-prob only. So one call of ``policy_loss`` on all N completions, differentiated with
respect to the per-token log-probs, gives each completion's own gradient divided by N; multiplied
by N w(y) and chained through the tree's log-probs (``TokenTree.log_prob_gradient``, the
softmax's Jacobian in closed form) it is g(theta). One backward pass, exact.

``find_fixed_point`` iterates the update (theta <- theta - lr g(theta)) until g is small, then
polishes the root of g with Newton steps on a finite-difference Jacobian (the map mixes detached
and live copies of theta, so autograd's Jacobian would not be the Jacobian of g). On-policy
gradients are float64 throughout (loss.py keeps float64 advantages and shaped returns);
``group_gradient``'s advantages come from ``loss.compute_advantages`` in float32, a noise floor of
about 1e-9 there. The checks hold its answers to 1e-6. It is meant for the small, well-conditioned
problems of ``toy.problems`` (beta = 0.5). On the App. C tree at beta = 0.05 its iteration hands
over while the rare branch is all but abandoned, where g is tiny at every node behind it without
being zero, and the polish stalls there (|g| 1e-8 to 1e-4, pi(y2) ~ 0); ``toy.table`` solves that
tree by backward induction (``toy.backward``) instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations_with_replacement

import torch

import loss
from toy import exact
from toy.exact import DTYPE, TokenTree


def expected_gradient(
    tree: TokenTree,
    theta: torch.Tensor,
    rows: torch.Tensor,
    row_weights: torch.Tensor,
    advantages: torch.Tensor,
    ref_logps: torch.Tensor,
    log_q: torch.Tensor,
    **loss_options,
) -> torch.Tensor:
    """sum_n row_weights[n] * grad_theta policy_loss(completion rows[n] alone), on-policy. [P]

    Args:
        tree: the completions; ``rows`` [N] indexes them (a completion may repeat, as in groups).
        theta: [P] policy logits; pi_old = pi_theta (detached).
        row_weights: [N] probability weight of each row (e.g. pi(y), or P(group) / G).
        advantages: [N] one per row, detached (as ``loss.compute_advantages`` would give).
        ref_logps, log_q: [B, T] per-token log pi_ref and log q of every completion of the tree.
        **loss_options: fields of ``loss.LossConfig`` (beta, kl, kl_estimator, aggregation).
    """
    token_logps = tree.token_logps(theta.detach())[rows]  # [N, T]
    mask = tree.completion_mask[rows]  # [N, T]
    logps = token_logps.requires_grad_(True)  # the loss's input
    # pi_old = pi: on-policy, ratio 1
    fixed = loss.HeldFixed(old_logps=logps.detach(), ref_logps=ref_logps[rows], log_q=log_q[rows])
    config = loss.LossConfig(**loss_options, max_completion_length=tree.shape[1])
    loss_value, _ = loss.policy_loss(logps, advantages, mask, fixed, config)
    (per_token_gradient,) = torch.autograd.grad(loss_value, logps)  # [N, T], each row's own / N
    weights = per_token_gradient * (len(rows) * row_weights)[:, None]  # [N, T]
    # Chain rule through log pi(y_t | y_<t) = log_softmax(theta at node y_<t)[y_t], in closed
    # form; rows are scattered back onto the tree's completions first.
    per_completion = torch.zeros(tree.shape, dtype=DTYPE).index_add(0, rows, weights)
    gradient = tree.log_prob_gradient(theta.detach(), per_completion)
    return gradient


def on_policy_gradient(
    tree: TokenTree,
    theta: torch.Tensor,
    rewards: torch.Tensor,
    ref_logps: torch.Tensor,
    log_q: torch.Tensor,
    *,
    beta: float,
    kl: str = "reverse",
    kl_estimator: str = "k3",
    aggregation: str = "grpo",
) -> torch.Tensor:
    """Exact E_{y ~ pi}[grad loss(y)] with the unnormalized advantage A = R - E_pi[R]. [P]

    R is the reward r(y), or with ``kl_estimator="k1_return"`` the KL-shaped return
    r(y) - beta * sum_t (log pi_t - log p~_t) of ``loss.kl_shaped_rewards``. The baseline
    E_pi[R] is a constant, so it changes no expected gradient: this is the expected gradient of
    a leave-one-out (RLOO) baseline, whose other samples are independent of y. It is *not* that
    of a group mean that includes y (Dr. GRPO) or of GRPO's std normalization: both rescale the
    reward (``advantage_reward_scale``) and move the fixed point of an in-loss penalty (see
    ``group_gradient``).
    """
    with torch.no_grad():
        token_logps = tree.token_logps(theta)  # [B, T]
        pi = token_logps.sum(dim=-1).exp()  # [B]
        if kl == "reverse" and kl_estimator == "k1_return":
            returns = loss.kl_shaped_rewards(
                rewards, token_logps, ref_logps, log_q, tree.completion_mask, beta
            )
            returns = returns.to(DTYPE)
        else:
            returns = rewards
        advantages = returns - (pi * returns).sum()
    rows = torch.arange(len(tree.completions))
    return expected_gradient(
        tree,
        theta,
        rows,
        pi,
        advantages,
        ref_logps,
        log_q,
        beta=beta,
        kl=kl,
        kl_estimator=kl_estimator,
        aggregation=aggregation,
    )


def group_gradient(
    tree: TokenTree,
    theta: torch.Tensor,
    rewards: torch.Tensor,
    ref_logps: torch.Tensor,
    log_q: torch.Tensor,
    group_size: int,
    advantage: str,
    *,
    beta: float,
    kl: str = "reverse",
    kl_estimator: str = "k2",
) -> torch.Tensor:
    """Exact expected gradient of a GRPO step whose groups of G completions are enumerated. [P]

    Every multiset of G completions is one group, weighted by its multinomial probability under
    pi; its advantages come from ``loss.compute_advantages(R, G, advantage)`` (R the reward, or
    the KL-shaped return for k1_return), and the step is the group's mean per-completion loss.
    This is how the advantage's normalization (RLOO, Dr. GRPO's mean-only, GRPO's std) enters
    the fixed point, with nothing approximated.
    """
    with torch.no_grad():
        token_logps = tree.token_logps(theta)  # [B, T]
        pi = token_logps.sum(dim=-1).exp()  # [B]
        returns = rewards
        if kl == "reverse" and kl_estimator == "k1_return":
            returns = loss.kl_shaped_rewards(
                rewards, token_logps, ref_logps, log_q, tree.completion_mask, beta
            )
        groups = torch.tensor(
            list(combinations_with_replacement(range(len(pi)), group_size))
        )  # [M, G]
        counts = torch.stack([(groups == b).sum(dim=1) for b in range(len(pi))], dim=1)  # [M, B]
        log_multinomial = math.lgamma(group_size + 1) - torch.lgamma(counts.to(DTYPE) + 1).sum(
            dim=1
        )
        group_probs = (log_multinomial + (counts * pi.log()).sum(dim=1)).exp()  # [M]
        rows = groups.flatten()  # [M * G], grouped by prompt as loss.py expects
        advantages = loss.compute_advantages(returns[rows], group_size, advantage).to(DTYPE)
        row_weights = (group_probs / group_size).repeat_interleave(group_size)
    return expected_gradient(
        tree,
        theta,
        rows,
        row_weights,
        advantages,
        ref_logps,
        log_q,
        beta=beta,
        kl=kl,
        kl_estimator=kl_estimator,
        aggregation="grpo",
    )


def advantage_reward_scale(
    success_probability: float, group_size: int, advantage: str = "grpo"
) -> float:
    """Delta_G(p) = E[A | r = 1] - E[A | r = 0] of ``loss.compute_advantages``, binary rewards.

    The other G - 1 rewards of the group are Bernoulli(p); with them independent of the sample,
    E[A_i grad log pi(y_i)] = Delta_G(p) E[r grad log pi]: a group's advantage rescales the reward.
    RLOO gives 1, Dr. GRPO's mean (which includes the sample) (G - 1) / G, GRPO's std a Delta_G
    that depends on p (about 1.7 at p = 0.5, 2.47 as p -> 1, for G = 8).
    """
    scale = 0.0
    for reward, sign in ((1.0, 1.0), (0.0, -1.0)):
        for successes in range(group_size):
            group = torch.tensor(
                [reward] + [1.0] * successes + [0.0] * (group_size - 1 - successes)
            )
            weight = math.comb(group_size - 1, successes) * success_probability**successes
            weight *= (1.0 - success_probability) ** (group_size - 1 - successes)
            scale += sign * weight * loss.compute_advantages(group, group_size, advantage)[0].item()
    return scale


def finite_difference_jacobian(
    gradient_fn, theta: torch.Tensor, gradient: torch.Tensor, step: float
):
    """dg/dtheta by forward differences from g(theta) = ``gradient``. [P, P]"""
    columns = []
    for i in range(len(theta)):
        shift = torch.zeros_like(theta)
        shift[i] = step
        columns.append((gradient_fn(theta + shift) - gradient) / step)
    return torch.stack(columns, dim=1)


def find_fixed_point(
    gradient_fn: Callable[[torch.Tensor], torch.Tensor],
    theta0: torch.Tensor,
    learning_rate: float = 8.0,
    switch_tolerance: float = 1e-3,
    stop_tolerance: float = 1e-12,
    max_gradient_steps: int = 3000,
    max_newton_steps: int = 20,
    finite_difference_step: float = 1e-6,
    max_step: float = 0.5,
) -> tuple[torch.Tensor, float]:
    """The point where the expected gradient vanishes, g(theta) = 0, reached from ``theta0``.

    Phase 1 iterates the update itself, theta <- theta - lr * g(theta) (what training does, with
    exact expectations): lr grows by 1.25 after a step that lowers |g| and halves otherwise,
    until |g| <= switch_tolerance. Phase 2 polishes with Newton steps on g = 0: Jacobian by
    forward differences, kept while each step at least halves |g| (a chord method), minimum-norm
    solve (each node's logits have one flat direction), steps capped at ``max_step`` per logit.
    It stops at |g| < stop_tolerance or at the noise floor, where even a fresh Newton step does
    not lower |g|. (Newton alone, from far away, can slide to a saturated policy where g is
    small too; the iteration of phase 1 cannot.)
    Returns (theta, infinity-norm of g at theta).
    """
    theta = theta0.detach().clone().to(DTYPE)
    gradient = gradient_fn(theta)
    for _ in range(max_gradient_steps):
        if gradient.abs().max() <= switch_tolerance or learning_rate < 1e-6:
            break
        candidate = theta - learning_rate * gradient
        candidate_gradient = gradient_fn(candidate)
        if candidate_gradient.norm() > gradient.norm():
            learning_rate /= 2
            continue
        theta, gradient = candidate, candidate_gradient
        learning_rate *= 1.25  # grow while it works: the slow directions set the pace
    jacobian, fresh = None, False
    for _ in range(max_newton_steps):
        if gradient.abs().max() < stop_tolerance:
            break
        if jacobian is None:
            jacobian = finite_difference_jacobian(
                gradient_fn, theta, gradient, finite_difference_step
            )
            fresh = True
        step = torch.linalg.lstsq(
            jacobian, -gradient[:, None], rcond=1e-9, driver="gelsd"
        ).solution[:, 0]
        step = step * min(1.0, max_step / step.abs().max().item())
        candidate = theta + step
        candidate_gradient = gradient_fn(candidate)
        if candidate_gradient.norm() < 0.5 * gradient.norm():  # good progress: keep the Jacobian
            theta, gradient, fresh = candidate, candidate_gradient, False
        elif not fresh:  # an old Jacobian stopped paying off: take a new one at the same point
            jacobian = None
        elif candidate_gradient.norm() < gradient.norm():
            theta, gradient, fresh = candidate, candidate_gradient, False
        else:
            break  # even a fresh Newton step does not lower |g|: the noise floor
    return theta, gradient.abs().max().item()


def per_position_solution(problem, theta: torch.Tensor, beta: float, form: str) -> torch.Tensor:
    """What a per-token penalty's fixed point must be at every node, given Q(s, a) under theta. [P]

    reverse (k2): pi(a|s) ∝ p~(a|s) exp(Q(s,a) / beta)          -- Eq. 4 at one position
    forward (k3): pi(a|s) = beta p~(a|s) / (lambda_s - Q(s,a))  -- Eq. 27's form at one position
    with p~(a|s) = pi_ref(a|s) q(s,a) and Q(s,a) = E[r | s, a] the *reward* to go: a per-token
    penalty sees no KL of the tokens after a.
    """
    tree = problem.tree
    q_values = tree.action_values(theta, problem.rewards)  # [P]
    log_anchor = tree.param_log_probs(problem.ref_theta) + problem.log_q_param  # [P]
    parts = []
    for offset, children in zip(tree.offsets, tree.children):
        node = slice(offset, offset + len(children))
        if form == "reverse":
            parts.append(torch.softmax(log_anchor[node] + q_values[node] / beta, dim=0))
        else:
            parts.append(
                exact.eq27_forward_kl_solution(log_anchor[node].exp(), q_values[node], beta)
            )
    return torch.cat(parts)
