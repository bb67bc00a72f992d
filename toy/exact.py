"""Exact distributions on small token trees: the bench every toy check stands on.

A *token tree* lists every completion of one prompt as a token sequence. Its internal nodes are
the prefixes, and an autoregressive policy is one logit vector per node over that node's
children, so a flat parameter vector ``theta`` [P] (one logit per (node, child) pair) spans the
whole interior of the simplex over completions. Everything is enumerated in float64: no sampling,
no noise, so a stationary point found here can be compared with a closed form to ~1e-10.

Pieces, in the order the checks use them:

* ``TokenTree``: per-token and per-sequence log-probs, entropies (Eq. 12) and action values
  Q(s, a) = E[r | prefix s, token a] of a parametrized policy.
* Objectives of section 4 and App. A, as functions of a sequence distribution: reverse KL
  (Eq. 1), SAGE's pseudo-KL (Eqs. 3, 5), entropy bonus (App. A.2), forward KL (App. A.4).
* Their closed-form stationary solutions: Eqs. 2, 4, 21, 27.
* ``maximize``: an objective's optimum over the simplex, found numerically (LBFGS on the
  logits, then Newton steps), so the closed forms are checked against something independent.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property

import torch

DTYPE = torch.float64


# --------------------------------------------------------------------------------------------
# The token tree
# --------------------------------------------------------------------------------------------


class TokenTree:
    """Every completion of a prompt, and an autoregressive policy over them by per-node logits.

    >>> tree = TokenTree([(0, 0), (0, 1), (1,)])      # two completions through "0", one of length 1
    >>> tree.nodes, tree.children
    ([(), (0,)], [[0, 1], [0, 1]])
    >>> theta = torch.zeros(tree.num_params, dtype=DTYPE)  # uniform at every node
    >>> tree.sequence_logps(theta).exp()
    tensor([0.2500, 0.2500, 0.5000], dtype=torch.float64)
    """

    def __init__(self, completions: Sequence[Sequence[int]]):
        self.completions = [tuple(int(t) for t in y) for y in completions]
        if len(set(self.completions)) != len(self.completions) or not all(self.completions):
            raise ValueError("completions must be distinct, non-empty token sequences")
        leaves = set(self.completions)
        prefixes = {y[:t] for y in self.completions for t in range(len(y))}
        if prefixes & leaves:
            raise ValueError(
                "a completion may not be a prefix of another (end it with an EOS token)"
            )
        self.nodes = sorted(prefixes, key=lambda s: (len(s), s))
        node_id = {s: i for i, s in enumerate(self.nodes)}
        next_tokens: dict[tuple, set] = {s: set() for s in self.nodes}
        for y in self.completions:  # one pass over the tokens, so large trees build fast
            for t in range(len(y)):
                next_tokens[y[:t]].add(y[t])
        self.children = [sorted(next_tokens[s]) for s in self.nodes]
        # Flat parameter layout: node i owns theta[offsets[i] : offsets[i] + len(children[i])].
        sizes = [len(c) for c in self.children]
        self.offsets = [0, *itertools.accumulate(sizes)][:-1]
        self.num_params = sum(sizes)
        self.node_of_param = torch.tensor([i for i, n in enumerate(sizes) for _ in range(n)])  # [P]

        num_completions, length = len(self.completions), max(len(y) for y in self.completions)
        self.lengths = torch.tensor([len(y) for y in self.completions])  # [B]
        self.completion_mask = torch.zeros(num_completions, length, dtype=DTYPE)  # [B, T]
        self.param_index = torch.zeros(num_completions, length, dtype=torch.long)  # [B, T]
        child_position = [{a: j for j, a in enumerate(c)} for c in self.children]
        for b, y in enumerate(self.completions):
            for t, token in enumerate(y):
                i = node_id[y[:t]]
                self.param_index[b, t] = self.offsets[i] + child_position[i][token]
                self.completion_mask[b, t] = 1.0
        self.node_id = node_id

    @cached_property
    def levels(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The nodes grouped by depth and number of children, deepest first, for solvers that go
        up the tree a level at a time: (node ids [N], their children's parameters [N, c], and
        what each child is [N, c]: a node's id, or -1 - the index of the completion it ends).

        >>> tree = TokenTree([(0, 0), (0, 1), (1,)])
        >>> [[part.tolist() for part in level] for level in tree.levels]
        [[[1], [[2, 3]], [[-1, -2]]], [[0], [[0, 1]], [[1, -3]]]]
        """
        completion_id = {y: b for b, y in enumerate(self.completions)}
        child = [
            self.node_id[s + (a,)] if s + (a,) in self.node_id else -1 - completion_id[s + (a,)]
            for s, children in zip(self.nodes, self.children)
            for a in children
        ]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (s, children) in enumerate(zip(self.nodes, self.children)):
            groups.setdefault((len(s), len(children)), []).append(i)
        found = []
        for (_, width), nodes in sorted(groups.items(), key=lambda item: -item[0][0]):
            params = torch.tensor([[self.offsets[i] + j for j in range(width)] for i in nodes])
            found.append((torch.tensor(nodes), params, torch.tensor(child)[params]))
        return found

    @property
    def shape(self) -> tuple[int, int]:
        """[B, T]: completions x longest completion, the layout of loss.py's per-token tensors."""
        return tuple(self.completion_mask.shape)

    def param_log_probs(self, theta: torch.Tensor) -> torch.Tensor:
        """log pi(a | s) for every (node s, child a) pair: a log-softmax within each node, over
        all nodes at once (each node's largest logit subtracted first, as log_softmax does). [P]

        >>> tree = TokenTree([(0, 0), (0, 1), (1,)])
        >>> tree.param_log_probs(torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=DTYPE)).exp()
        tensor([0.5000, 0.5000, 0.5000, 0.5000], dtype=torch.float64)
        """
        node = self.node_of_param  # [P]
        largest = torch.full((len(self.nodes),), -math.inf, dtype=theta.dtype)
        largest = largest.scatter_reduce(0, node, theta, reduce="amax")  # [num_nodes]
        shifted = theta - largest[node]
        totals = torch.zeros(len(self.nodes), dtype=theta.dtype).index_add(0, node, shifted.exp())
        return shifted - totals.log()[node]

    def token_logps(self, theta: torch.Tensor) -> torch.Tensor:
        """log pi(y_t | y_<t) of every completion's tokens, 0 on padding. [B, T]"""
        return self.param_log_probs(theta)[self.param_index] * self.completion_mask

    def sequence_logps(self, theta: torch.Tensor) -> torch.Tensor:
        """log pi(y) = sum_t log pi(y_t | y_<t). [B]"""
        return self.token_logps(theta).sum(dim=-1)

    def log_prob_gradient(self, theta: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
        """d/dtheta of sum_{b,t} token_weights[b, t] * log pi(y_t | y_<t), in closed form. [P]

        For the logit of child j at node s: sum of the weights on tokens that chose j, minus
        pi(j|s) times the sum of the weights on all tokens taken at s (the softmax's Jacobian).
        The same as autograd, without building a graph through the tree:

        >>> tree = TokenTree([(0, 0), (0, 1), (1,)])
        >>> theta = torch.tensor([0.2, -0.1, 0.3, 0.0], dtype=DTYPE, requires_grad=True)
        >>> weights = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]], dtype=DTYPE)
        >>> (auto,) = torch.autograd.grad((weights * tree.token_logps(theta)).sum(), theta)
        >>> torch.allclose(auto, tree.log_prob_gradient(theta.detach(), weights), atol=1e-15)
        True
        """
        weights = (token_weights * self.completion_mask).flatten()
        per_param = torch.zeros(self.num_params, dtype=DTYPE).index_add(
            0, self.param_index.flatten(), weights
        )
        per_node = torch.zeros(len(self.nodes), dtype=DTYPE).index_add(
            0, self.node_of_param, per_param
        )
        return per_param - self.param_log_probs(theta).exp() * per_node[self.node_of_param]

    def per_token(self, per_param: torch.Tensor) -> torch.Tensor:
        """Spread a per-(node, child) quantity [P] onto the completions' tokens [B, T], 0 on
        padding."""
        return per_param[self.param_index] * self.completion_mask

    def theta_from_node_probs(self, node_probs: Mapping[tuple, Sequence[float]]) -> torch.Tensor:
        """Logits [P] of the policy with the given next-token probabilities at every node.

        ``node_probs[prefix]`` lists the probabilities of that node's children in sorted token
        order; each list must sum to 1.
        """
        theta = torch.empty(self.num_params, dtype=DTYPE)
        for i, s in enumerate(self.nodes):
            probs = torch.as_tensor(node_probs[s], dtype=DTYPE)
            if probs.shape != (len(self.children[i]),) or abs(probs.sum().item() - 1.0) > 1e-12:
                raise ValueError(
                    f"node {s}: need {len(self.children[i])} probabilities summing to 1, "
                    f"got {probs}"
                )
            theta[self.offsets[i] : self.offsets[i] + len(probs)] = probs.log()
        return theta

    def node_entropies(self, theta: torch.Tensor) -> torch.Tensor:
        """H(s) = -sum_a pi(a|s) log pi(a|s) of every node, in nats (Eq. 12). [num_nodes]"""
        log_probs = self.param_log_probs(theta)
        terms = -(log_probs.exp() * log_probs)
        return torch.zeros(len(self.nodes), dtype=DTYPE).index_add(0, self.node_of_param, terms)

    def action_values(self, theta: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """Q(s, a) = E_pi[r(y) | y starts with s + (a,)] for every (node, child) pair. [P]

        The probability of completion y given its first t+1 tokens is
        exp(sum_{t' > t} log pi(y_t' | y_<t')), a reversed cumulative sum of its token log-probs.
        """
        token_logps = self.token_logps(theta)  # [B, T]
        later = token_logps.flip(-1).cumsum(-1).flip(-1) - token_logps  # sum over t' > t
        weights = later.exp() * rewards[:, None] * self.completion_mask  # [B, T]
        q_values = torch.zeros(self.num_params, dtype=DTYPE)
        return q_values.index_add(0, self.param_index.flatten(), weights.flatten())


# --------------------------------------------------------------------------------------------
# Objectives of a sequence distribution pi [B] (App. A), each to be maximized
# --------------------------------------------------------------------------------------------


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_y p log(p / q) for normalized p, q."""
    return (p * (p.log() - q.log())).sum()


def pseudo_kl(pi: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Eq. 5: D~(pi || p~) = sum_y pi log(pi / p~) - 1 + sum_y p~, for a positive unnormalized p~.

    It is >= 0, zero only at pi = p~ (which needs sum p~ = 1), and equals KL when p~ is normalized.

    >>> pi = torch.tensor([0.5, 0.5], dtype=DTYPE)
    >>> round(pseudo_kl(pi, 2 * pi).item(), 6)             # log(1/2) - 1 + 2 = 1 - log 2
    0.306853
    """
    return (pi * (pi.log() - anchor.log())).sum() - 1.0 + anchor.sum()


def reverse_kl_objective(pi, rewards, ref, beta):
    """Eq. 1: E_pi[r] - beta KL(pi || pi_ref)."""
    return (pi * rewards).sum() - beta * kl(pi, ref)


def sage_objective(pi, rewards, anchor, beta):
    """Eqs. 3, 5: E_pi[r] - beta D~(pi || p~), p~ = pi_ref * q unnormalized."""
    return (pi * rewards).sum() - beta * pseudo_kl(pi, anchor)


def entropy_bonus_objective(pi, rewards, ref, beta, alpha):
    """App. A.2, Eq. 19: E_pi[r] - beta KL(pi || pi_ref) + alpha H(pi)."""
    return reverse_kl_objective(pi, rewards, ref, beta) - alpha * (pi * pi.log()).sum()


def forward_kl_objective(pi, rewards, ref, beta):
    """App. A.4: E_pi[r] - beta KL(pi_ref || pi)."""
    return (pi * rewards).sum() - beta * kl(ref, pi)


# --------------------------------------------------------------------------------------------
# Closed-form stationary solutions
# --------------------------------------------------------------------------------------------


def eq2_reverse_kl_solution(ref, rewards, beta):
    """Eq. 2: pi*(y) ∝ pi_ref(y) exp(r(y) / beta)."""
    return torch.softmax(ref.log() + rewards / beta, dim=0)


def eq4_sage_solution(ref, q, rewards, beta):
    """Eq. 4: pi_q*(y) ∝ pi_ref(y) q(y) exp(r(y) / beta) (q of a completion = prod_t q_t, Eq. 7)."""
    return torch.softmax(ref.log() + q.log() + rewards / beta, dim=0)


def eq21_entropy_bonus_solution(ref, rewards, beta, alpha):
    """Eq. 21: pi ∝ pi_ref^(beta / (beta + alpha)) exp(r / (beta + alpha)): only a temperature."""
    return torch.softmax(beta / (beta + alpha) * ref.log() + rewards / (beta + alpha), dim=0)


def forward_kl_multiplier(anchor, rewards, beta, iterations: int = 200) -> torch.Tensor:
    """lambda of Eq. 27: the root of sum_y beta p(y) / (lambda - r(y)) = 1 with lambda > max r,
    over the last dimension (one lambda per row of [..., n] inputs: a tensor [...]).

    The sum falls from +inf (lambda -> max r) to at most 1 at lambda = max r + beta sum p, so
    bisection between those two points finds the unique root to the last bit.
    """
    low = rewards.amax(dim=-1)
    high = low + beta * anchor.sum(dim=-1)
    for _ in range(iterations):
        middle = 0.5 * (low + high)
        above = (beta * anchor / (middle[..., None] - rewards)).sum(dim=-1) > 1.0
        low, high = torch.where(above, middle, low), torch.where(above, high, middle)
    return high


def eq27_forward_kl_solution(anchor, rewards, beta):
    """Eq. 27: pi(y) = beta p(y) / (lambda - r(y)), lambda > max r fixed by sum_y pi(y) = 1 (over
    the last dimension: rows of [..., n] inputs are solved at once).

    ``anchor`` is pi_ref for the forward-KL objective; the same form with an unnormalized p~ is
    the fixed point of k3 in the loss (toy/checks.py, section d).

    >>> ref, rewards = torch.tensor([0.5, 0.5], dtype=DTYPE), torch.tensor([1.0, 0.0], dtype=DTYPE)
    >>> pi = eq27_forward_kl_solution(ref, rewards, beta=1.0)
    >>> [round(v, 6) for v in pi.tolist()]                 # lambda = 1 + 1/sqrt(2)
    [0.707107, 0.292893]
    """
    lam = forward_kl_multiplier(anchor, rewards, beta)
    return beta * anchor / (lam[..., None] - rewards)


# --------------------------------------------------------------------------------------------
# Numerical maximization over the simplex (independent of the closed forms)
# --------------------------------------------------------------------------------------------


def maximize(
    objective: Callable[[torch.Tensor], torch.Tensor], theta0: torch.Tensor, max_steps: int = 100
):
    """argmax_theta objective(theta) by damped, saddle-free Newton steps on the logits.

    Each step solves with |H| (the Hessian's eigenvalues made positive), so it always ascends;
    the eigen-directions with eigenvalue ~0 are each node's flat direction (adding a constant to
    a node's logits changes nothing) and are left alone. Steps are capped at 1 per logit and
    halved until the objective rises (Armijo); near the optimum, where the objective is flat to
    rounding, a step is kept when it lowers the gradient. (torch.optim is not used: importing it
    pulls in torch._dynamo, seconds of start-up for a problem that takes milliseconds.)
    Returns (theta, gradient infinity-norm at theta).
    """

    def negative(t):
        return -objective(t)

    def gradient_of(t):
        return torch.autograd.functional.jacobian(negative, t)

    theta = theta0.detach().clone().to(DTYPE)
    gradient = gradient_of(theta)
    for _ in range(max_steps):
        if gradient.abs().max() < 1e-14:
            break
        eigenvalues, eigenvectors = torch.linalg.eigh(
            torch.autograd.functional.hessian(negative, theta)
        )
        scale = eigenvalues.abs().max().clamp_min(1e-300)
        flat = eigenvalues.abs() <= 1e-12 * scale  # a node's shift direction
        inverse = torch.where(flat, torch.zeros_like(eigenvalues), 1.0 / eigenvalues.abs())
        step = -eigenvectors @ (inverse * (eigenvectors.T @ gradient))
        step = step * min(1.0, 1.0 / step.abs().max().item())
        value, slope = negative(theta).item(), (gradient * step).sum().item()
        for size in (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125):
            candidate = theta + size * step
            if negative(candidate).item() <= value + 1e-4 * size * slope:
                break
        else:
            candidate = theta + step
        candidate_gradient = gradient_of(candidate)
        if (
            negative(candidate).item() > value
            and candidate_gradient.abs().max() >= gradient.abs().max()
        ):
            break  # neither higher nor flatter: converged to rounding
        theta, gradient = candidate, candidate_gradient
    return theta, gradient.abs().max().item()
