"""extras/two_mode.py: the task's reward, its SFT data, and the exact prediction, which on the
task's ideal distribution must reduce to Eq. 4's closed form (and k3's lift to 0)."""

import gzip
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from extras import demo, two_mode
from extras.compare import SUBPROCESS_ENV
from task.grading import load_reward_function

TASK = two_mode.TwoModeTask(k=2, m=8)


def test_the_reward_reads_the_task_from_the_answer_field():
    reward = load_reward_function("extras.two_mode:reward")
    completions = ["A00", "A01", "B71", "B81", "B7", "A00 ", "hello"]
    assert reward(completions, [""] * 7, [TASK.answer] * 7) == [1, 0, 1, 0, 0, 1, 0]
    with pytest.raises(ValueError, match="k=K m=M"):
        two_mode.reward(["A00"], [""], ["12"])


def test_the_sft_data_is_drawn_from_the_task():
    examples = two_mode.sft_examples(two_mode.TwoModeTask(k=3, m=10), count=4000, seed=0)
    modes = [example["completion"][0] for example in examples]
    assert abs(modes.count("B") / len(modes) - 0.05) < 0.015
    a_digits = [d for e in examples if e["completion"][0] == "A" for d in e["completion"][1:]]
    assert abs(a_digits.count("1") / len(a_digits) - 0.03) < 0.01
    assert {e["problem"] for e in examples} == set(two_mode.PHRASINGS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--k", "9"], "K must be in [1, 6]"),
        (["--arms", "k4"], "unknown --arms k4"),
        (["--beta", "0"], "--beta and --lr must be > 0"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--judge-at", "-5"], "--judge-at -5: pass a step >= 1"),
        (["--judge-at", "400", "--token-tail-check"], "two readings of a study: pass one"),
        (["--out", "/no/such", "--judge-at", "400"], "no /no/such/summary.json: this reads a"),
        (["--out", "/no/such", "--token-tail-check"], "no /no/such/seed-1000/prediction.json"),
    ],
)
def test_the_study_refuses_bad_settings_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        two_mode.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


class IdealModel(torch.nn.Module):
    """Next-token logits of the task's own distribution after a one-token prompt: the mode (B
    with p_b), A's digits (0 with p_right), B's digits uniform over M, then EOS; nothing else."""

    def __init__(self, tokenizer, task):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.task, self.vocab = task, len(tokenizer)
        self.ids = {
            text: tokenizer(text, add_special_tokens=False)["input_ids"][0]
            for text in ["A", "B", *map(str, range(10))]
        }
        self.eos = tokenizer.eos_token_id

    def next_probs(self, prefix: list[int]) -> dict[int, float]:
        ids, task = self.ids, self.task
        if not prefix:
            return {ids["A"]: 1 - task.p_b, ids["B"]: task.p_b}
        if len(prefix) == task.k + 1:
            return {self.eos: 1.0}
        if prefix[0] == ids["A"]:
            return {ids["0"]: task.p_right, ids["1"]: 1 - task.p_right}
        return {ids[str(d)]: 1 / task.m for d in range(task.m)}

    def forward(self, input_ids):
        logits = torch.full((*input_ids.shape, self.vocab), -1e4, dtype=torch.float64)
        for row, sequence in enumerate(input_ids.tolist()):
            for token, p in self.next_probs(sequence[1:]).items():
                logits[row, -1, token] = math.log(p)
        return SimpleNamespace(logits=logits)


def test_the_prediction_is_eq4s_closed_form_on_the_ideal_task():
    tokenizer = demo.build_tiny_tokenizer()
    task_tree = two_mode.TaskTree(TASK, tokenizer)
    model = IdealModel(tokenizer, TASK)
    theta, entropies, off_task = two_mode.node_distributions(model, [0], task_tree)
    predicted = two_mode.predict_arms(
        task_tree, theta, ref_entropies=entropies, beta=0.05, off_task=off_task
    )
    a_right = (1 - TASK.p_b) * TASK.p_right**TASK.k
    q = 1 + 0.3 * (math.log(TASK.m) - 1.2)  # Eq. 11 at B's positions, below the cap

    def eq4(q_at_b: float) -> float:
        b = TASK.p_b * q_at_b**TASK.k
        return math.log(b / (b + a_right))

    assert predicted["start"] == pytest.approx(math.log(TASK.p_b), abs=1e-9)
    assert predicted["k1_return"] == pytest.approx(eq4(1.0), abs=1e-6)
    assert predicted["k1_return_branch_ref"] == pytest.approx(eq4(q), abs=1e-6)
    assert predicted["k1_return_branch"] == pytest.approx(eq4(q), abs=1e-6)  # B's stay spread
    assert predicted["k3_branch"] == pytest.approx(predicted["k3"], abs=1e-9)  # q cancels
    assert predicted["k2_branch"] == pytest.approx(predicted["k2"], abs=1e-12)  # Eq. 4 per node
    # nothing off the task: the sampler's fixed point is Eq. 4's too (A's 1 leaves min-p's
    # support at its threshold, which lowers A's value by K log(1 - 0.01) at most)
    for arm, q_at_b in (("k1_return", 1.0), ("k1_return_branch_ref", q), ("k1_return_branch", q)):
        assert predicted[f"{arm}/sampler"] == pytest.approx(eq4(q_at_b), abs=0.01 * TASK.k)


