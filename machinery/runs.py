"""The run's files: ``runs/<name>/`` holds ``config.json``, ``metrics.jsonl`` (one line per
optimizer step; ``tensorboard/`` and ``wandb/`` hold the same numbers when --report-to names
them), ``eval.jsonl`` (each evaluation's rows) and ``checkpoint/``. Two rules hold for each:

* **Nothing half-written is ever seen.** A file is written under a temporary name beside it and
  renamed over it (a rename is atomic on POSIX). A crash leaves the previous version intact.
* **A resumed run continues exactly.** ``checkpoint/trainer_state.pt`` is one torch.save'd dict
  of all that a step changes (as nanoGPT's ckpt.pt): the trainable weights, AdamW's moments, the
  schedule, the RNG states, the prompt sampler and the guide's generator. The logs are cut back
  to its step, so the steps redone are logged once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import shutil
import time

import torch
from tqdm import tqdm

from machinery import UsageError

# --------------------------------------------------------------------------------------------
# Atomic files
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w"):
    """A file written as ``.tmp-<name>`` beside ``path``, renamed over it on success."""
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".tmp-{name}")
    try:
        with open(temporary, mode) as handle:
            yield handle
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):  # (not there once renamed)
            os.remove(temporary)


def write_json_atomic(path: str, payload) -> None:
    """Write JSON atomically (``atomic_output``)."""
    with atomic_output(path) as handle:
        json.dump(payload, handle, indent=1)
        handle.write("\n")


def write_jsonl_atomic(path: str, rows) -> None:
    """Write one JSON object per line, atomically."""
    with atomic_output(path) as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file this project wrote ([] if it does not exist), less a last
    line that a crash or a full disk cut short (it lacks its newline)."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:  # (the text after the last newline: a line cut short)
        return [json.loads(line) for line in handle.read().split("\n")[:-1] if line.strip()]


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON line, flushed to disk (a crash loses at most the line being written); a
    write that fails (a full disk) ends the run in one line: --resume continues it."""
    try:
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise SystemExit(
            f"error: cannot write {path} ({error}); the last checkpoint can be resumed"
        ) from None


def truncate_jsonl(path: str, before_step: int) -> None:
    """On resume: drop the lines of steps the checkpoint does not include (they will be redone),
    and a last line cut short (``read_jsonl``)."""
    if os.path.exists(path):
        write_jsonl_atomic(path, [row for row in read_jsonl(path) if row["step"] < before_step])


def save_model_atomic(model, tokenizer, final: str) -> str:
    """save_pretrained of the model (and of the tokenizer, unless None) into a temporary
    directory, then a rename over ``final``."""
    temporary = final + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary)
    if tokenizer is not None:
        tokenizer.save_pretrained(temporary)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(temporary, final)
    return final


def save_run_config(run_dir: str, config) -> None:
    """Create the run directory and save the run's config.json in it: only once the run can
    start (its model, data and reward have loaded), so a run refused earlier leaves nothing."""
    write_json_atomic(os.path.join(run_dir, "config.json"), dataclasses.asdict(config))


# --------------------------------------------------------------------------------------------
# The checkpoint. ``state``: (policy, optimizer, scheduler, sampler, guide generator, tokenizer).
# --------------------------------------------------------------------------------------------


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoint")


def has_checkpoint(run_dir: str) -> bool:
    return os.path.exists(os.path.join(checkpoint_dir(run_dir), "trainer_state.pt"))


def save_checkpoint(run_dir: str, step: int, state: tuple) -> None:
    """<run>/checkpoint after ``step`` optimizer steps: ``model/`` with the tokenizer (evaluate.py
    --adapter, or --model of a --full-finetune), then ``trainer_state.pt`` (what --resume reads;
    its rename commits the checkpoint), then ``trainer_state.json``: the step, for people."""
    policy, optimizer, scheduler, sampler, guide_generator, tokenizer = state
    final = checkpoint_dir(run_dir)
    trainer_state = {
        "step": step,
        "weights": {name: p.detach() for name, p in policy.named_parameters() if p.requires_grad},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": (random.getstate(), torch.get_rng_state(), torch.cuda.get_rng_state_all()),
        "sampler": sampler.state_dict(),
        "guide_generator": guide_generator.get_state(),
    }
    try:
        save_model_atomic(policy, tokenizer=tokenizer, final=os.path.join(final, "model"))
        with atomic_output(os.path.join(final, "trainer_state.pt"), "wb") as handle:
            torch.save(trainer_state, handle)
        write_json_atomic(os.path.join(final, "trainer_state.json"), {"step": step})
    except OSError as error:
        raise SystemExit(
            f"error: checkpoint write failed ({error}); the previous checkpoint in {final} can "
            "still be resumed"
        ) from None


