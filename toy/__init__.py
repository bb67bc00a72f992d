"""toy: exact checks of SAGE's theory, and of our estimators, on small discrete distributions.

SAGE's claims are statements about distributions: the optimum of a KL-regularized objective
(Eqs. 2, 4, 21, 27), how two optima compare (Eqs. 23-24, 28-31, Theorem 4.3), and -- the part a
trainer can get wrong -- where a per-token loss built from sampled log-probs actually converges.
All of them can be decided exactly when the completions of a prompt are few enough to list: a
*token tree* (``toy.exact.TokenTree``) holds every completion, an autoregressive policy is one
logit vector per node, and every expectation is a finite sum in float64. No sampling, no noise:
an error of 1e-10 is a proof up to rounding, not a statistical hint.

What is checked (``python -m toy`` prints one row per claim, in five sections a-e):

a. The closed forms of Eqs. 2 and 4 are the maximizers of Eqs. 1 and 3, found numerically over
   the simplex and over a two-token tree with a token-level q; Eq. 8's "reverse KL + guide
   bonus" form has the same optimum.
b. The same for the entropy bonus (Eq. 21) and forward KL (Eq. 27); SAGE equals forward KL
   reweighted by w (Eqs. 28-29), and under the separation condition (30) it puts less mass
   off-target (31) -- a counterexample shows the condition is needed.
c. Theorem 4.3 on an App. C-style example whose guide is computed by our code
   (the trainer's log-prob kernel then ``guides.compute_log_q``, branch, defaults): a rare
   correct completion outside supp_delta(pi_RL) enters supp_delta(pi_q*).
d. The fixed points of ``loss.policy_loss`` with each estimator, found by iterating its exact
   expected gradient (``toy.fixed_points``): which estimator realizes Eq. 4 (k1 in the return,
   always; k2 and ratio_k3 only on one-token completions), what k3 in the loss realizes instead
   (a forward-KL fixed point), why a position-constant guide cancels under per-token k2, how
   advantage normalization (RLOO, Dr. GRPO, GRPO's std) moves the fixed point of an in-loss
   penalty but not of k1 in the return, whether the forward-KL baseline reaches Eq. 27, and
   Theorem 4.3 under each estimator (``python -m toy --table``, toy/table.py, docs/fixed-points.md):
   fixed points found by backward induction over the tree (``toy.backward``), then held to
   loss.py's expected gradient node by node, to Newton's method on it, and to a stability test;
   and how a group's advantage (Dr. GRPO's mean, GRPO's std) moves those points without changing
   their orderings, held to loss.py's gradient with every group enumerated.
e. The value of k3 (E[k3] = KL + Z - 1 - log Z, the offset policy_loss logs) and BNPO with
   alpha = beta = 3/2 being GRPO's std up to a constant.

Why the estimator checks matter: the paper's objective is Eq. 3, but its code puts Schulman's k3
in the loss, whose gradient is that of the *forward* divergence; and on multi-token completions
a per-token penalty sees only the reward to go, not the KL of later tokens. Only the sequence
return r - beta sum_t log(pi_t / p~_t) with a score-function gradient reaches Eq. 4 exactly.

Modules: ``exact`` (trees, objectives, closed forms, a numerical maximizer), ``problems`` (the
fixed small examples), ``fixed_points`` (expected gradients of loss.py and a root finder),
``backward`` (each estimator's fixed point by per-node conditions, without loss.py), ``table``
(the App. C table), ``checks`` (the registry ``CHECKS``; each function returns ``Result`` rows).
"""

from toy.checks import CHECKS, Result, run_checks

__all__ = ["CHECKS", "Result", "run_checks"]