def test_the_task_tree_is_the_tokenizers_own():
    tokenizer = demo.build_tiny_tokenizer()
    task_tree = two_mode.TaskTree(TASK, tokenizer)
    right = [y for y, r in zip(task_tree.tree.completions, task_tree.rewards) if r == 1]
    assert len(right) == 1 + TASK.m**TASK.k  # A's all-zero path and every B path
    texts = {tokenizer.decode(list(y[:-1])) for y in right}
    assert "A00" in texts and all(TASK.is_right(text) for text in texts)
    rng = random.Random(0)
    assert all(len(tokenizer(TASK.sample(rng))["input_ids"]) == TASK.k + 1 for _ in range(20))


@pytest.mark.slow
def test_make_demo_lifts_pi_b_toward_the_prediction_and_says_so_in_a_few_lines(
    tmp_path, capsys, monkeypatch
):
    """``make demo`` (python -m extras.two_mode --tiny) as a user runs it: one seed, sage.py's
    k1_return and k3 arms, each with and without the branch guide. Under k1_return the guided arm
    ends above the unguided one, near the exact prediction (+0.77 nats for this start; +0.84
    trained on the CPU this was written on: the bounds leave room for another CPU's rounding);
    under k3 the guide's lift stays near its prediction of about 0. The report is a few lines and
    the figure is written; run again (in-process, with the arms' trainer made to fail), it keeps
    the finished arms and prints the same table. (This start's entropies put q at the clamp at
    B's positions from the start, so whose entropies the guide reads cannot show here:
    test_two_step_cli_run's branch run checks that.)"""
    out = tmp_path / "demo"
    argv = ["--tiny", "--out", str(out)]
    command = [sys.executable, "-m", "extras.two_mode", *argv]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    done = subprocess.run(
        command, cwd=repo, env=SUBPROCESS_ENV, check=True, timeout=600, capture_output=True
    )
    printed = done.stdout.decode().splitlines()
    assert len(printed) < 40
    assert any("the branch guide's lift over k1_return is" in line for line in printed)
    assert any("the branch guide's lift over k3 is" in line for line in printed)
    summary = json.loads((out / "summary.json").read_text())
    (guided,) = summary["margin_verdict"]["k1_return_branch"]["per_seed"].values()
    (plain,) = summary["margin_verdict"]["k1_return"]["per_seed"].values()
    predicted = guided["predicted"] - plain["predicted"]
    trained = guided["trained"] - plain["trained"]
    assert 0.5 < predicted < 1.2  # Eq. 4 on this start: about K log q
    assert 0.2 < trained < predicted + 0.5
    (guided,) = summary["margin_verdict"]["k3_branch"]["per_seed"].values()
    (plain,) = summary["margin_verdict"]["k3"]["per_seed"].values()
    predicted = guided["predicted"] - plain["predicted"]
    trained = guided["trained"] - plain["trained"]
    assert abs(predicted) < 0.1 and abs(trained - predicted) < 0.2  # k3: q cancels at a node
    assert (out / "pi_b.png").stat().st_size > 0
    # the same table and verdicts again; only the progress lines ("two_mode: ...") say how
    # long each stage took
    table = [line for line in printed if not line.startswith("two_mode: ")]

    def trains(*args, **kwargs):
        raise AssertionError(f"a finished arm was trained again: {args}")

    monkeypatch.setattr(two_mode, "run", trains)
    capsys.readouterr()
    two_mode.main(argv)
    again = capsys.readouterr().out.splitlines()
    assert [line for line in again if not line.startswith("two_mode: ")] == table
    assert len(table) == len(printed) - 2  # the start and prediction, then every arm
    # the evidence a reader re-checks: each arm's per-step metrics, the start's hash, and its
    # node probabilities, from which the prediction is re-made without the start
    steps = json.loads(gzip.decompress((out / "steps.json.gz").read_bytes()))
    seed = str(summary["settings"]["first_seed"])
    for arm in ("k1_return", "k1_return_branch"):
        columns = steps[arm][seed]
        assert len(columns["grad_norm"]) == len(columns["step"]) == summary["settings"]["steps"]
        assert {"kl/ref_k3", "q/mean"} <= columns.keys()
    assert any(value != 1.0 for value in steps["k1_return_branch"][seed]["q/mean"])
    # Eq. 11's clamp at q_max = 1.4 is reached on this task, and never passed
    q_max = steps["k1_return_branch"][seed]["q/max"]
    assert max(q_max) == pytest.approx(1.4)
    seed_dir = out / f"seed-{seed}"
    prediction = json.loads((seed_dir / "prediction.json").read_text())
    assert prediction["start_sha256"] == two_mode.weights_sha256(str(seed_dir / "sft_model"))
    nodes = np.load(seed_dir / "start_nodes.npz")
    task = two_mode.TwoModeTask(k=summary["settings"]["k"], m=summary["settings"]["m"])
    tree = two_mode.TaskTree(task, AutoTokenizer.from_pretrained(seed_dir / "sft_model"))
    remade = two_mode.predict_arms(
        tree,
        torch.from_numpy(nodes["theta"][0]),
        ref_entropies=torch.from_numpy(nodes["entropies"][0]),
        beta=summary["settings"]["beta"],
        arms=tuple(summary["settings"]["arms"]),
        off_task=torch.from_numpy(nodes["off_task"][0]),
    )
    assert remade == pytest.approx(prediction["per_phrasing"][0], abs=1e-9)


