"""trackers.py: the same records reach metrics.jsonl, TensorBoard and W&B (offline: no network)."""

import json
import os

import pytest

from machinery import trackers


def test_report_to_names_are_checked():
    assert trackers.parse_report_to("tensorboard, wandb") == ["jsonl", "tensorboard", "wandb"]
    with pytest.raises(trackers.TrackerError, match="unknown --report-to 'mlflow'"):
        trackers.parse_report_to("mlflow")


def test_every_tracker_gets_the_same_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = [
        {"step": step, "reward": 0.5 + step / 10, "kl/ref_k3": 0.01 * step, "q/mean": 1.1}
        for step in range(3)
    ]
    run = trackers.Trackers("jsonl,tensorboard,wandb", str(tmp_path), "test-run", {"lr": 1e-3})
    for record in records:
        run.log(record, record["step"])
    run.log_extra({"eval/demo/pass@1": 0.25}, 3)
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


def one_step(logger, timer, step=0):
    """A step's record through ``logger`` (two rollouts, one phase each of sampling and update)."""
    import torch

    import sage

    rollouts = sage.Rollouts([[1], [1]], [[2, 3], [4]], ["", ""], ["stop"] * 2, [[0.0]] * 2, [], [])
    with timer("rollout"):
        pass
    with timer("update"):
        pass
    logger.log_step(
        step, rollouts, rewards=torch.tensor([1.0, 0.0]), metrics={}, timer=timer, lr=0.1
    )


def test_a_cuda_steps_metrics_carry_the_trainers_peak_memory_and_a_cpu_steps_none(
    tmp_path, monkeypatch, capsys
):
    """Each phase's peak allocated and reserved GPU memory (reset as the phase starts) less what
    the sleeping engine keeps counted is in metrics.jsonl on CUDA, with one line when the
    trainer's peak exceeds the plan's forecast and one at the end; on the CPU the record has no
    memory/ keys and nothing is said. The engine's pool is simulated: 30 GB allocated (32
    reserved) that torch's counters hold from its start on, asleep or awake."""
    import torch

    import sage
    from machinery import runs

    config = sage.Config(model="tiny", report_to="jsonl")
    (tmp_path / "cpu").mkdir(), (tmp_path / "cuda").mkdir()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU half, forced
    cpu_logger = trackers.RunLogger(config, str(tmp_path / "cpu"))
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
    logger = trackers.RunLogger(config, str(tmp_path / "cuda"), forecast_gb=35.0)
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
