"""Each estimator's fixed point on a token tree by backward induction, derived by hand (no loss.py).

``toy.table``'s solver: instead of searching for a root of loss.py's expected gradient, solve the
stationarity condition of every node from the leaves up, in float64, with formulas derived on
paper. Nothing here calls loss.py, so ``toy.checks`` can then hold loss.py to them: its expected
gradient must vanish at these points, node by node, and Newton's method on it must land on them.

The derivation. On-policy (every ratio 1) with a constant baseline, loss.py's expected gradient
with respect to the logit of child j at node s is, for completions of one length L (so that the
grpo aggregation's per-sequence token mean is a common factor 1/L; the App. C tree's are all 2):

    (rho(s) / L) pi(j|s) (c(s, j) - sum_a pi(a|s) c(s, a)),
    c(s, a) = -Q(s, a) + beta * d penalty / d log pi(a|s),

where rho(s) is the probability of reaching s. A per-token penalty depends on its own log-prob
only, so its gradient is pathwise and Q(s, a) = E[r | s, a] is the reward to go: the later
tokens' penalties do not enter. With u = p~(a|s) / pi(a|s), p~(a|s) = pi_ref(a|s) q(s, a):

    k2, ratio_k3   d/dlog pi (log u)^2 / 2 = -log u  ->  Q + beta log u = lambda_s,
                   pi(a|s) ∝ p~(a|s) exp(Q(s, a) / beta)              (Eq. 4 at one position)
    k3             d/dlog pi (u - 1 - log u) = 1 - u ->  Q + beta u = lambda_s,
                   pi(a|s) = beta p~(a|s) / (lambda_s - Q(s, a))      (Eq. 27's form)
    forward        d/dlog pi (u log u - u + 1) = -u log u  ->  Q + beta u log u = lambda_s

Wherever rho(s) > 0 the gradient vanishes iff every c(s, a) at s is equal, so the fixed point is
the per-node solution, node by node, each using the Q of the already solved nodes below it.
With k1 in the return the advantage carries the later tokens' KL and the fixed point is Eq. 4
itself (any lengths); its conditionals come from the soft values
V(s) = beta log sum_a p~(a|s) exp(V(s a) / beta), V(leaf) = r.

Stability. At a root, v . J v = (rho(s) / L) sum_a pi(a|s) d_a w_a^2 for the node's block J of the
gradient's Jacobian, w = v - E_pi[v] and d_a = pi(a|s) dc(s, a)/dpi(a|s): beta for k2, beta u for
k3, beta u (1 + log u) for the forward penalty. The root attracts gradient descent iff that form
is positive for every w != 0 with E_pi[w] = 0: always for k2 and k3 (their node solutions are
unique attractors); for the forward penalty, whose condition has two branches of u (u log u is
not monotone), iff at most one child sits on the lower branch u < 1/e and then
sum_a pi(a|s) / (u_a (1 + log u_a)) < 0 (a bordered-Hessian test). ``forward_node`` enumerates the
branches, keeps the attractors and raises unless there is exactly one.
"""

from __future__ import annotations

import math

import torch

import guides
from toy import exact
from toy.exact import DTYPE, TokenTree

INVERSE_E = math.exp(-1.0)


def inverse_u_log_u(c: torch.Tensor, lower: bool) -> torch.Tensor:
    """u with u log u = c on one branch: upper (u >= 1/e, any c >= -1/e) or lower (u <= 1/e,
    -1/e <= c < 0).

    Bisection on log u (u log u is monotone on each branch), elementwise, to the last bit.

    >>> c = torch.tensor([-0.2, 0.0, 2.0], dtype=DTYPE)
    >>> u = inverse_u_log_u(c, lower=False)
    >>> torch.allclose(u * u.log(), c, atol=1e-15), bool((u >= 1 / math.e).all())
    (True, True)
    """
    low = torch.full_like(c, -745.0 if lower else -1.0)  # log u
    high = torch.full_like(c, -1.0 if lower else 60.0)
    for _ in range(72):
        middle = 0.5 * (low + high)
        # True where the root lies above middle (upper: u log u increases with u; lower: it
        # decreases)
        go_up = (middle.exp() * middle < c) != lower
        low, high = torch.where(go_up, middle, low), torch.where(go_up, high, middle)
    return (0.5 * (low + high)).exp()


