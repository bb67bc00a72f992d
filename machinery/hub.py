"""A --model as users write it -> the name the loaders take, and a hub that cannot be reached.

``resolve_model`` is the one place that turns a --model into what transformers and vLLM load: a
local path or an ``org/name`` as it is, a short name of the paper's models (Qwen2.5-Math-7B)
with its organization (said once), any other bare name refused in one line naming ``org/name``.
A file not cached, huggingface_hub retries five times when the hub does not answer (back-off 1,
2, 4, 8, 8 s, each try waiting up to 60 s): half a minute to minutes, then a traceback. So a
hub name not in the cache is first tried once, briefly, and an unreachable hub is one line.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

from machinery import UsageError
from machinery.data import first_line
from machinery.vllm_backend import looks_like_hub_id

# Short names -> hub names: the paper's models (docs/gpu.md: Qwen2.5-Math-7B, the base of Table
# 1, and DeepSeek-R1-Distill-Qwen-7B, its R1-distill rows), their 1.5B siblings, and Llama 3.1 8B.
SHORT_NAMES = {
    name.lower(): f"{org}/{name}"
    for org, name in [
        ("Qwen", "Qwen2.5-Math-7B"),
        ("Qwen", "Qwen2.5-Math-1.5B"),
        ("deepseek-ai", "DeepSeek-R1-Distill-Qwen-7B"),
        ("deepseek-ai", "DeepSeek-R1-Distill-Qwen-1.5B"),
        ("meta-llama", "Llama-3.1-8B"),
        ("meta-llama", "Llama-3.1-8B-Instruct"),
    ]
}
REACH_TIMEOUT_S = 5.0  # one try; a hub that answers at all answers well within this


class ModelError(UsageError):
    """A --model that names nothing loadable, or a hub that cannot be reached (one line)."""


def hub_name(model: str) -> str:
    """What the loaders take for ``model``: a local path or an ``org/name`` as it is, a known
    short name with its organization (any case). Raises ModelError for another bare name.

    >>> hub_name("Qwen2.5-Math-7B"), hub_name("Qwen/Qwen2.5-Math-7B")
    ('Qwen/Qwen2.5-Math-7B', 'Qwen/Qwen2.5-Math-7B')
    """
    if "/" in model or os.path.exists(os.path.expanduser(model)):
        return model
    if model.lower() in SHORT_NAMES:
        return SHORT_NAMES[model.lower()]
    known = ", ".join(name.split("/")[1] for name in SHORT_NAMES.values())
    raise ModelError(
        f"--model {model}: neither a local directory nor a known model ({known}); name a hub "
        "model as org/name, e.g. Qwen/Qwen2.5-Math-7B"
    )


def unreachable(endpoint: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why the hub at ``endpoint`` does not answer one HTTP request within ``timeout_s`` (the
    proxy variables apply), or None when it answers (any status: it is there)."""
    try:
        urllib.request.urlopen(
            urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s
        ).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as error:  # refused, no route, timed out, not a URL
        reason = getattr(error, "reason", error)  # URLError wraps the socket's error
        return f"{type(reason).__name__}: {first_line(reason)}"
    return None


def in_cache(repo_id: str) -> bool:
    """The hub model's config.json is in the local cache (the loaders then fall back to it at
    once when the hub does not answer)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id: the loader says so
        return False


def resolve_model(model: str) -> str:
    """``model`` as the loaders take it (``hub_name``; a short name expanded is printed once, on
    stderr). A hub name neither cached nor reachable is a ModelError now, not minutes of retries
    later; offline mode (HF_HUB_OFFLINE=1) never asks the hub."""
    from huggingface_hub import constants

    resolved = hub_name(model)
    if resolved != model:
        print(f"[model] {model} is {resolved} on the hub", file=sys.stderr)
    local = os.path.exists(os.path.expanduser(resolved)) or not looks_like_hub_id(resolved)
    if local or constants.HF_HUB_OFFLINE or in_cache(resolved):
        return resolved
    if (why := unreachable(constants.ENDPOINT)) is not None:
        raise ModelError(
            f"--model {resolved}: the hub at {constants.ENDPOINT} cannot be reached ({why}) and "
            "the model is not in the local cache: check the network (or HF_ENDPOINT), or pass a "
            "local model directory"
        )
    return resolved


def cannot_load(model: str, error: BaseException) -> str:
    """The one line of a model that does not load (its config.json, tokenizer or weights), the
    same from the memory plan and the loader."""
    return (
        f"error: cannot load model {model!r} ({first_line(error)}); pass a local model directory "
        "or a cached hub name"
    )
