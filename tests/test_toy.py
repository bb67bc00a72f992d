"""toy/: exact checks of SAGE's theory and of loss.py's estimators on small discrete distributions.

Each registered check is one test case (its rows are claims such as "k3 in the loss reaches the
forward-KL fixed point"); each check runs once, and the sections' coverage reads the rows those
cases made. The CLI is run as a subprocess, as a user would, on one check: the rows it prints are
the ones ``run_checks`` makes, and every check's rows are held above.
"""

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import toy
from toy.__main__ import main
from toy.checks import Result

REPO = Path(__file__).resolve().parents[1]

# The sections a-e of toy/__init__.py, by the row names that prove each item.
REQUIRED_ROWS = {
    "a": [
        "eq2_reverse_kl_optimum_simplex",
        "eq4_sage_optimum_simplex",
        "eq4_sage_optimum_token_tree",
    ],
    "b": [
        "eq21_entropy_bonus_optimum_simplex",
        "eq27_forward_kl_optimum_simplex",
        "eq28_29_sage_is_reweighted_forward_kl",
        "eq31_sage_less_off_target_mass_than_forward_kl",
    ],
    "c": [
        "thm4.3_y2_outside_supp_delta_pi_rl",
        "thm4.3_condition_holds_for_branch_guide",
        "thm4.3_branch_guide_support_expansion",
    ],
    "d": [
        "k2_in_loss_reaches_eq4_one_token",
        "k1_return_reaches_eq4_one_token",
        "k3_in_loss_reaches_forward_kl_fixed_point",
        "k1_return_reaches_eq4_two_token_tree",
        "k2_in_loss_misses_eq4_two_token_tree",
        "k2_in_loss_position_constant_q_cancels",
        "k1_return_fixed_branch_guide_lifts_y2_into_supp_delta",
        "k3_fixed_branch_guide_lowers_y2",
        "per_token_penalties_put_y2_in_supp_delta_without_a_guide",
        "table_gradient_norms_at_reported_points",
        "self_consistent_branch_guide_is_inactive_at_every_fixed_point",
        "table_points_are_stationary_at_every_node",
        "newton_on_policy_loss_finds_the_backward_induction_points",
        "table_points_attract_gradient_descent",
        "self_consistent_branch_guide_is_unique",
        "group_advantages_move_the_table_to_beta_over_delta",
        "group_advantages_k3_and_forward_fixed_branch_guide_lowers_y2",
    ],
    "e": ["k3_expectation_equals_kl_plus_offset", "bnpo_alpha_beta_3_2_proportional_to_grpo_std"],
}


@functools.cache
def rows_of(check) -> list[Result]:
    """A check's rows, made once per session (the coverage test reads every check's)."""
    return check()


@pytest.mark.parametrize("check", toy.CHECKS, ids=[c.__name__ for c in toy.CHECKS])
def test_check_holds(check):
    rows = rows_of(check)
    assert rows, f"{check.__name__} returned no rows"
    failed = [
        f"{r.name}: {r.quantity}: {r.max_abs_error:.3e} is not {r.relation} {r.tolerance:.0e}"
        for r in rows
        if not r.passed
    ]
    assert not failed, "\n".join(failed)


def test_result_semantics():
    assert Result("x", "a", "error", 1e-9, 1e-6).passed
    assert not Result("x", "a", "error", 1e-3, 1e-6).passed
    assert Result("x", "a", "gap", 0.1, 1e-3, ">").passed
    assert not Result("x", "a", "gap", 1e-4, 1e-3, ">").passed
    assert not Result("x", "a", "error", float("nan"), 1e-6).passed