def load_checkpoint(run_dir: str, state: tuple) -> int:
    """Restore every part of ``state`` and the RNG states from <run>/checkpoint; its step."""
    policy, optimizer, scheduler, sampler, guide_generator, _ = state  # (the tokenizer is as read)
    path = os.path.join(checkpoint_dir(run_dir), "trainer_state.pt")
    saved = torch.load(path, weights_only=False)
    policy.load_state_dict(saved["weights"], strict=False)  # the frozen rest is as loaded
    # AdamW's moments and the schedule's step come back; --lr and --weight-decay are this run's
    fresh_groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict(saved["optimizer"] | {"param_groups": fresh_groups})
    scheduler.load_state_dict(saved["scheduler"] | {"base_lrs": scheduler.base_lrs})
    scheduler.last_epoch -= 1  # step() sets each group's rate at the saved step, from --lr
    scheduler.step()
    python_rng, torch_rng, cuda_rngs = saved["rng"]
    random.setstate(python_rng)
    torch.set_rng_state(torch_rng)
    torch.cuda.set_rng_state_all(cuda_rngs)
    sampler.load_state_dict(saved["sampler"])
    guide_generator.set_state(saved["guide_generator"])
    return saved["step"]


def restore_or_start(resume: bool, run_dir: str, state: tuple) -> int:
    """The step to start from: the checkpoint's with --resume (``state`` restored), else 0; the
    logs are cut back to it (a fresh start's are emptied)."""
    step = load_checkpoint(run_dir, state) if resume else 0
    truncate_jsonl(os.path.join(run_dir, "metrics.jsonl"), step)  # metrics of steps 0 .. step - 1
    evaluated = step + 1 if resume else 0  # evaluations after 0 .. step updates (fresh: none)
    truncate_jsonl(os.path.join(run_dir, "eval.jsonl"), evaluated)
    return step


def checkpoint_if_due(run_dir: str, step: int, start: int, config, state: tuple) -> bool:
    """Checkpoint after step ``step`` (0-based) every --save-every steps, after the last and at
    --stop-after; True when --stop-after ends the run here (it began at ``start``)."""
    done = step + 1
    stop = config.stop_after > 0 and done - start >= config.stop_after and done < config.steps
    if done % config.save_every == 0 or done == config.steps or stop:
        save_checkpoint(run_dir, done, state)
    if stop:
        tqdm.write(f"stopped after step {done} as asked; continue with --resume")
    return stop


# --------------------------------------------------------------------------------------------
# The records: metrics.jsonl and the --report-to trackers, eval.jsonl, the progress bar
# --------------------------------------------------------------------------------------------

TRACKERS = ("jsonl", "tensorboard", "wandb")


def parse_report_to(spec: str) -> list[str]:
    """The trackers ``--report-to`` names, jsonl always among them; a name that is not a tracker,
    or whose package is not installed, is refused (``cli.check_config`` asks before any load)."""
    names = {"jsonl", *(name.strip() for name in spec.split(",") if name.strip())}
    for name in names - {"jsonl"}:
        if name not in TRACKERS:
            raise UsageError(f"unknown --report-to {name!r}: choose among {', '.join(TRACKERS)}")
        if importlib.util.find_spec(name) is None:
            raise UsageError(f"--report-to {name} needs the {name} package: pip install {name}")
    return [name for name in TRACKERS if name in names]


