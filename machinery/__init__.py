"""Machinery the method runs on but does not consist of: run files and checkpoints, data loading,
answer grading and its worker pool, model loading, the command line, vLLM-on-CPU handling, the
fast log-prob kernel, the HF rollout backend and input checks.
"""
