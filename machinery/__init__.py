"""Machinery the method runs on but does not consist of: the run's files (config, metrics and
their trackers, checkpoints), model loading, the command line, vLLM-on-CPU handling, the fast
log-prob kernel, the memory plan (and the engine's share of the GPU), evaluate.py's results
files, the engine's input checks. The task (problems, prompt, grading, reward) is task/'s.
It imports no chapter: a chapter passes it what it needs.
"""


class UsageError(ValueError):
    """Input a command cannot use (data, a reward, a model, a tracker); the message names the
    problem and the fix, and ``cli.run`` prints it as one line. (It lives here, below every
    module, so that cli.py can check flags with the modules that raise it.)"""