def test_a_start_made_with_other_settings_is_refused_not_reused(tmp_path):
    """A seed's SFT start is kept when the study runs again, but only for the K, M and SFT
    settings it was made with: a start of K = 3 would otherwise be trained as if it were K = 2's."""
    seed_dir = tmp_path / "seed-1000"
    (seed_dir / "sft_model").mkdir(parents=True)
    (seed_dir / "sft_model" / "config.json").write_text("{}")
    (seed_dir / "start.json").write_text('{"k": 3, "m": 8, "sft_examples": 2400, "sft_epochs": 2}')
    same = two_mode.parse_args(["--k", "3", "--m", "8"])
    assert two_mode.make_start(str(seed_dir), 1000, same)["model"] == str(seed_dir / "sft_model")
    other = two_mode.parse_args(["--k", "2", "--m", "8"])
    with pytest.raises(SystemExit, match="made with other settings.* pass another --out"):
        two_mode.make_start(str(seed_dir), 1000, other)
    problems = (seed_dir / "problems.jsonl").read_text()
    assert "k=3 m=8" in problems and "k=2" not in problems  # not rewritten for K = 2
    (seed_dir / "start.json").unlink()  # a start made before its recipe was recorded
    with pytest.raises(SystemExit, match="before .*start.json recorded them"):
        two_mode.make_start(str(seed_dir), 1000, same)


def test_the_margin_rule_judges_levels_at_a_plateau_and_lifts_paired_by_seed():
    """The study's rule on made-up trajectories: a level is judged only where every seed passed
    the plateau test, a lift is the guided arm's minus its unguided arm's, less the prediction,
    paired by seed, and each mean passes within its margin."""

    def arm(levels: list[float], reward: float = 0.97) -> tuple[list[dict], dict]:
        points = [{"step": 10 * i, "log_pi_b": v, "outside": 0.0} for i, v in enumerate(levels)]
        return points, {"reward": [reward] * 10 * (len(levels) - 1)}

    flat, moving = [-3.0, -2.9, -2.9, -2.9, -2.9, -2.9], [-3.0, -2.5, -2.6, -2.6, -2.6, -2.0]
    per_seed = {}
    for seed, shift in ((1, 0.0), (2, 0.1)):
        plain, guided = arm([v + shift for v in flat]), arm([v + shift + 0.8 for v in flat])
        per_seed[seed] = {
            "prediction": {"log_pi_b": {"k1_return": -3.0, "k1_return_branch_ref": -2.3}},
            "arms": {"k1_return": plain[0], "k1_return_branch_ref": guided[0]},
            "steps": {"k1_return": plain[1], "k1_return_branch_ref": guided[1]},
        }
    rows = two_mode.margin_verdict(per_seed, ["k1_return", "k1_return_branch_ref"], steps=50)
    assert rows["k1_return"]["level"].startswith("passes (+0.150")  # mean of +0.1 and +0.2
    assert rows["k1_return_branch_ref"]["lift"].startswith("passes (+0.100")  # 0.8 - 0.7
    assert rows["k1_return_branch_ref"]["lift_error_logodds"] > 0.1  # larger in log-odds
    per_seed[2]["arms"]["k1_return"] = arm(moving)[0]
    rows = two_mode.margin_verdict(per_seed, ["k1_return", "k1_return_branch_ref"], steps=50)
    assert rows["k1_return"]["level"].startswith("transient")
    assert rows["k1_return_branch_ref"]["lift"].startswith("fails")  # (+0.1 - 0.7) / 2: beyond 0.2


