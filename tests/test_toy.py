"""toy/: exact checks of SAGE's theory and of loss.py's estimators on small discrete distributions.

Each registered check is one test case (its rows are claims such as "k3 in the loss reaches the
forward-KL fixed point"); the CLI is run once as a subprocess, as a user would.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("check", toy.CHECKS, ids=[c.__name__ for c in toy.CHECKS])
def test_check_holds(check):
    rows = check()
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


@pytest.mark.slow
def test_cli_json_passes_and_covers_a_to_e():
    proc = subprocess.run(
        [sys.executable, "-m", "toy", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = json.loads(proc.stdout)
    failed = [r["name"] for r in rows if not r["passed"]]
    assert proc.returncode == 0, f"python -m toy failed: {failed}\n{proc.stderr[-2000:]}"
    for row in rows:
        assert {"name", "max_abs_error", "tolerance", "passed"} <= row.keys()
    names = {r["name"] for r in rows}
    for section, required in REQUIRED_ROWS.items():
        missing = [n for n in required if n not in names]
        assert not missing, f"section {section} of toy/__init__.py is not covered: {missing}"
    assert len(names) == len(rows), "row names must be unique"


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
