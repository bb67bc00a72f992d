"""Where a run's numbers go: metrics.jsonl always, TensorBoard and Weights & Biases on request.

``--report-to jsonl,tensorboard,wandb`` picks them. Every tracker receives the same records with
the same keys (``reward``, ``kl/ref_k3``, ``q/mean``, ``time/rollout_s``, ``eval/<benchmark>/pass@1``
...), one record per optimizer step, so a curve means the same thing in each. W&B is an optional
dependency; with ``WANDB_MODE=offline`` it writes its files locally and needs no network (``wandb
sync`` uploads them later).
"""

from __future__ import annotations

import math
import os

import runs

TRACKERS = ("jsonl", "tensorboard", "wandb")


class TrackerError(ValueError):
    """A tracker that cannot be used as asked; the message names the fix."""


def parse_report_to(spec: str) -> list[str]:
    """``"tensorboard,wandb"`` -> ["jsonl", "tensorboard", "wandb"] (jsonl is always on).

    >>> parse_report_to("wandb"), parse_report_to("")
    (['jsonl', 'wandb'], ['jsonl'])
    """
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise TrackerError(f"unknown --report-to {unknown[0]!r}: choose among {', '.join(TRACKERS)}")
    return ["jsonl"] + [name for name in TRACKERS[1:] if name in names]


class Trackers:
    """The run's trackers: ``log(record, step)`` sends one record to each, ``close()`` ends them."""

    def __init__(self, report_to: str, run_dir: str, run_name: str, config: dict, resume: bool = False):
        self.names = parse_report_to(report_to)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.tensorboard = self.wandb = None
        if "tensorboard" in self.names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrackerError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if "wandb" in self.names:
            try:
                import wandb
            except ImportError:
                raise TrackerError("--report-to wandb needs the wandb package: pip install wandb") from None
            # The run's id is its name, so --resume continues the same W&B run.
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "sage-rl"), name=run_name,
                                    id=run_name.replace("/", "-"), dir=run_dir, config=config,
                                    resume="allow" if resume else None)

    def log(self, record: dict, step: int) -> None:
        runs.append_jsonl(self.metrics_path, record)
        numbers = {key: value for key, value in record.items()
                   if isinstance(value, (int, float)) and key != "step" and math.isfinite(value)}
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
            self.wandb.finish()
