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
