"""runs.py: checkpoints are written atomically, and the metrics log is cut back on resume."""

import json
import os

import pytest
import torch

from machinery import models, runs


def test_checkpoint_write_is_atomic(tmp_path, tiny, monkeypatch):
    model, _ = tiny
    optimizer, scheduler = models.make_optimizer(model, 1e-3, 0.0, 10, 1)
    state = {
        "step": 1,
        "sampler": {"epoch": 0, "position": 3},
        "guide_generator": torch.Generator().get_state(),
    }
    runs.save_checkpoint(str(tmp_path), model, optimizer, scheduler, state)
    with open(tmp_path / "checkpoint" / "trainer_state.json") as handle:
        assert json.load(handle)["step"] == 1

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(SystemExit, match="previous checkpoint .* is intact"):
        runs.save_checkpoint(str(tmp_path), model, optimizer, scheduler, {**state, "step": 2})
    with open(tmp_path / "checkpoint" / "trainer_state.json") as handle:
        assert json.load(handle)["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]


def test_truncate_metrics_drops_steps_to_redo(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    for step in range(5):
        runs.append_jsonl(path, {"step": step, "reward": step / 10})
    runs.truncate_jsonl(path, 3)
    with open(path) as handle:
        assert [json.loads(line)["step"] for line in handle] == [0, 1, 2]
