"""runs.py: the checkpoint is written atomically and restores a run exactly, and the metrics log
is cut back on resume."""

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from machinery import models, runs
from machinery.data import PromptSampler


def run_state(full_finetune: bool = False) -> tuple:
    """A tiny policy (LoRA or every weight trained), its AdamW and schedule, a prompt sampler and
    a guide generator: what a checkpoint holds."""
    import sage
    from extras import demo

    model = demo.build_tiny_model(demo.build_tiny_tokenizer(), max_position_embeddings=64)
    torch.manual_seed(0)  # LoRA's A matrices
    policy, _ = sage.make_policy(
        model, full_finetune, lora_rank=4, lora_alpha=8, with_reference=False
    )
    optimizer, scheduler = models.make_optimizer(policy, 1e-2, 0.0, 10, 1)
    return policy, optimizer, scheduler, PromptSampler(10, seed=0), torch.Generator()


def train_step(state: tuple) -> list:
    """One AdamW step on random tokens, then a draw from every RNG a step uses; returns the
    loss, the next step's learning rate, the draws and the trained weights."""
    policy, optimizer, scheduler, sampler, generator = state
    ids = torch.randint(0, 64, (2, 8))
    loss = policy(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    draws = [random.random(), torch.rand(3), sampler.take(3), torch.rand(2, generator=generator)]
    trained = [p for p in policy.parameters() if p.requires_grad]
    return [loss.detach(), scheduler.get_last_lr(), *draws, *trained]


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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path)], env=env)
    assert killed.returncode == -signal.SIGKILL
    assert runs.restore_or_start(True, str(tmp_path), run_state()) == 1


def test_truncate_metrics_drops_steps_to_redo(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    for step in range(5):
        runs.append_jsonl(path, {"step": step, "reward": step / 10})
    runs.truncate_jsonl(path, 3)
    with open(path) as handle:
        assert [json.loads(line)["step"] for line in handle] == [0, 1, 2]
