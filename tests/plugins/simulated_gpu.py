"""A pytest plugin that makes a CPU build of torch answer like a one-GPU node (an 80 GB H100) to
code that only *asks* ``torch.cuda``: whether it is there, its memory counters, its properties.
No kernel runs, so the tests marked ``cuda_kernels`` are skipped (tests/conftest.py).

It finds the tests that force one half of a device branch and let the other half ask the real
``torch.cuda``: on a GPU node they would fail. ``make test-gpu-sim`` runs the fast tests under it:

    PYTHONPATH=tests/plugins python -m pytest -p simulated_gpu -m "not slow"

Subprocesses that a test starts do not see it.
"""

import torch

CARD = type("Card", (), {"total_memory": 85_520_809_984, "name": "NVIDIA H100 80GB HBM3"})

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_properties = lambda *args, **kwargs: CARD
torch.cuda.get_rng_state_all = lambda: []
torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
for counter in (
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
):
    setattr(torch.cuda, counter, lambda *args, **kwargs: 0)
torch.cuda.mem_get_info = lambda *args, **kwargs: (CARD.total_memory, CARD.total_memory)
