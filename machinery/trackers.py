"""Where a run's numbers go: metrics.jsonl always, TensorBoard and Weights & Biases on request.

``--report-to jsonl,tensorboard,wandb`` picks them. Every tracker receives the same records with
the same keys (``reward``, ``kl/ref_k3``, ``q/mean``, ``time/rollout_s``,
``eval/<benchmark>/pass@1`` ...), one record per optimizer step, so a curve means the same thing
in each. W&B is an optional dependency; with ``WANDB_MODE=offline`` it writes its files locally
and needs no network (``wandb sync`` uploads them later).
"""

from __future__ import annotations

import dataclasses
import math
import os

from tqdm import tqdm

from machinery import UsageError, runs

TRACKERS = ("jsonl", "tensorboard", "wandb")


class TrackerError(UsageError):
    """A tracker that cannot be used as asked; the message names the fix."""


def parse_report_to(spec: str) -> list[str]:
    """``"tensorboard,wandb"`` -> ["jsonl", "tensorboard", "wandb"] (jsonl is always on).

    >>> parse_report_to("wandb"), parse_report_to("")
    (['jsonl', 'wandb'], ['jsonl'])
    """
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise TrackerError(
            f"unknown --report-to {unknown[0]!r}: choose among {', '.join(TRACKERS)}"
        )
    return ["jsonl"] + [name for name in TRACKERS[1:] if name in names]


class Trackers:
    """The run's trackers: ``log(record, step)`` sends one record to each, ``close()`` ends them."""

    def __init__(
        self, report_to: str, run_dir: str, run_name: str, config: dict, resume: bool = False
    ):
        self.names = parse_report_to(report_to)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.tensorboard = self.wandb = None
        if "tensorboard" in self.names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrackerError(
                    "--report-to tensorboard needs the tensorboard package: pip install tensorboard"
                ) from None
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if "wandb" in self.names:
            try:
                import wandb
            except ImportError:
                raise TrackerError(
                    "--report-to wandb needs the wandb package: pip install wandb"
                ) from None
            # The run's id is its name, so --resume continues the same W&B run.
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "sage-rl"),
                name=run_name,
                id=run_name.replace("/", "-"),
                dir=run_dir,
                config=config,
                resume="allow" if resume else None,
            )

    def log(self, record: dict, step: int) -> None:
        runs.append_jsonl(self.metrics_path, record)
        numbers = {
            key: value
            for key, value in record.items()
            if isinstance(value, (int, float)) and key != "step" and math.isfinite(value)
        }
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def log_extra(self, values: dict, step: int) -> None:
        """Numbers that have a file of their own (evaluations: eval.jsonl) to the other trackers."""
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            wandb.teardown()  # ends the service process wandb.init started, and its variable


# --------------------------------------------------------------------------------------------
# What a run shows and records: the progress bar, metrics.jsonl, trackers, evaluations
# --------------------------------------------------------------------------------------------


class RunLogger:
    """A run's records: one metrics.jsonl line per step (and the --report-to trackers), the
    progress bar, the zero-reward warning, and the rows of each evaluation (evaluate.py's) in
    eval.jsonl."""

    def __init__(self, config, run_dir: str, forecast_gb: float | None = None):
        self.config, self.run_dir = config, run_dir
        # the memory plan's trainer_peak_gb (CUDA), checked against the logged peaks each step
        self.forecast_gb = forecast_gb
        self.peak_gb: float | None = None  # the trainer's highest peak allocated so far (CUDA)
        self.trackers = Trackers(
            config.report_to,
            run_dir,
            os.path.basename(run_dir),
            dataclasses.asdict(config),
            config.resume,
        )
        self.zero_reward_streak = 0

    def log_step(
        self, step: int, rollouts, rewards, metrics: dict, timer, lr: float, progress=None
    ) -> None:
        """One line of metrics.jsonl (and the trackers), the figures on the ``progress`` bar, the
        zero-reward warning."""
        lengths = [len(c) for c in rollouts.completion_ids]
        record = {
            "step": step,
            "reward": rewards.mean().item(),
            "accuracy": (rewards > 0.5).float().mean().item(),
            "response_length": sum(lengths) / max(1, len(lengths)),
            "frac_truncated": sum(r == "length" for r in rollouts.finish_reasons)
            / max(1, len(lengths)),
            "lr": lr,
            **metrics,
            **timer.record(),
        }
        self.trackers.log(record, step)
        self.check_memory(record, step)
        if progress is not None:
            progress.set_postfix(
                reward=f"{record['reward']:.3f}", kl=f"{record.get('kl/ref_k3', 0.0):.4f}"
            )
        all_zero = rewards.numel() == 0 or rewards.max() <= 0
        self.zero_reward_streak = self.zero_reward_streak + 1 if all_zero else 0
        if self.zero_reward_streak == self.config.zero_reward_warning:
            tqdm.write(
                f"warning: {self.zero_reward_streak} steps in a row with all-zero rewards: no "
                "learning signal; check the answer format and the reward, or warm-start with "
                "--sft-dataset"
            )

    def check_memory(self, record: dict, step: int) -> None:
        """On CUDA: the trainer's peak allocated so far (the engine's counted bytes left out, as
        the plan's trainer share leaves them out), and one line the first time a step's exceeds
        that forecast."""
        peaks = [v for k, v in record.items() if k.startswith("memory/") and k.endswith("_peak_gb")]
        if not peaks:
            return
        first_excess = self.peak_gb is None or self.peak_gb <= (self.forecast_gb or math.inf)
        self.peak_gb = max(self.peak_gb or 0.0, max(peaks))
        if first_excess and self.peak_gb > (self.forecast_gb or math.inf):
            tqdm.write(memory_line(self.peak_gb, self.forecast_gb, f"step {step}"))

    def log_evaluation(self, rows: list[dict]) -> None:
        """An evaluation's rows (evaluate.training_evaluation's) into eval.jsonl, the trackers and
        one line each."""
        for row in rows:
            runs.append_jsonl(os.path.join(self.run_dir, "eval.jsonl"), row)
            numbers = {key: value for key, value in row.items() if key.startswith("pass@")}
            for group, entry in row.get("support", {}).items():
                numbers |= {
                    f"support/{group}/{key}": value
                    for key, value in entry.items()
                    if isinstance(value, float)
                }
            self.trackers.log_extra(
                {f"eval/{row['benchmark']}/{key}": value for key, value in numbers.items()},
                row["step"],
            )
            n = row["n"]
            tqdm.write(
                f"eval after {row['step']} steps, {row['benchmark']}: pass@1 "
                f"{row['pass@1']:.3f}, pass@{n} {row[f'pass@{n}']:.3f}"
            )

    def close(self) -> None:
        if self.peak_gb is not None:
            print(memory_line(self.peak_gb, self.forecast_gb, "the run"))
        self.trackers.close()


def memory_line(peak_gb: float, forecast_gb: float | None, what: str) -> str:
    """The trainer's peak allocated GPU memory against the plan's forecast, in one line.

    >>> memory_line(41.5, 38.0, "step 3")
    "[memory] step 3: the trainer peaked at 41.5 GB allocated, above the plan's 38.0 GB"
    """
    if forecast_gb is None:
        return f"[memory] {what}: the trainer peaked at {peak_gb:.1f} GB allocated, no plan"
    side = "above" if peak_gb > forecast_gb else "within"
    return (
        f"[memory] {what}: the trainer peaked at {peak_gb:.1f} GB allocated, {side} the plan's "
        f"{forecast_gb:.1f} GB"
    )
