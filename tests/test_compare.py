"""extras/compare.py: intervals over seeds against scipy's own, paired differences by hand, and
(slow) a tiny two-seed study end to end, killed mid-arm and finished by the same command."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from extras import compare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_interval_is_students_t_over_seeds():
    from scipy import stats

    values = [0.31, 0.42, 0.35, 0.50, 0.38]
    low, high = stats.t.interval(
        0.95, len(values) - 1, loc=sum(values) / 5, scale=stats.sem(values)
    )
    result = compare.interval(values)
    assert result["low"] == pytest.approx(low) and result["high"] == pytest.approx(high)
    assert compare.interval([0.3])["low"] is None  # one seed: no interval


def test_differences_are_paired_by_seed_and_only_over_the_seeds_both_have():
    per_seed = {
        "grpo": {"1": {"pass@1": 0.30}, "2": {"pass@1": 0.50}, "3": {"pass@1": 0.40}},
        "guided": {"1": {"pass@1": 0.35}, "2": {"pass@1": 0.56}},
    }
    summary = compare.summarize(per_seed)
    difference = summary["guided"]["minus_grpo"]["pass@1"]
    assert difference["seeds"] == 2 and difference["mean"] == pytest.approx(0.055)
    assert summary["guided"]["pass_at_k"]["pass@1"]["mean"] == pytest.approx(0.455)
    assert "minus_grpo" not in summary["grpo"]
    # the same shift on every seed is distinguishable from zero however much the seeds differ
    guided = {seed: {"pass@1": v["pass@1"] + 0.05} for seed, v in per_seed["grpo"].items()}
    shifted = {"grpo": per_seed["grpo"], "guided": guided}
    shifted["guided"]["3"]["pass@1"] += 0.001
    assert compare.distinguishable(compare.summarize(shifted))


def test_pass_at_k_per_group_comes_from_each_problems_counts(tmp_path):
    """measures_of splits pass@k by the problems' groups (hard, easy): the unbiased estimator
    over each group's own problems, in the benchmark's order."""
    from evaluate import pass_at_k

    counts, groups = [0, 2, 4, 1], ["hard", "easy", "easy", "hard"]
    results = {
        "sampling": {"n": 4},
        "benchmarks": {
            "demo": {
                "pass_at_k": {"1": {"mean": 7 / 16}, "4": {"mean": 0.75}},
                "seeds": {"0": {"correct": counts}},
            }
        },
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    measures = compare.measures_of(str(path), groups)
    assert measures["hard/pass@1"] == pytest.approx(1 / 8)  # (0/4 + 1/4) / 2
    assert measures["easy/pass@4"] == pytest.approx(1.0)
    assert measures["hard/pass@4"] == pytest.approx(pass_at_k(4, 1, 4) / 2)
    assert measures["pass@1"] == pytest.approx(7 / 16)


def test_probe_measures_are_summarized_and_paired_with_grpo_and_with_the_sft_start():
    per_seed = {
        "SFT start": {"1": {"hard/mean_logp_full": -8.0}, "2": {"hard/mean_logp_full": -9.0}},
        "grpo": {"1": {"hard/mean_logp_full": -8.45}, "2": {"hard/mean_logp_full": -9.45}},
        "guided": {"1": {"hard/mean_logp_full": -8.1}, "2": {"hard/mean_logp_full": -9.1}},
    }
    summary = compare.summarize(per_seed)
    assert summary["guided"]["support"]["hard/mean_logp_full"]["mean"] == pytest.approx(-8.6)
    assert summary["guided"]["pass_at_k"] == {}
    to_grpo = summary["guided"]["minus_grpo"]["hard/mean_logp_full"]
    to_start = summary["grpo"]["minus_sft_start"]["hard/mean_logp_full"]
    assert to_grpo["mean"] == pytest.approx(0.35) and to_start["mean"] == pytest.approx(-0.45)
    assert to_start["high"] < 0  # the same drop on both seeds: the interval excludes zero
    assert "minus_grpo" not in summary["grpo"]  # and the start is paired with no arm
    assert not {"minus_grpo", "minus_sft_start"} & set(summary["SFT start"])
    # a seed without the measure (every y* outside the support) is left out, and counted
    per_seed["guided"]["2"]["hard/mean_logp_full"] = None
    partial = compare.summarize(per_seed)["guided"]
    assert partial["support"]["hard/mean_logp_full"]["seeds"] == 1
    assert partial["minus_grpo"]["hard/mean_logp_full"]["seeds"] == 1


def test_arms_are_chosen_and_added_by_flag(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the --jobs check: below
    _, arms = compare.parse_args(
        ["--arms", "grpo,branch_k3", "--arm", "mine=--guide token --tau 1"]
    )
    assert list(arms) == ["grpo", "branch_k3", "mine"] and arms["mine"] == [
        "--guide",
        "token",
        "--tau",
        "1",
    ]
    with pytest.raises(SystemExit):
        compare.parse_args(["--arms", "nope"])


# a tiny study: two seeds (each its own tiny SFT start), two arms of six steps, sampled by HF's
# generate (--backend hf: no vLLM engine starts in its eight stages; the engine's own CLI runs
# are tests/test_sage_cli.py's and tests/test_evaluate.py's)
TINY = shlex.split(
    """
    --seeds 2 --seed 3407 --steps 6 --save-every 1 --eval-samples 4
    --demo-eval-problems 12 --demo-sft-examples 32 --arms branch_k1_return_ref --backend hf
    """
)


def test_on_cuda_each_job_has_a_gpu_of_its_own(monkeypatch):
    """Two vLLM engines on one GPU break each other's sizing: --jobs above the visible GPUs is
    refused in one line; with a GPU per job, each stage runs on its job's GPU alone."""
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as refused:
        compare.parse_args(["--jobs", "2", "--seeds", "2"])
    message = str(refused.value)
    assert message.startswith("error: --jobs 2") and "\n" not in message
    assert message.endswith("pass --jobs 1 or fewer, one per visible GPU")
    assert compare.parse_args(["--jobs", "2", "--seeds", "1"])[0].gpus == ["0"]  # one job
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args, _ = compare.parse_args(["--jobs", "2", "--seeds", "2"])
    assert args.gpus == ["3", "5"] and args.gpu is None
    seen = []
    finished = type("Finished", (), {"returncode": 0})
    monkeypatch.setattr(
        compare.subprocess, "run", lambda command, env, **kwargs: seen.append(env) or finished
    )
    compare.run(["-m", "extras.demo"], threads=1, gpu="5")
    compare.run(["-m", "extras.demo"], threads=1)  # on the CPU: the environment as it is
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "5" and "CUDA_VISIBLE_DEVICES" not in seen[1]


