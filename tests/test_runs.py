"""runs.py: the checkpoint is written atomically and restores a run exactly, the metrics log is
cut back on resume, and the same records reach metrics.jsonl, TensorBoard and W&B (offline: no
network)."""

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest
import torch

from machinery import UsageError, models, runs
from task.problems import PromptSampler


def run_state(full_finetune: bool = False) -> tuple:
    """A tiny policy (LoRA or every weight trained), its AdamW and schedule, a prompt sampler, a
    guide generator and the tokenizer: what a checkpoint holds."""
    import sage
    from extras import demo

    tokenizer = demo.build_tiny_tokenizer()
    model = demo.build_tiny_model(tokenizer, max_position_embeddings=64)
    torch.manual_seed(0)  # LoRA's A matrices
    policy, _ = sage.make_policy(
        model, full_finetune, lora_rank=4, lora_alpha=8, with_reference=False
    )
    optimizer, scheduler = models.make_optimizer(policy, 1e-2, 0.0, 10, 1)
    return policy, optimizer, scheduler, PromptSampler(10, seed=0), torch.Generator(), tokenizer


def train_step(state: tuple) -> list:
    """One AdamW step on random tokens, then a draw from every RNG a step uses; returns the
    loss, the next step's learning rate, the draws and the trained weights."""
    policy, optimizer, scheduler, sampler, generator, _ = state
    ids = torch.randint(0, 64, (2, 8))
    loss = policy(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    draws = [random.random(), torch.rand(3), sampler.take(3), torch.rand(2, generator=generator)]
    trained = [p for p in policy.parameters() if p.requires_grad]
    return [loss.detach(), scheduler.get_last_lr(), *draws, *trained]


def test_a_full_finetune_checkpoint_is_a_model_evaluate_py_can_load(tmp_path):
    """checkpoint/model holds the tokenizer beside the weights: evaluate.py --model of a
    --full-finetune checkpoint reads its prompts' chat template there (an empty tokenizer and a
    traceback before)."""
    from transformers import AutoTokenizer

    from task.problems import build_prompt_ids

    state = run_state(full_finetune=True)
    runs.save_checkpoint(str(tmp_path), 1, state)
    saved = AutoTokenizer.from_pretrained(tmp_path / "checkpoint" / "model")
    assert build_prompt_ids(saved, "1 + 1") == build_prompt_ids(state[-1], "1 + 1")


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


@pytest.mark.parametrize("full_finetune", [False, True], ids=["lora", "full"])
def test_a_restored_checkpoint_continues_exactly(tmp_path, full_finetune):
    """The step after a checkpoint is the same, bit for bit, whether the run goes on or a fresh
    process restores it: weights, AdamW's moments, the schedule, the RNG states, the sampler and
    the guide's generator all come back."""
    whole = run_state(full_finetune)
    train_step(whole)
    runs.save_checkpoint(str(tmp_path), 1, whole)
    expected = train_step(whole)
    resumed = run_state(full_finetune)
    torch.manual_seed(1), random.seed(1)  # the RNGs are elsewhere, as in a new process
    assert runs.restore_or_start(True, str(tmp_path), resumed) == 1
    assert same(train_step(resumed), expected)
    model = tmp_path / "checkpoint" / "model"  # what evaluate.py --adapter (or --model) reads
    assert (model / ("config.json" if full_finetune else "adapter_config.json")).exists()


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    state = run_state()
    runs.save_checkpoint(str(tmp_path), 1, state)
    with open(tmp_path / "checkpoint" / "trainer_state.json") as handle:
        assert json.load(handle)["step"] == 1

    def fail(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patched:
        patched.setattr(torch, "save", fail)
        with pytest.raises(SystemExit, match="previous checkpoint .* can still be resumed"):
            runs.save_checkpoint(str(tmp_path), 2, state)
    with open(tmp_path / "checkpoint" / "trainer_state.json") as handle:
        assert json.load(handle)["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]
    assert not [name for name in os.listdir(tmp_path / "checkpoint") if name.startswith(".tmp-")]
    assert runs.restore_or_start(True, str(tmp_path), run_state()) == 1  # the previous one


# A process that checkpoints step 1, then is killed (SIGKILL) halfway through writing step 2's.
KILLED_MID_SAVE = """
import os, signal, sys
import torch
import test_runs
from machinery import runs

state = test_runs.run_state()
test_runs.train_step(state)
runs.save_checkpoint(sys.argv[1], 1, state)
test_runs.train_step(state)

def save_half(payload, handle):
    handle.write(b"the first bytes of a checkpoint")
    handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = save_half
runs.save_checkpoint(sys.argv[1], 2, state)
"""


def test_a_kill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]  # (keep what it had)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path)], env=env)
    assert killed.returncode == -signal.SIGKILL
    assert runs.restore_or_start(True, str(tmp_path), run_state()) == 1


def test_a_full_disk_ends_the_run_in_one_line_that_says_it_can_be_resumed():
    """/dev/full refuses every write as a full disk does (ENOSPC): a step's metrics line that
    cannot be written ends the run in one line, not a traceback."""
    with pytest.raises(SystemExit) as stopped:
        runs.append_jsonl("/dev/full", {"step": 0})
    assert re.fullmatch(
        r"error: cannot write /dev/full \(.*No space left.*\); the last checkpoint can be resumed",
        str(stopped.value),
    )


def test_truncate_metrics_drops_steps_to_redo(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    for step in range(5):
        runs.append_jsonl(path, {"step": step, "reward": step / 10})
    runs.truncate_jsonl(path, 3)
    with open(path) as handle:
        assert [json.loads(line)["step"] for line in handle] == [0, 1, 2]


def test_a_line_a_full_disk_cut_short_does_not_stop_the_resume(tmp_path):
    """The full disk's line says the run can be resumed: a metrics line it cut short (no newline)
    is dropped with the steps to redo, and the lines before it are kept."""
    path = tmp_path / "metrics.jsonl"
    for step in range(3):
        runs.append_jsonl(str(path), {"step": step, "reward": step / 10})
    with open(path, "a") as handle:
        handle.write('{"step": 3, "rew')  # what the write of step 3 got onto the disk
    runs.truncate_jsonl(str(path), 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


def test_report_to_names_are_checked(monkeypatch):
    assert runs.parse_report_to("tensorboard, wandb") == ["jsonl", "tensorboard", "wandb"]
    assert runs.parse_report_to("wandb") == ["jsonl", "wandb"]
    assert runs.parse_report_to("") == ["jsonl"]
    with pytest.raises(UsageError, match="unknown --report-to 'mlflow'"):
        runs.parse_report_to("mlflow")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # wandb not installed
    with pytest.raises(UsageError, match="^--report-to wandb needs the wandb package: pip install"):
        runs.parse_report_to("wandb")


def test_every_tracker_gets_the_same_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import sage

    records = [
        {"step": step, "reward": 0.5 + step / 10, "kl/ref_k3": 0.01 * step, "q/mean": 1.1}
        for step in range(3)
    ]
    config = sage.Config(model="tiny", report_to="jsonl,tensorboard,wandb")
    run = runs.RunLogger(config, str(tmp_path))
    for record in records:
        run.log(record, record["step"])
    run.track({"eval/demo/pass@1": 0.25}, 3)
    run.close()

    with open(tmp_path / "metrics.jsonl") as handle:
        assert [json.loads(line) for line in handle] == records

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward", "kl/ref_k3", "q/mean", "eval/demo/pass@1"}
    assert [round(event.value, 6) for event in events.Scalars("reward")] == [0.5, 0.6, 0.7]

    # W&B offline: one run directory whose transaction log (protobuf, keys stored as plain bytes)
    # holds every key; `wandb sync` would upload it.
    offline = [name for name in os.listdir(tmp_path / "wandb") if name.startswith("offline-run-")]
    assert len(offline) == 1
    log = next(
        name for name in os.listdir(tmp_path / "wandb" / offline[0]) if name.endswith(".wandb")
    )
    data = (tmp_path / "wandb" / offline[0] / log).read_bytes()
    for key in ("reward", "kl/ref_k3", "q/mean", "eval/demo/pass@1"):
        assert key.encode() in data, key


def test_a_run_name_with_characters_wandb_reserves_starts_its_wandb_run(tmp_path, monkeypatch):
    """--name "exp:lr=1e-5,beta=0.05" (or a trailing "/") with --report-to wandb: W&B refuses
    ":;,#?/'" in a run id, which was a traceback after the model had loaded."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import sage

    config = sage.Config(model="tiny", report_to="jsonl,wandb")
    logger = runs.RunLogger(config, str(tmp_path / "exp:lr=1e-5,beta=0.05") + "/")
    assert logger.wandb.id == "exp-lr=1e-5-beta=0.05"
    assert logger.wandb.name == "exp:lr=1e-5,beta=0.05"
    logger.close()


def test_tensorboard_keeps_one_value_per_step_after_a_resume(tmp_path):
    """A run stopped after logging steps 0-2 and resumed from its checkpoint at step 2 logs step
    2 again: TensorBoard shows the resumed run's value, once (it showed both)."""
    import sage

    config = sage.Config(model="tiny", report_to="jsonl,tensorboard")
    for start, stop in ((0, 3), (2, 4)):
        logger = runs.RunLogger(config, str(tmp_path), start=start)
        for step in range(start, stop):
            logger.log({"step": step, "reward": step + start / 10}, step)
        logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = [(event.step, round(event.value, 6)) for event in events.Scalars("reward")]
    assert logged == [(0, 0.0), (1, 1.0), (2, 2.2), (3, 3.2)]


def test_a_resume_trains_at_this_runs_lr_and_weight_decay(tmp_path):
    """--resume with another --lr or --weight-decay takes them (the checkpoint's optimizer and
    schedule held the old ones, which a resume kept without a word): the rate at the saved step
    is the new --lr through the same schedule, and AdamW's moments are the checkpoint's."""
    whole = run_state()  # --lr 1e-2, --weight-decay 0
    train_step(whole), train_step(whole)
    runs.save_checkpoint(str(tmp_path), 2, whole)
    policy, _, _, sampler, generator, tokenizer = run_state()
    optimizer, scheduler = models.make_optimizer(policy, 5e-3, 0.1, 10, 1)
    state = (policy, optimizer, scheduler, sampler, generator, tokenizer)
    assert runs.restore_or_start(True, str(tmp_path), state) == 2
    group = optimizer.param_groups[0]
    assert whole[2].get_last_lr() == [pytest.approx(1e-2 * 8 / 9)]  # (10 - 2) / (10 - 1)
    assert scheduler.get_last_lr() == [group["lr"]] == [pytest.approx(5e-3 * 8 / 9)]
    assert group["weight_decay"] == 0.1
    saved, restored = whole[1].state_dict()["state"], optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg"], restored[i]["exp_avg"]) for i in saved)


def one_step(logger, timer, step=0):
    """A step's record through ``logger`` (two rollouts, one phase each of sampling and update)."""
    import sage

    rollouts = sage.Rollouts([[1], [1]], [[2, 3], [4]], ["", ""], ["stop"] * 2, [[0.0]] * 2, [], [])
    with timer("rollout"):
        pass
    with timer("update"):
        pass
    logger.log_step(
        step, rollouts, rewards=torch.tensor([1.0, 0.0]), metrics={}, timer=timer, lr=0.1
    )


def test_the_all_zero_warning_counts_steps_without_a_positive_reward_only(tmp_path, capsys):
    """--zero-reward-warning 2: two steps of zero rewards say so; DAPO's step that kept no group
    because every group was right (its metrics carry the sampled reward, 1) does not, and logs
    that reward, not the NaN of no kept rows."""
    import sage

    rollouts = sage.Rollouts([[1]] * 2, [[2]] * 2, [""] * 2, ["stop"] * 2, [[0.0]] * 2, [], [])
    none_kept = sage.Rollouts([], [], [], [], [], [], [])
    config = sage.Config(model="tiny", report_to="jsonl", zero_reward_warning=2)
    logger = runs.RunLogger(config, str(tmp_path))
    steps = [
        (rollouts, torch.zeros(2), {}),
        (none_kept, torch.zeros(0), {"reward": 1.0, "accuracy": 1.0}),  # every group right
        (rollouts, torch.zeros(2), {}),
        (rollouts, torch.zeros(2), {}),
    ]
    warned = []
    for step, (rows, rewards, metrics) in enumerate(steps):
        logger.log_step(step, rows, rewards=rewards, metrics=metrics, timer=runs.PhaseTimer(), lr=0)
        said = capsys.readouterr().out.splitlines()
        warned += [step for line in said if "steps in a row with all-zero rewards" in line]
    logger.close()
    assert warned == [3]  # steps 2 and 3; the all-right step broke the streak
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["reward"] for record in records] == [0.0, 1.0, 0.0, 0.0]


def test_a_cuda_steps_metrics_carry_the_trainers_peak_memory_and_a_cpu_steps_none(
    tmp_path, monkeypatch, capsys
):
    """Each phase's peak allocated and reserved GPU memory (reset as the phase starts) less what
    the sleeping engine keeps counted is in metrics.jsonl on CUDA, with one line when the
    trainer's peak exceeds the plan's forecast and one at the end; on the CPU the record has no
    memory/ keys and nothing is said. The engine's pool is simulated: 30 GB allocated (32
    reserved) that torch's counters hold from its start on, asleep or awake."""
    import sage

    config = sage.Config(model="tiny", report_to="jsonl")
    (tmp_path / "cpu").mkdir(), (tmp_path / "cuda").mkdir()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU half, forced
    cpu_logger = runs.RunLogger(config, str(tmp_path / "cpu"))
    one_step(cpu_logger, runs.PhaseTimer())
    cpu_logger.close()
    record = json.loads((tmp_path / "cpu" / "metrics.jsonl").read_text())
    assert "time/update_s" in record and not [k for k in record if k.startswith("memory/")]
    assert "[memory]" not in capsys.readouterr().out

    resets, engine = [], 30e9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    counters = {"allocated": 1e9, "reserved": 2e9}  # the trainer's, before the engine starts
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: counters["reserved"])
    with runs.CountedMemory() as engine_memory:  # the engine starts: its pool enters the counts
        counters["allocated"] += engine
        counters["reserved"] += engine + 2e9
    assert (engine_memory.allocated, engine_memory.reserved) == (30e9, 32e9)
    # allocated, reserved per phase (rollout, update), the engine's pool counted in: the first
    # step's update holds 30 GB of the trainer's own (raw 60 GB), the second 41 GB (raw 71 GB)
    trainer_peaks = [10e9, 12e9, 30e9, 33e9, 20e9, 22e9, 41e9, 44e9]
    peaks = iter([peak + engine + 2e9 * (i % 2) for i, peak in enumerate(trainer_peaks)])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(peaks))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: next(peaks))
    logger = runs.RunLogger(config, str(tmp_path / "cuda"), forecast_gb=35.0)
    one_step(logger, runs.PhaseTimer(engine=engine_memory), step=0)
    assert "[memory]" not in capsys.readouterr().out  # 30 GB: within the forecast (raw: 60)
    one_step(logger, runs.PhaseTimer(engine=engine_memory), step=1)
    logger.close()
    lines = (tmp_path / "cuda" / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert {k: v for k, v in first.items() if k.startswith("memory/")} == {
        "memory/rollout_peak_gb": 10.0,
        "memory/rollout_peak_reserved_gb": 12.0,
        "memory/update_peak_gb": 30.0,
        "memory/update_peak_reserved_gb": 33.0,
        "memory/engine_gb": 30.0,
        "memory/engine_reserved_gb": 32.0,
    }
    assert second["memory/update_peak_gb"] == 41.0 and len(resets) == 4
    said = capsys.readouterr().out.strip().splitlines()
    assert said == [
        "[memory] step 1: the trainer peaked at 41.0 GB allocated, above the plan's 35.0 GB",
        "[memory] the run: the trainer peaked at 41.0 GB allocated, above the plan's 35.0 GB",
    ]
