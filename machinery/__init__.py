"""Machinery the method runs on but does not consist of: run files and checkpoints, data loading,
answer grading and its worker pool, model loading, the command line, vLLM-on-CPU handling, the
fast log-prob kernel, metric trackers, the memory plan (and the engine's share of the GPU),
evaluate.py's results files, the weight push and input checks. It imports no chapter: a chapter
passes it what it needs.
"""


class UsageError(ValueError):
    """Input a command cannot use (data, a reward, a model, a tracker); the message names the
    problem and the fix, and ``cli.run`` prints it as one line. (It lives here, below every
    module, so that cli.py can check flags with the modules that raise it.)"""
