"""Features beyond the paper's core run: the CPU demo, the comparison study and the two-mode study,
self-hints, the TRL scale-out, analyses, the SFT warm start, DAPO's dynamic sampling and the hf
rollout backend.

The trainer reaches each through one flagged call and imports it inside that branch, so a reader
of the default step never opens this folder. Every run imports only flags.py, the extras' flags
(plain dataclasses that sage.py parses with its Config).
"""