def test_cli_exit_code_follows_failures(capsys):
    def failing_check():
        return [Result("always_fails", "a", "1 vs 0", 1.0, 0.5)]

    assert main(["--json"], checks=[failing_check]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert rows == [
        {
            "name": "always_fails",
            "section": "a",
            "quantity": "1 vs 0",
            "max_abs_error": 1.0,
            "tolerance": 0.5,
            "relation": "<=",
            "passed": False,
        }
    ]
    assert main([], checks=[failing_check]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_the_checks_cover_sections_a_to_e_with_unique_row_names():
    rows = [row for check in toy.CHECKS for row in rows_of(check)]
    names = {row.name for row in rows}
    for section, required in REQUIRED_ROWS.items():
        missing = [n for n in required if n not in names]
        assert not missing, f"section {section} of toy/__init__.py is not covered: {missing}"
    assert len(names) == len(rows), "row names must be unique"


def test_cli_json_prints_the_rows_of_the_checks_it_runs():
    """``python -m toy --json --only ...`` as a process: exit 0 and exactly the rows that check
    makes in-process, as JSON objects (the checks are deterministic: float64, fixed seeds)."""
    check = toy.CHECKS[0]
    proc = subprocess.run(
        [sys.executable, "-m", "toy", "--json", "--only", check.__name__],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    for row in rows:
        assert {"name", "max_abs_error", "tolerance", "passed"} <= row.keys()
    assert [row["name"] for row in rows] == [row.name for row in rows_of(check)]
    assert all(row["passed"] for row in rows)


def test_the_estimator_table_prints_every_estimator_with_tiny_gradients(capsys):
    assert main(["--table"]) == 0
    text = capsys.readouterr().out
    for estimator in ("k1_return", "k2", "k3", "ratio_k3", "forward", "Eq. 2 / 4"):
        assert estimator in text
    from toy import table

    rows = table.estimator_table()
    assert [row.estimator for row in rows] == list(table.ESTIMATORS)
    assert all(set(row.gradient) == set(table.GUIDES) for row in rows)
    assert all(norm <= 1e-8 for row in rows for norm in row.gradient.values())


def test_the_estimator_table_orderings():
    """The App. C orderings, read off the table itself (the checks assert them with margins too)."""
    from toy import table

    pi = {row.estimator: row.pi_y2 for row in table.estimator_table()}
    delta = table.DELTA
    # k1 in the return: Theorem 4.3 with q fixed at pi_ref's entropies; no lift once q is the
    # policy's own.
    assert pi["k1_return"]["none"] < delta < pi["k1_return"]["fixed"]
    assert pi["k1_return"]["self"] == pytest.approx(pi["k1_return"]["none"], abs=1e-12)
    # k2 and ratio_k3: the branch guide changes nothing, and y2 sits at pi_ref's 0.1 of the branch.
    for name in ("k2", "ratio_k3"):
        assert pi[name]["fixed"] == pytest.approx(pi[name]["none"], abs=1e-12)
        assert pi[name]["self"] == pytest.approx(pi[name]["none"], abs=1e-12)
        assert pi[name]["none"] == pytest.approx(0.1, abs=1e-6)
    # k3 (the paper's) and the forward baseline: the fixed guide lowers y2; the self-consistent one
    # is inactive.
    for name in ("k3", "forward"):
        assert pi[name]["fixed"] < pi[name]["none"] - 1e-3
        assert pi[name]["self"] == pytest.approx(pi[name]["none"], abs=1e-12)
    # Every per-token penalty: y2 above delta with no guide at all; ordered
    # k2 = ratio_k3 > k3 > forward.
    assert delta < pi["forward"]["none"] < pi["k3"]["none"] < pi["k2"]["none"]


def test_the_orderings_survive_a_groups_advantage():
    """Dr. GRPO's group mean and GRPO's std (G = 8) move the per-token points (beta / Delta_G),
    not the orderings."""
    from toy import table

    for advantage, rows in table.advantage_table().items():
        betas = {beta for row in rows.values() for beta, _ in row.values()}
        if advantage == "dr_grpo":
            assert all(beta == pytest.approx(table.BETA * 8 / 7, rel=1e-12) for beta in betas)
        else:  # GRPO's std: Delta_8(p) ~ 2.47 at these success rates near 1
            assert all(0.020 < beta < 0.021 for beta in betas)
        pi = {
            estimator: {guide: pi_y2 for guide, (_, pi_y2) in row.items()}
            for estimator, row in rows.items()
        }
        for name in ("k2", "ratio_k3"):
            assert pi[name]["fixed"] == pytest.approx(pi[name]["none"], abs=1e-12)
        for name in ("k3", "forward"):
            assert pi[name]["fixed"] < pi[name]["none"] - 1e-3
        assert table.DELTA < min(row["none"] for row in pi.values())


def per_node_fixed_point(tree, ref_theta, rewards, log_q_param, estimator, beta):
    """toy.backward.fixed_point as derived, one node at a time (the slow path it replaced)."""
    from toy import backward

    anchors = (tree.param_log_probs(ref_theta) + log_q_param).exp()
    leaf_value = dict(zip(tree.completions, rewards.tolist()))
    value, theta = {}, torch.empty(tree.num_params, dtype=torch.float64)
    for i in sorted(range(len(tree.nodes)), key=lambda i: -len(tree.nodes[i])):
        s, children, offset = tree.nodes[i], tree.children[i], tree.offsets[i]
        node = slice(offset, offset + len(children))
        q_values = torch.tensor(
            [leaf_value.get(s + (a,), value.get(s + (a,))) for a in children], dtype=torch.float64
        )
        if estimator == "k1_return":
            logits = anchors[node].log() + q_values / beta
            probs, value[s] = torch.softmax(logits, 0), beta * torch.logsumexp(logits, 0).item()
        else:
            probs = backward.node_solution(anchors[node], q_values, beta, estimator)
            value[s] = (probs * q_values).sum().item()
        theta[node] = probs.log()
    return theta


@pytest.mark.parametrize("k, m", [(2, 4), (3, 5)])
@pytest.mark.parametrize("estimator", ["k1_return", "k2", "k3"])
def test_the_level_by_level_solver_equals_the_per_node_one(k, m, estimator):
    from extras import demo, two_mode
    from toy import backward

    task_tree = two_mode.TaskTree(two_mode.TwoModeTask(k=k, m=m), demo.build_tiny_tokenizer())
    tree, generator = task_tree.tree, torch.Generator().manual_seed(k)
    ref = torch.randn(tree.num_params, generator=generator, dtype=torch.float64)
    log_q = 0.3 * torch.rand(tree.num_params, generator=generator, dtype=torch.float64)
    fast = backward.fixed_point(tree, ref, task_tree.rewards, log_q, estimator, beta=0.05)
    slow = per_node_fixed_point(tree, ref, task_tree.rewards, log_q, estimator, beta=0.05)
    assert (tree.param_log_probs(fast) - tree.param_log_probs(slow)).abs().max() < 1e-10


def tail_tree(lumped: bool):
    """A mode (A = 0, B = 1) then one digit and EOS (9); A's digit 0 is right, every B digit is;
    at the root and after B, tokens the sampler never draws (7, 8: reward-0 leaves), lumped into
    one (7) or not. Returns (tree, pi_ref's logits, rewards, tail [P], inside [P])."""
    from toy.exact import TokenTree

    tail_tokens = {(): {7: 0.01, 8: 0.02}, (1,): {7: 0.03, 8: 0.01}}
    kept = {(): {0: 0.91, 1: 0.06}, (0,): {2: 0.97, 3: 0.03}, (1,): {a: 0.24 for a in (2, 3, 4, 5)}}
    probs = {s: dict(kept[s]) for s in kept}
    for s, tokens in tail_tokens.items():
        probs[s].update({7: sum(tokens.values())} if lumped else tokens)
    completions = [s + (a,) + ((9,) if a < 7 and s else ()) for s in probs for a in probs[s]]
    completions = [y for y in completions if len(y) > 1 or y[0] >= 7]  # not the modes alone
    tree = TokenTree(completions)
    node_probs = {
        s: [probs[s][a] if s in probs else 1.0 for a in c]
        for s, c in zip(tree.nodes, tree.children)
    }
    theta = tree.theta_from_node_probs(node_probs)
    rewards = torch.tensor(
        [float(y[-1] == 9 and (y[0] == 1 or y[1] == 2)) for y in tree.completions],
        dtype=torch.float64,
    )
    tail = torch.zeros(tree.num_params, dtype=torch.float64)
    inside = torch.zeros(tree.num_params, dtype=torch.float64)
    for s, tokens in tail_tokens.items():
        i, mass = tree.node_id[s], sum(tokens.values())
        for j, a in enumerate(tree.children[i]):
            if a >= 7:
                tail[tree.offsets[i] + j] = mass if lumped else tokens[a]
                if lumped:
                    inside[tree.offsets[i] + j] = -sum(
                        p / mass * math.log(p / mass) for p in tokens.values()
                    )
    return tree, theta, rewards, tail, inside


def test_the_sampler_fixed_point_is_stationary_for_the_trainer_and_its_tail_is_free():
    """Brute force on a tree with explicit tail tokens: with rollouts drawn from the sampler (the
    tail cut, the rest renormalized) and the loss's log-probs and the guide's entropies on the full
    softmax, the k1_return gradient Cov(R, grad log pi(y)) vanishes on every logit, the tail's
    included, at backward.self_consistent_fixed_point with the tail held; q is Eq. 11 of the
    full entropies there; and lumping the tail into one child with its inner entropy changes
    nothing."""
    import guides
    from toy import backward

    branch, beta = guides.GuideConfig(name="branch"), 0.05
    tree, ref, rewards, tail, _ = tail_tree(lumped=False)
    theta, log_q = backward.self_consistent_fixed_point(
        tree, ref, rewards, "k1_return", beta, branch, tail=tail, min_p=0.01
    )
    # A's wrong digit (0.03) leaves the support at min-p's threshold and is held there too
    again, held = backward.sampler_fixed_point(tree, ref, rewards, log_q, beta, tail, min_p=0.01)
    assert torch.equal(again, theta) and (held > tail).sum() == 1
    tail, log_probs = held, tree.param_log_probs(theta)
    assert torch.allclose(log_probs.exp()[tail > 0], tail[tail > 0], atol=1e-15)
    assert (log_q - backward.branch_log_q_param(tree, theta, branch)).abs().max() < 1e-13
    # the sampler's distribution over completions: kept children renormalized per node
    kept_mass = torch.zeros(len(tree.nodes), dtype=torch.float64).index_add(
        0, tree.node_of_param, log_probs.exp() * (tail == 0)
    )
    sampler = torch.where(tail == 0, log_probs - kept_mass.log()[tree.node_of_param], -math.inf)
    sampled = (sampler[tree.param_index] * tree.completion_mask).sum(-1).exp()  # [B]
    returns = rewards - beta * tree.per_token(log_probs - tree.param_log_probs(ref) - log_q).sum(-1)
    mean = (sampled * returns).sum()
    weights = (sampled * (returns - mean))[:, None] * tree.completion_mask
    gradient = tree.log_prob_gradient(theta, torch.nan_to_num(weights))
    assert gradient.abs().max() < 1e-12
    assert returns[sampled > 0].std() < 1e-12  # the shaped return is constant on the support
    # the lumped tail with its inner entropy: the same pi(B)
    lumped, lumped_ref, lumped_rewards, lumped_tail, inside = tail_tree(lumped=True)
    lumped_theta, _ = backward.self_consistent_fixed_point(
        *(lumped, lumped_ref, lumped_rewards, "k1_return", beta, branch),
        **{"tail": lumped_tail, "min_p": 0.01, "inside": inside},
    )
    b = lumped.offsets[0] + lumped.children[0].index(1)
    assert (
        abs(lumped.param_log_probs(lumped_theta)[b] - log_probs[tree.children[0].index(1)]) < 1e-12
    )


@pytest.mark.parametrize("sigma", [0.0, 0.25])
def test_the_token_guide_fixed_point_is_stationary_with_q_read_from_its_own_surprisals(sigma):
    """backward.token_guide_fixed_point on the two-mode tree (K = 2, M = 4, a random pi_ref): q
    recomputed there by the trainer's own pieces (guides.token_guide's w, averaged over its noise
    by sampling) equals the solver's q(y) to Monte Carlo's error; the return shaped with it, r +
    beta log q - beta log pi / pi_ref, is one constant over the completions (Eq. 4, so the
    k1_return gradient vanishes); with alpha = sigma = 0 it is the unguided fixed point, which the
    guide moves."""
    import guides
    from extras import demo, two_mode
    from toy import backward

    task_tree = two_mode.TaskTree(two_mode.TwoModeTask(k=2, m=4), demo.build_tiny_tokenizer())
    tree, rewards, beta = task_tree.tree, task_tree.rewards, 0.5
    ref = torch.randn(
        tree.num_params, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    config = guides.GuideConfig(name="token")
    theta, log_q = backward.token_guide_fixed_point(
        tree, ref, rewards, beta, config, alpha=0.3, sigma=sigma
    )
    draws = 4000 if sigma > 0 else 1
    logps = tree.token_logps(theta).repeat(draws, 1)  # [draws * B, T]
    mask = tree.completion_mask.repeat(draws, 1)
    generator = torch.Generator().manual_seed(0)
    q = guides.token_guide(logps, mask, 0.3, sigma, "percentile", generator).clamp(0.6, 1.4)
    sampled = (q.log() * mask).sum(-1).view(draws, -1)  # [draws, B]
    error = sampled.std(0) / math.sqrt(draws) if sigma > 0 else torch.zeros_like(log_q)
    assert ((sampled.mean(0) - log_q).abs() <= 4 * error + 1e-12).all()
    shaped = rewards + beta * log_q - beta * (tree.sequence_logps(theta) - tree.sequence_logps(ref))
    assert shaped.std() < 1e-10
    unguided = backward.fixed_point(
        tree, ref, rewards, torch.zeros_like(ref), "k1_return", beta=beta
    )
    plain, _ = backward.token_guide_fixed_point(tree, ref, rewards, beta, config, 0.0, 0.0)
    assert (tree.param_log_probs(plain) - tree.param_log_probs(unguided)).abs().max() < 1e-12
    assert (tree.param_log_probs(theta) - tree.param_log_probs(unguided)).abs().max() > 0.05


def test_the_token_guides_mean_log_q_is_the_sampled_mean():
    """backward.expected_log_q (normal CDF for the clamps, quadrature between) against 200,000
    draws of log clamp(1 + alpha w + sigma w xi), at w where the clamp binds and where it does
    not."""
    from toy import backward

    w = torch.tensor([0.0, 0.2, 0.7, 1.0], dtype=torch.float64)
    exact = backward.expected_log_q(w, alpha=0.3, sigma=0.25, q_min=0.6, q_max=1.4)
    xi = torch.randn(200_000, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    draws = (1.0 + 0.3 * w + 0.25 * w * xi).clamp(0.6, 1.4).log()  # [n, 4]
    standard_error = draws.std(0) / math.sqrt(len(xi))
    assert ((draws.mean(0) - exact).abs() <= 4 * standard_error + 1e-15).all()
    assert exact[0] == 0.0 and exact[3] < math.log(1.3)  # no noise at w = 0; Jensen and the clamp