class RunLogger:
    """A run's records: metrics.jsonl (a line per step) and eval.jsonl (a row per benchmark and
    evaluation), their numbers under the same keys to TensorBoard and W&B when --report-to names
    them (``WANDB_MODE=offline`` needs no network; ``wandb sync`` uploads later), the progress
    bar's figures, and the warnings: all-zero rewards, and on CUDA the trainer's peak memory
    against the plan's forecast (``forecast_gb``)."""

    def __init__(self, config, run_dir: str, forecast_gb: float | None = None, start: int = 0):
        self.config, self.run_dir, self.forecast_gb = config, run_dir, forecast_gb
        self.peak_gb = 0.0  # the trainer's highest peak allocated so far (CUDA)
        self.zero_reward_streak = 0
        names = parse_report_to(config.report_to)
        self.tensorboard = self.wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            # a resume's steps from ``start`` on replace the ones the stopped run logged
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start)
        if "wandb" in names:
            self.wandb = start_wandb(config, run_dir)

    def log(self, record: dict, step: int) -> None:
        """One line of metrics.jsonl; its numbers to the trackers."""
        append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), record)
        self.track({key: value for key, value in record.items() if key != "step"}, step)

    def track(self, numbers: dict, step: int) -> None:
        """The finite numbers among ``numbers`` to TensorBoard and W&B (those --report-to names)."""
        numbers = {
            key: value
            for key, value in numbers.items()
            if isinstance(value, (int, float)) and math.isfinite(value)
        }
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def log_step(
        self, step: int, rollouts, rewards, metrics: dict, timer, lr: float, progress=None
    ) -> None:
        """A step's record (``timer``: its PhaseTimer), the ``progress`` bar's figures and the
        warnings."""
        lengths = [len(c) for c in rollouts.completion_ids]
        truncated = [reason == "length" for reason in rollouts.finish_reasons]
        record = {
            "step": step,
            "reward": rewards.mean().item(),
            "accuracy": (rewards > 0.5).float().mean().item(),
            "response_length": sum(lengths) / max(1, len(lengths)),
            "frac_truncated": sum(truncated) / max(1, len(lengths)),
            "lr": lr,
            **metrics,
            **timer.record(),
        }
        self.log(record, step)
        if progress is not None:
            progress.set_postfix(
                reward=f"{record['reward']:.3f}", kl=f"{record.get('kl/ref_k3', 0.0):.4f}"
            )
        # CUDA: a line the first time the trainer's peak (the engine's bytes left out, as the
        # plan's trainer share leaves them out) exceeds the plan's forecast
        peaks = [v for k, v in record.items() if k.startswith("memory/") and k.endswith("peak_gb")]
        if peaks and self.peak_gb <= self.forecast_gb < max(peaks):
            tqdm.write(memory_line(max(peaks), self.forecast_gb, f"step {step}"))
        self.peak_gb = max([self.peak_gb, *peaks])
        all_zero = record["reward"] <= 0 if rewards.numel() == 0 else rewards.max() <= 0  # DAPO
        self.zero_reward_streak = self.zero_reward_streak + 1 if all_zero else 0
        if self.zero_reward_streak == self.config.zero_reward_warning:
            tqdm.write(
                f"warning: {self.zero_reward_streak} steps in a row with all-zero rewards: no "
                "learning signal; check the answer format and the reward, or warm-start with "
                "--sft-dataset"
            )

    def log_evaluation(self, rows: list[dict]) -> None:
        """An evaluation's rows (evaluate.training_evaluation's) into eval.jsonl, the trackers and
        one line each."""
        for row in rows:
            append_jsonl(os.path.join(self.run_dir, "eval.jsonl"), row)
            numbers = {key: value for key, value in row.items() if key.startswith("pass@")}
            for group, entry in row.get("support", {}).items():
                numbers |= {f"support/{group}/{key}": value for key, value in entry.items()}
            self.track(
                {f"eval/{row['benchmark']}/{key}": value for key, value in numbers.items()},
                row["step"],
            )
            n = row["n"]
            tqdm.write(
                f"eval after {row['step']} steps, {row['benchmark']}: pass@1 "
                f"{row['pass@1']:.3f}, pass@{n} {row[f'pass@{n}']:.3f}"
            )

    def close(self) -> None:
        if self.peak_gb:
            print(memory_line(self.peak_gb, self.forecast_gb, "the run"))
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            import wandb

            wandb.teardown()  # finishes the run, ends the service process wandb.init started


