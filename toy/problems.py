"""The small problems the checks are run on: a reference policy, rewards and a guide on a tree.

Numbers are arbitrary but fixed (no random draws): rewards are binary as in RLVR, q_t lies in the
guide's clamp [0.6, 1.4], and beta is large enough (0.5) that the fixed points of different
estimators are far apart compared with the solvers' precision. Each problem is small enough to
enumerate every completion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toy.exact import DTYPE, TokenTree


@dataclass(frozen=True)
class Problem:
    """One prompt: its completions, pi_ref, r(y) and a guide q_t(s, a) >= 0 on every (node,
    child)."""

    tree: TokenTree
    ref_theta: torch.Tensor  # [P] logits of pi_ref at every node
    rewards: torch.Tensor  # [B] r(y) in {0, 1}
    log_q_param: torch.Tensor  # [P] log q(s, a) of each (node, child); 0 = no guide

    @property
    def ref_logps(self) -> torch.Tensor:
        """[B, T] log pi_ref(y_t | y_<t), 0 on padding."""
        return self.tree.token_logps(self.ref_theta)

    @property
    def log_q(self) -> torch.Tensor:
        """[B, T] log q_t (Eq. 7's factors), 0 on padding -- what ``guides.compute_log_q``
        returns."""
        return self.tree.per_token(self.log_q_param)

    @property
    def ref(self) -> torch.Tensor:
        """[B] pi_ref(y)."""
        return self.ref_logps.sum(dim=-1).exp()

    @property
    def q(self) -> torch.Tensor:
        """[B] q(y) = prod_t q_t (Eq. 7)."""
        return self.log_q.sum(dim=-1).exp()

    @property
    def anchor(self) -> torch.Tensor:
        """[B] p~(y) = pi_ref(y) q(y), unnormalized (Eq. 5)."""
        return self.ref * self.q

    def with_log_q(self, log_q_param: torch.Tensor) -> Problem:
        return Problem(self.tree, self.ref_theta, self.rewards, log_q_param)


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=DTYPE)


def per_node_values(tree: TokenTree, values: dict[tuple, list[float]]) -> torch.Tensor:
    """Flatten {prefix: [value of each child]} into the tree's [P] layout."""
    flat = torch.empty(tree.num_params, dtype=DTYPE)
    for i, s in enumerate(tree.nodes):
        flat[tree.offsets[i] : tree.offsets[i] + len(tree.children[i])] = tensor(values[s])
    return flat


def bandit() -> Problem:
    """Single-token completions: 5 outcomes, two of them correct, a token-dependent q."""
    tree = TokenTree([(k,) for k in range(5)])
    ref = tensor([0.35, 0.25, 0.20, 0.12, 0.08])
    rewards = tensor([0.0, 1.0, 0.0, 1.0, 0.0])
    q = tensor([1.0, 0.8, 1.3, 1.4, 0.6])
    return Problem(tree, ref.log(), rewards, q.log())


def small_bandit() -> Problem:
    """Three outcomes, one correct: small enough to enumerate every group of G = 8 rollouts."""
    tree = TokenTree([(k,) for k in range(3)])
    ref = tensor([0.5, 0.3, 0.2])
    rewards = tensor([0.0, 1.0, 0.0])
    q = tensor([0.9, 1.3, 0.7])
    return Problem(tree, ref.log(), rewards, q.log())


TWO_TOKEN_REF = {
    (): [0.5, 0.3, 0.2],
    (0,): [0.6, 0.3, 0.1],
    (1,): [0.2, 0.5, 0.3],
    (2,): [0.4, 0.4, 0.2],
}
TWO_TOKEN_CORRECT = {(0, 1), (1, 0), (1, 2), (2, 2)}
# A token-level guide: q_t depends on the token (as the token guide of Eq. 10 does).
TWO_TOKEN_Q_TOKEN_LEVEL = {
    (): [1.2, 0.7, 1.0],
    (0,): [0.9, 1.4, 0.6],
    (1,): [1.1, 0.8, 1.3],
    (2,): [0.6, 1.0, 1.2],
}
# A position-constant guide: one q per node, whatever the token (as the branch and random guides
# of Eqs. 9 and 11 give: they depend on the prefix, not on the token).
TWO_TOKEN_Q_PER_POSITION = {(): 1.3, (0,): 0.7, (1,): 1.4, (2,): 0.9}


def two_token_tree(guide: str = "token") -> Problem:
    """Three tokens at each of two positions (9 completions, 4 correct); the guide is
    token | position | none."""
    tree = TokenTree([(a, b) for a in range(3) for b in range(3)])
    rewards = tensor([1.0 if y in TWO_TOKEN_CORRECT else 0.0 for y in tree.completions])
    if guide == "token":
        q = per_node_values(tree, TWO_TOKEN_Q_TOKEN_LEVEL)
    elif guide == "position":
        q = per_node_values(tree, {s: [v] * 3 for s, v in TWO_TOKEN_Q_PER_POSITION.items()})
    elif guide == "none":
        q = torch.ones(tree.num_params, dtype=DTYPE)
    else:
        raise ValueError(f"unknown guide {guide!r}: choose token, position or none")
    return Problem(tree, tree.theta_from_node_probs(TWO_TOKEN_REF), rewards, q.log())


def unequal_lengths_tree() -> Problem:
    """Completions of lengths 1 and 2 (a short answer beside longer ones), token-level q."""
    tree = TokenTree([(0, 0), (0, 1), (1,), (2, 0), (2, 1)])
    ref_theta = tree.theta_from_node_probs(
        {(): [0.4, 0.35, 0.25], (0,): [0.7, 0.3], (2,): [0.5, 0.5]}
    )
    rewards = tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    q = per_node_values(tree, {(): [1.1, 0.8, 1.3], (0,): [1.2, 0.9], (2,): [0.7, 1.4]})
    return Problem(tree, ref_theta, rewards, q.log())


APPENDIX_C_BRANCHES = 12  # near-even alternatives at y2's branching node: entropy ~2.48 nats > tau


def appendix_c_tree() -> Problem:
    """Theorem 4.3's setting (App. C): a frequent solution y1 and a rare one y2 behind a branch.

    Token 0 then 0 is y1: a likely first step (0.9) and a near-certain continuation (0.97), both
    low-entropy. Token 1 is a rare first step (0.1) into a branching node with 12 near-even
    alternatives; y2 = (1, 0) takes one of them (0.08). Every other completion is wrong. The
    guide is not set here: the check computes it with ``guides.compute_log_q`` (branch, Eq. 11).

    The paper's App. C lets y1 and y2 share their first position; a branch guide's q_t depends on
    the position only, so a shared high-entropy position would scale both alike and cancel.
    Here the high-entropy position is one that only y2 reaches.
    """
    branches = APPENDIX_C_BRANCHES
    tree = TokenTree([(0, 0), (0, 1)] + [(1, k) for k in range(branches)])
    ref_theta = tree.theta_from_node_probs(
        {
            (): [0.9, 0.1],
            (0,): [0.97, 0.03],
            (1,): [0.08] + [0.92 / (branches - 1)] * (branches - 1),
        }
    )
    rewards = tensor([1.0 if y in {(0, 0), (1, 0)} else 0.0 for y in tree.completions])
    return Problem(tree, ref_theta, rewards, torch.zeros(tree.num_params, dtype=DTYPE))