@pytest.mark.slow
def test_a_killed_study_finishes_without_redoing_what_was_done(tmp_path):
    """(On a node with one GPU, one job at a time: two engines do not share a GPU.)"""
    import torch

    out = tmp_path / "study"
    jobs = ["--jobs", "1"] if torch.cuda.device_count() == 1 else []
    command = [sys.executable, "-m", "extras.compare", "--out", str(out), *TINY, *jobs]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    study = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, **quiet)
    first_arm = out / "seed-3407" / "sft_start.json"  # the SFT start's evaluation, done first
    killed_arm = out / "seed-3407" / "branch_k1_return_ref" / "checkpoint" / "trainer_state.json"
    deadline = time.monotonic() + 900
    while not killed_arm.exists() and study.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(study.pid, signal.SIGKILL)  # mid-arm: its first checkpoint is written
    study.wait()
    assert first_arm.exists() and killed_arm.exists()
    finished = first_arm.stat().st_mtime_ns
    stopped_at = json.loads(killed_arm.read_text())["step"]
    assert not (out / "summary.json").exists()

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    assert first_arm.stat().st_mtime_ns == finished  # done arms are not redone
    metrics = (out / "seed-3407" / "branch_k1_return_ref" / "metrics.jsonl").read_text()
    steps = [json.loads(line)["step"] for line in metrics.splitlines()]
    assert steps == list(range(6)) and stopped_at < 6  # the killed arm resumed, each step once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["study"]["seeds"] == [3407, 3408] and summary["study"]["backend"] == "hf"
    for seed in ("3407", "3408"):  # --backend reached every arm's training and every evaluation
        seed_dir = out / f"seed-{seed}"
        arm_config = json.loads((seed_dir / "branch_k1_return_ref" / "config.json").read_text())
        assert arm_config["backend"] == "hf"
        for result in ("sft_start.json", "branch_k1_return_ref.json"):
            assert json.loads((seed_dir / result).read_text())["sampling"]["backend"] == "hf"
    probe = ["mean_logp_full", "mean_logp", "outside"] + [
        f"supp@{delta:g}" for delta in (1e-1, 1e-2, 1e-3, 1e-4)
    ]
    for arm in ("SFT start", "branch_k1_return_ref"):
        assert set(summary[arm]["per_seed"]) == {"3407", "3408"}
        assert {"pass@1", "pass@4"} <= summary[arm]["pass_at_k"].keys()
        for seed in ("3407", "3408"):  # the support probe, per arm and per seed
            measures = summary[arm]["per_seed"][seed]
            assert {f"{group}/{key}" for group in ("all", "easy", "hard") for key in probe} <= set(
                measures
            )
            assert 0.0 <= measures["hard/supp@0.0001"] <= 1.0
            assert measures["all/mean_logp_full"] < 0.0
        assert summary[arm]["support"]["all/supp@0.001"]["low"] is not None
    # (the differences from grpo, paired the same way, are held on made-up measures above)
    to_start = summary["branch_k1_return_ref"]["minus_sft_start"]
    assert to_start["hard/mean_logp_full"]["seeds"] == 2
    difference = to_start["pass@4"]
    assert (
        difference["seeds"] == 2 and difference["low"] <= difference["mean"] <= difference["high"]
    )
    assert os.path.getsize(out / "passk.png") > 0


def test_the_printed_tables_show_pass_at_k_over_every_problem():
    """The committed study's tables: pass@1, pass@8, pass@32 of all problems; the last column was
    hard/pass@32 under an unmarked header, and the per-group table's hard/hard/pass@32 printed -."""
    with open(os.path.join(REPO, "docs", "study-summary.json")) as handle:
        summary = json.load(handle)
    arms = {name: entry for name, entry in summary.items() if name not in ("study", "contrasts")}
    assert compare.headline_passes(arms) == ["pass@1", "pass@8", "pass@32"]