def start_wandb(config, run_dir: str):
    """A W&B run named after the run directory, its id too (W&B's reserved characters made
    "-"): --resume continues it."""
    import wandb

    name = os.path.basename(os.path.normpath(run_dir))
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "sage-rl"),
        name=name,
        id=re.sub(r"[:;,#?/']", "-", name).strip(),
        dir=run_dir,
        config=dataclasses.asdict(config),
        resume="allow" if config.resume else None,
    )


def memory_line(peak_gb: float, forecast_gb: float, what: str) -> str:
    """The trainer's peak allocated GPU memory against the plan's forecast, in one line.

    >>> memory_line(41.5, 38.0, "step 3")
    "[memory] step 3: the trainer peaked at 41.5 GB allocated, above the plan's 38.0 GB"
    """
    side = "above" if peak_gb > forecast_gb else "within"
    return (
        f"[memory] {what}: the trainer peaked at {peak_gb:.1f} GB allocated, {side} the plan's "
        f"{forecast_gb:.1f} GB"
    )


# --------------------------------------------------------------------------------------------
# A step's phases: seconds, and on CUDA the trainer's peak memory
# --------------------------------------------------------------------------------------------


class CountedMemory:
    """What the code run inside ``with CountedMemory() as engine:`` adds to torch's CUDA counters:
    ``engine.allocated`` and ``engine.reserved`` bytes (0 on the CPU).

    Started inside, vLLM's engine keeps those bytes in the counters while it sleeps: its sleep
    mode unmaps the pages of its weights and KV cache, but the tensors, and so torch's
    allocated and reserved counts of them, stay (vLLM issues 17117 and 33625). ``PhaseTimer``
    subtracts them, so that a phase's peak is what the trainer itself holds.
    """

    allocated = reserved = 0

    def __enter__(self) -> CountedMemory:
        self.allocated = -torch.cuda.memory_allocated()  # (0 where CUDA has not started)
        self.reserved = -torch.cuda.memory_reserved()
        return self

    def __exit__(self, *exception) -> None:
        self.allocated += torch.cuda.memory_allocated()
        self.reserved += torch.cuda.memory_reserved()


class PhaseTimer:
    """Wall-clock seconds per phase of a step, summed over the step, and on CUDA each phase's
    peak allocated and reserved memory (reset as it starts) less what the rollout engine keeps
    counted (``engine``): the trainer's own.

    >>> timer = PhaseTimer()
    >>> with timer("reward"):
    ...     pass
    >>> [key for key in timer.record() if key.startswith("time/")]  # memory/ keys too on CUDA
    ['time/reward_s', 'time/step_s', 'time/other_s']
    """

    def __init__(self, engine: CountedMemory | None = None):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.memory: dict[str, float] = collections.defaultdict(float)  # GB, CUDA only
        self.engine = engine or CountedMemory()
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        on_cuda = torch.cuda.is_available()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        yield  # (an exception in a phase ends the run: the phase is not recorded)
        self.seconds[phase] += time.perf_counter() - started
        if on_cuda:
            allocated = torch.cuda.max_memory_allocated() - self.engine.allocated
            reserved = torch.cuda.max_memory_reserved() - self.engine.reserved
            key = f"memory/{phase}_peak"
            self.memory[f"{key}_gb"] = max(self.memory[f"{key}_gb"], allocated / 1e9)
            self.memory[f"{key}_reserved_gb"] = max(
                self.memory[f"{key}_reserved_gb"], reserved / 1e9
            )

    def record(self) -> dict[str, float]:
        """``time/<phase>_s``, the whole step's ``time/step_s`` and ``time/other_s`` (no phase's);
        on CUDA the ``memory/`` peaks and the engine's counted bytes."""
        record = {f"time/{phase}_s": seconds for phase, seconds in self.seconds.items()}
        record["time/step_s"] = time.perf_counter() - self.started
        record["time/other_s"] = record["time/step_s"] - sum(self.seconds.values())
        if self.memory:
            record |= self.memory
            record["memory/engine_gb"] = self.engine.allocated / 1e9
            record["memory/engine_reserved_gb"] = self.engine.reserved / 1e9
        return record