def forward_node_probs(
    anchor: torch.Tensor,
    q_values: torch.Tensor,
    beta: float,
    lams: torch.Tensor,
    lower_child: int | None,
) -> torch.Tensor:
    """[L, n]: pi(a|s) = p~(a|s) / u_a with Q + beta u log u = lambda for each lambda of
    ``lams`` [L], every u on the upper branch but child ``lower_child``'s, on the lower one."""
    c = ((lams[:, None] - q_values[None, :]) / beta).clamp_min(-INVERSE_E)  # [L, n]
    u = inverse_u_log_u(c, lower=False)
    if lower_child is not None:
        u[:, lower_child] = inverse_u_log_u(c[:, lower_child], lower=True)
    return anchor / u


def forward_roots(
    anchor, q_values, beta, low, high, lower_child, grid=64, rounds=9
) -> list[torch.Tensor]:
    """Every root in [low, high] of sum_a pi(a|s; lambda) - 1 for one branch assignment: sign
    changes on a grid of lambda, each bracket refined by re-gridding it (64^9 ~ 2^54: to the last
    bit)."""

    def excess(lams):
        return forward_node_probs(anchor, q_values, beta, lams, lower_child).sum(dim=1) - 1.0

    lams = torch.linspace(low, high, grid + 1, dtype=DTYPE)
    values = excess(lams)
    roots = []
    for i in torch.nonzero(values[:-1] * values[1:] <= 0).flatten().tolist():
        a, b = lams[i].item(), lams[i + 1].item()
        for _ in range(rounds):
            sub = torch.linspace(a, b, grid + 1, dtype=DTYPE)
            sub_values = excess(sub)
            j = torch.nonzero(sub_values[:-1] * sub_values[1:] <= 0).flatten()[0].item()
            a, b = sub[j].item(), sub[j + 1].item()
        roots.append(
            forward_node_probs(
                anchor, q_values, beta, torch.tensor([0.5 * (a + b)], dtype=DTYPE), lower_child
            )[0]
        )
    return roots


def forward_node(anchor: torch.Tensor, q_values: torch.Tensor, beta: float) -> torch.Tensor:
    """The one attracting root of Q + beta u log u = lambda, sum pi = 1 at a node (see the module's
    docstring): for every branch assignment (all upper, or one child lower), the roots in lambda,
    kept if they pass the stability test; raises unless exactly one is left."""
    top = q_values.max().item()
    lam_min = top - beta * INVERSE_E  # below it some u log u < -1/e: no solution
    lam_max = top + beta
    while (
        forward_node_probs(anchor, q_values, beta, torch.tensor([lam_max], dtype=DTYPE), None).sum()
        > 1.0
    ):
        lam_max = top + 2 * (lam_max - top)  # sum pi falls to 0 as lambda grows on the upper branch
    attractors = []
    for lower_child in [None, *range(len(anchor))]:
        # the lower branch needs c < 0 (at c = 0 its u is 0 and its pi infinite)
        high = lam_max if lower_child is None else q_values[lower_child].item() - 1e-9 * beta
        if high <= lam_min:
            continue
        for pi in forward_roots(anchor, q_values, beta, lam_min, high, lower_child):
            u = anchor / pi
            lower = u < INVERSE_E
            stable = lower.sum() == 0 or (lower.sum() == 1 and (pi / (u * (1 + u.log()))).sum() < 0)
            if stable and abs(pi.sum().item() - 1.0) < 1e-12:
                attractors.append(pi / pi.sum())
    distinct = [
        p
        for i, p in enumerate(attractors)
        if all((p - o).abs().max() > 1e-9 for o in attractors[:i])
    ]
    if len(distinct) != 1:
        raise ValueError(
            f"the forward penalty has {len(distinct)} attracting roots at this node, not one"
        )
    return distinct[0]


def node_solution(
    anchor: torch.Tensor, q_values: torch.Tensor, beta: float, estimator: str
) -> torch.Tensor:
    """pi(a|s) solving a per-token estimator's node condition, given p~(a|s) (unnormalized) and
    Q(s, a), over the last dimension (rows of [N, n] are nodes solved at once)."""
    if estimator in ("k2", "ratio_k3"):
        return torch.softmax(anchor.log() + q_values / beta, dim=-1)
    if estimator == "k3":
        return exact.eq27_forward_kl_solution(anchor, q_values, beta)
    if estimator == "forward":
        if anchor.dim() == 1:
            return forward_node(anchor, q_values, beta)
        return torch.stack([forward_node(a, q, beta) for a, q in zip(anchor, q_values)])
    raise ValueError(f"no per-token node condition for {estimator!r}")