@pytest.mark.parametrize("setting", ["k2m6", "k3m8", "k4m10"])
def test_a_finished_study_judged_at_its_last_step_is_its_own_verdict(setting, tmp_path, capsys):
    """--judge-at re-judges a study from its committed summary and per-step metrics alone: at the
    study's own length it gives the verdicts the study recorded, and earlier it judges fewer
    levels (the plateau test fails more often) while every lift still passes, as the
    preregistration's note on the study's budget reports."""
    docs = Path(__file__).resolve().parents[1] / "docs" / "two-mode"
    summary = json.loads((docs / f"study-{setting}-summary.json").read_text())
    steps = json.loads(gzip.decompress((docs / f"study-{setting}-steps.json.gz").read_bytes()))
    recorded = summary["margin_verdict"]
    judged = two_mode.judge_at(summary, steps, at_step=summary["settings"]["steps"])
    for arm, row in recorded.items():
        assert judged[arm]["level"] == row["level"] and judged[arm].get("lift") == row.get("lift")
    early = two_mode.judge_at(summary, steps, at_step=400)
    assert all(row["lift"].startswith("passes") for row in early.values() if "lift" in row)
    judged_levels = [row for row in early.values() if row["level"].startswith(("passes", "fails"))]
    assert len(judged_levels) < len(early)
    # the command line: python -m extras.two_mode --out DIR --judge-at 400, trains nothing
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "steps.json.gz").write_bytes((docs / f"study-{setting}-steps.json.gz").read_bytes())
    assert two_mode.main(["--out", str(tmp_path), "--judge-at", "400"]) == early
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(early) and printed[0].startswith("margins at step 400, k1_return:")
    assert sorted(os.listdir(tmp_path)) == ["steps.json.gz", "summary.json"]


@pytest.mark.parametrize("setting", ["k2m6", "k3m8", "k4m10"])
def test_the_60_minute_study_is_judged_against_the_predictions_committed_before_it(setting):
    """The 60-minute study's committed summary: each seed's prediction is the one committed
    before its arms trained (study60-predictions.json, with the start's weight hash), every arm
    trained the preregistered 300 steps, and the margin rule applied again to the committed
    trajectories and per-step rewards gives the verdicts the summary records."""
    docs = Path(__file__).resolve().parents[1] / "docs" / "two-mode"
    summary = json.loads((docs / f"study60-{setting}-summary.json").read_text())
    steps = json.loads(gzip.decompress((docs / f"study60-{setting}-steps.json.gz").read_bytes()))
    committed = json.loads((docs / "study60-predictions.json").read_text())[setting]
    assert summary["settings"]["steps"] == 300 and len(summary["arms"]) == len(two_mode.ARMS)
    for arm, row in summary["margin_verdict"].items():
        for seed, values in row["per_seed"].items():
            predictions = committed[seed]["log_pi_b"]
            expected = predictions.get(f"{arm}/sampler", predictions[arm])
            assert values["predicted"] == pytest.approx(expected, abs=1e-6)
        assert all(len(steps[arm][seed]["reward"]) == 300 for seed in row["per_seed"])
    judged = two_mode.judge_at(summary, steps, at_step=300)
    for arm, row in summary["margin_verdict"].items():
        assert judged[arm]["level"] == row["level"] and judged[arm].get("lift") == row.get("lift")


@pytest.mark.cuda_kernels  # peft's loader pins memory wherever torch says CUDA
def test_the_token_tail_check_with_an_untrained_adapter_is_the_prediction(tmp_path):
    """token_lift_at_trained_tail measures the tail below min-p on the arm's trained policy: with
    an adapter that changes nothing (LoRA's B = 0), that policy is pi_ref, its tail is the one
    the prediction holds, and the lift it gives is the prediction's, phrasing by phrasing."""
    from peft import LoraConfig, get_peft_model

    seed_dir = tmp_path / "seed-1"
    model_dir = demo.save_tiny_model(
        seed_dir / "sft_model", seed=3, hidden_size=128, num_layers=1, num_heads=2
    )
    task = two_mode.TwoModeTask(k=2, m=4)
    prediction = two_mode.predict_start(
        model_dir,
        task,
        beta=0.5,
        arms=("k1_return", "k1_return_token"),
        nodes_path=str(seed_dir / "start_nodes.npz"),
    )
    untrained = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=4, target_modules=["q_proj"])
    )
    untrained.save_pretrained(seed_dir / "k1_return_token" / "checkpoint" / "model")
    lifts = two_mode.token_lift_at_trained_tail(str(seed_dir), task, beta=0.5)
    expected = [
        p["k1_return_token/sampler"] - p["k1_return/sampler"] for p in prediction["per_phrasing"]
    ]
    assert lifts == pytest.approx(expected, abs=1e-9)
    assert any(abs(lift) > 1e-3 for lift in lifts)  # the guide moves this start
