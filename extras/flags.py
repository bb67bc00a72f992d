"""The extras' flags: the dataclasses that sage.py parses with its Config, and nothing else.

Every run of sage.py imports this module, so that ``--help`` lists the extras' flags and each
flag is parsed and checked before anything loads; the extras' code (extras/sft.py,
extras/dynamic_sampling.py, extras/hints.py) is imported only where its flag is on.
"""

from dataclasses import dataclass, field


@dataclass
class SFTConfig:
    """SFT warm start for base models (App. E.2, Table 7)."""

    sft_dataset: str = ""
    """SFT data (e.g. unsloth/OpenMathReasoning-mini) or a local file; empty skips SFT."""
    sft_dataset_config: str = ""
    """Hub configuration name of the SFT dataset."""
    sft_split: str = "cot"
    """Split of the SFT dataset (OpenMathReasoning-mini: cot)."""
    sft_problem_key: str = "problem"
    """SFT field with the problem."""
    sft_reasoning_key: str = "generated_solution"
    """SFT field with the worked solution (placed between the working-out markers)."""
    sft_answer_key: str = "expected_answer"
    """SFT field with the final answer (placed between <SOLUTION> markers)."""
    sft_max_samples: int = field(default=500, metadata={"range": ">= 0"})
    """Use the first N SFT examples that fit (0: all; App. E.2 uses a small subset)."""
    sft_max_tokens: int = field(default=0, metadata={"range": ">= 0"})
    """Drop SFT examples longer than this, prompt + completion + EOS (0: half of --max-seq-len,
    App. E.2)."""
    sft_only: bool = False
    """Stop after the SFT stage (its model, <run>/sft_model, is the base of every RL run of
    Table 1)."""
    sft_epochs: int = field(default=2, metadata={"range": ">= 1"})
    """SFT epochs (paper: 2)."""
    sft_lr: float = field(default=2e-4, metadata={"range": "> 0"})
    """SFT learning rate (paper: 2e-4)."""
    sft_batch_size: int = field(default=1, metadata={"range": ">= 1"})
    """SFT batch size (paper: 1)."""
    sft_warmup_steps: int = field(default=5, metadata={"range": ">= 0"})
    """SFT linear warmup steps (paper: 5)."""


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling and overlong shaping."""

    dynamic_sampling: bool = False
    """DAPO: drop all-equal-reward groups and refill (on in the dapo preset)."""
    max_refill_rounds: int = field(default=4, metadata={"range": ">= 0"})
    """DAPO dynamic sampling: extra rollout rounds at most before training on what is left."""
    overlong_buffer: int = field(default=0, metadata={"range": ">= 0"})
    """DAPO overlong shaping L_cache in tokens (0: off)."""


@dataclass
class HintsConfig:
    """Self-hints (arXiv 2602.03143) for all-wrong groups."""

    self_hints: bool = False
    """Self-hints (extras/hints.py): all-wrong groups get a policy-written hint from the
    reference solution and are sampled again."""
    solution_key: str = ""
    """Field of the training data with the reference solution that self-hints are written from."""