def fixed_point(
    tree: TokenTree,
    ref_theta: torch.Tensor,
    rewards: torch.Tensor,
    log_q_param: torch.Tensor,
    estimator: str,
    beta: float,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [P] of the estimator's fixed point, solved from the deepest nodes up (q fixed), a
    level of the tree at a time (``TokenTree.levels``: every node of one depth and width at once).

    ``tail`` [P] (k1_return only): the probability of each child that the sampler never draws
    (below min-p's threshold), held where it is; 0 for the children it draws. A child outside the
    sampler's support is never sampled, so its return never enters, and the loss's gradient on its
    logit is -pi(v|s) E[A | s], which vanishes at the fixed point: its mass t_s = sum of the node's
    tail is whatever the training left it. The sampled children then hold 1 - t_s in Eq. 4's
    proportions p~(a|s) exp(V(s a) / beta) (the shaped return is constant on the sampler's
    support), and the soft value counts the tail through log pi(a|s) = log(1 - t_s) + ...:
    V(s) = beta log sum_kept p~(a|s) exp(V(s a) / beta) - beta log(1 - t_s).
    """
    if estimator != "k1_return" and len(set(tree.lengths.tolist())) > 1:
        raise ValueError(
            "per-token node conditions need completions of one length (see the module's docstring)"
        )
    if tail is not None and estimator != "k1_return":
        raise ValueError("a tail outside the sampler's support is modelled for k1_return only")
    log_anchors = tree.param_log_probs(ref_theta) + log_q_param  # [P] log p~(a|s)
    # V(s): reward to go (per-token estimators) or soft value (k1_return), of nodes, then leaves
    value = torch.zeros(len(tree.nodes), dtype=DTYPE)
    rewards = rewards.to(DTYPE)
    theta = torch.empty(tree.num_params, dtype=DTYPE)
    for nodes, params, child in tree.levels:  # [N], [N, c], [N, c]
        # a child is a node (its value) or ends completion -1 - child (its reward)
        q_values = torch.where(
            child >= 0, value[child.clamp_min(0)], rewards[(-1 - child).clamp_min(0)]
        )
        if estimator == "k1_return":
            logits = log_anchors[params] + q_values / beta
            if tail is None:
                probs = torch.softmax(logits, dim=-1)
                value[nodes] = beta * torch.logsumexp(logits, dim=-1)
            else:
                outside, node_tail = tail[params] > 0, tail[params].sum(dim=-1, keepdim=True)
                logits = logits.masked_fill(outside, float("-inf"))
                kept = (1.0 - node_tail) * torch.softmax(logits, dim=-1)
                probs = torch.where(outside, tail[params], kept)
                value[nodes] = beta * (
                    torch.logsumexp(logits, dim=-1) - torch.log1p(-node_tail.squeeze(-1))
                )
        else:
            probs = node_solution(log_anchors[params].exp(), q_values, beta, estimator)
            value[nodes] = (probs * q_values).sum(dim=-1)
        theta[params] = probs.log()
    return theta


def branch_log_q_param(
    tree: TokenTree,
    theta: torch.Tensor,
    config: guides.GuideConfig,
    inside: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 11 per (node, child) [P]: log clamp(1 + ratio max(0, H(s) - tau)), H (Eq. 12) of
    pi_theta at s. ``inside`` [P]: the entropy inside each child that stands for many tokens (a
    lumped tail, its shape held), so that H is the full vocabulary's:
    H(s) = H_tree(s) + sum_a pi(a|s) inside(a)."""
    entropies = tree.node_entropies(theta)
    if inside is not None:
        weighted = tree.param_log_probs(theta).exp() * inside
        entropies = entropies + torch.zeros_like(entropies).index_add(
            0, tree.node_of_param, weighted
        )
    node_q = 1.0 + config.ratio * (entropies - config.tau).clamp_min(0.0)
    return node_q.clamp(config.q_min, config.q_max).log()[tree.node_of_param]


def sampler_fixed_point(
    tree: TokenTree,
    ref_theta: torch.Tensor,
    rewards: torch.Tensor,
    log_q_param: torch.Tensor,
    beta: float,
    tail: torch.Tensor,
    min_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k1_return's fixed point as a trainer whose sampler truncates with min-p reaches it:
    ``fixed_point`` with ``tail`` [P] held outside the sampler's support, and every child that
    Eq. 4 pushes below min-p's threshold (min_p times its node's most likely child) moved outside
    at that threshold, if pi_ref's sampler drew it: it stops being sampled, and so pushed, as it
    crosses it. Returns
    (theta [P], the tail [P] it holds)."""

    def below_threshold(theta):
        probs = tree.param_log_probs(theta).exp()
        largest = torch.zeros(len(tree.nodes), dtype=DTYPE).scatter_reduce(
            0, tree.node_of_param, probs, "amax", include_self=False
        )[tree.node_of_param]
        return probs < min_p * largest, min_p * largest

    sampled_at_start = (tail == 0) & ~below_threshold(ref_theta)[0]
    while True:
        theta = fixed_point(tree, ref_theta, rewards, log_q_param, "k1_return", beta, tail=tail)
        below, threshold = below_threshold(theta)
        leaving = sampled_at_start & (tail == 0) & below
        if not leaving.any():
            return theta, tail
        tail = torch.where(leaving, threshold, tail)


def self_consistent_fixed_point(
    tree: TokenTree,
    ref_theta: torch.Tensor,
    rewards: torch.Tensor,
    estimator: str,
    beta: float,
    config: guides.GuideConfig,
    iterations: int = 100,
    tail: torch.Tensor | None = None,
    min_p: float = 0.0,
    inside: torch.Tensor | None = None,
):
    """The fixed point whose guide is Eq. 11 on its own entropies: iterate q -> fixed point -> q,
    from the guide of pi_ref. With ``tail`` (k1_return), each fixed point is
    ``sampler_fixed_point``'s, and ``inside`` makes H the full vocabulary's
    (``branch_log_q_param``). Returns (theta [P], log q [P]); raises if q does not settle."""
    log_q = branch_log_q_param(tree, ref_theta, config, inside)
    for _ in range(iterations):
        if tail is None:
            theta = fixed_point(tree, ref_theta, rewards, log_q, estimator, beta)
        else:
            theta, _ = sampler_fixed_point(tree, ref_theta, rewards, log_q, beta, tail, min_p)
        new_log_q = branch_log_q_param(tree, theta, config, inside)
        if (new_log_q - log_q).abs().max() <= 1e-15:
            return theta, log_q
        log_q = new_log_q
    raise ValueError(f"the self-consistent guide did not settle for {estimator!r}")


def expected_log_q(
    w: torch.Tensor, alpha: float, sigma: float, q_min: float, q_max: float
) -> torch.Tensor:
    """E over xi ~ N(0, 1) of log clamp(1 + alpha w + sigma w xi, q_min, q_max), elementwise: the
    token guide's log q_t (Eq. 10) as the return sees it on average. With mu = 1 + alpha w and
    s = sigma w, q is N(mu, s^2) clamped: the clamps' masses by the normal CDF, the middle by
    64-point Gauss-Legendre in z (its integrand, log(mu + s z) phi(z), is smooth there).

    >>> w = torch.tensor([0.0, 0.5, 1.0], dtype=DTYPE)
    >>> expected_log_q(w, alpha=0.3, sigma=0.0, q_min=0.6, q_max=1.4).exp()  # no noise: 1 + 0.3 w
    tensor([1.0000, 1.1500, 1.3000], dtype=torch.float64)
    >>> round(expected_log_q(w, 0.3, 0.25, 0.6, 1.4)[2].item(), 4)  # clamp, Jensen: < log 1.3
    0.2054
    """
    w = w.to(DTYPE)
    mu, s = 1.0 + alpha * w, sigma * w
    noiseless = mu.clamp(q_min, q_max).log()
    spread = s.clamp_min(1e-300)
    z_low = ((q_min - mu) / spread).clamp(-40.0, 40.0)
    z_high = ((q_max - mu) / spread).clamp(-40.0, 40.0)
    nodes, weights = _gauss_legendre(64)
    half = (z_high - z_low)[..., None] / 2  # [..., 1]
    z = z_low[..., None] + half * (nodes + 1.0)  # [..., 64]
    density = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    middle = (half * weights * (mu[..., None] + s[..., None] * z).log() * density).sum(-1)
    ndtr = torch.special.ndtr
    noisy = math.log(q_min) * ndtr(z_low) + math.log(q_max) * (1 - ndtr(z_high)) + middle
    return torch.where(s > 0, noisy, noiseless)


def _gauss_legendre(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights of n-point Gauss-Legendre quadrature on [-1, 1] (numpy's)."""
    import numpy as np

    nodes, weights = np.polynomial.legendre.leggauss(n)
    return torch.from_numpy(nodes), torch.from_numpy(weights)


def token_guide_fixed_point(
    tree: TokenTree,
    ref_theta: torch.Tensor,
    rewards: torch.Tensor,
    beta: float,
    config: guides.GuideConfig,
    alpha: float,
    sigma: float,
    token_mask: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    min_p: float = 0.0,
    iterations: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k1_return's fixed point under the token guide (Eq. 10) with alpha and sigma held, q read
    from the policy's own surprisals: pi(y) ∝ pi_ref(y) q(y) exp(r(y) / beta), where log q(y) =
    sum_t E_xi log q_t and q_t's w_t is -log pi(y_t | y_<t) normalized within y (the trainer's
    ``guides.normalize_per_completion``), so q is not one number per node but per completion.

    Eq. 4 with a per-completion factor is Eq. 4 with the reward r + beta log q(y): each step
    solves ``fixed_point`` (``sampler_fixed_point`` with ``tail``) with that reward, from q at
    pi_ref, the next q accelerated from the last rounds (``AndersonHistory``), until q settles
    (every completion's log q moves by at most 1e-12, or their mean under the policy by at most
    1e-11). ``token_mask`` [B, T]: the tokens the trainer would see (default every token of the
    tree). Returns (theta [P], log q(y) [B]); raises if q does not settle."""
    mask = tree.completion_mask if token_mask is None else token_mask

    def completion_log_q(theta):
        surprisal = -tree.token_logps(theta)  # [B, T]
        w = guides.normalize_per_completion(surprisal, mask, config.token_normalization)
        terms = expected_log_q(w, alpha, sigma, config.q_min, config.q_max)
        return (terms * mask).sum(dim=-1)  # [B]

    log_q = completion_log_q(ref_theta)
    no_q = torch.zeros(tree.num_params, dtype=DTYPE)
    history = AndersonHistory(depth=3)
    for _ in range(iterations):
        shaped = rewards.to(DTYPE) + beta * log_q
        if tail is None:
            theta = fixed_point(tree, ref_theta, shaped, no_q, "k1_return", beta)
        else:
            theta, _ = sampler_fixed_point(tree, ref_theta, shaped, no_q, beta, tail, min_p)
        new_log_q = completion_log_q(theta)
        change = (new_log_q - log_q).abs()  # [B]
        # Settled: everywhere, or where the policy puts its mass. The q of a completion it
        # almost never writes (one through OTHER) can settle far more slowly, and moves no
        # marginal such as log pi(B).
        expected_change = (tree.sequence_logps(theta).exp() * change).sum()
        if change.max() <= 1e-12 or expected_change <= 1e-11:
            return theta, new_log_q
        log_q = history.next(log_q, new_log_q)
    raise ValueError("the token guide's q did not settle")


class AndersonHistory:
    """Anderson acceleration of a fixed-point iteration x <- G(x) (Walker and Ni, 2011): the
    next x is G(x) less the combination of the last ``depth`` rounds' changes in G that best
    cancels the residual G(x) - x. Plain iteration of the token guide's q contracts by as little
    as 0.99 a round where the policy almost never writes a completion; with the last three
    rounds it settles in a few dozen (the same fixed point: the residual is what stops it).

    >>> history, x = AndersonHistory(depth=3), torch.zeros(2, dtype=torch.float64)
    >>> for _ in range(2):  # G(x) = 0.99 x + 0.01, fixed at 1
    ...     x = history.next(x, 0.99 * x + 0.01)
    >>> bool((x - 1).abs().max() < 1e-12)  # plain rounds: about 2,750 to get there
    True
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.points: list[torch.Tensor] = []  # the last depth + 1 x's, each [B]
        self.values: list[torch.Tensor] = []  # and their G(x)'s

    def next(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The next x after a round that mapped ``x`` to ``g`` = G(x), both [B]."""
        self.points = [*self.points, x][-(self.depth + 1) :]
        self.values = [*self.values, g][-(self.depth + 1) :]
        if len(self.points) == 1:
            return g  # a plain round, until there is a change to combine
        values = torch.stack(self.values, dim=1)  # [B, m + 1]
        residuals = values - torch.stack(self.points, dim=1)
        d_residuals, d_values = residuals.diff(dim=1), values.diff(dim=1)  # [B, m]
        gamma = torch.linalg.lstsq(d_residuals, residuals[:, -1:]).solution  # [m, 1]
        accelerated = g - (d_values @ gamma).squeeze(-1)
        return accelerated if torch.isfinite(accelerated).all() else g
