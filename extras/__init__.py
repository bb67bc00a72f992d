"""Features beyond the paper's core run: the CPU demo, the comparison study, self-hints, the TRL
scale-out, metric trackers, analyses, the SFT warm start and DAPO's dynamic sampling.

The trainer reaches each through one flagged call and imports it inside that branch, so a reader
of the default step never opens this folder.
"""
