"""A --model as users write it (machinery/hub.py): the paper's models by their short names, once
and in one place for sage.py, evaluate.py and the memory plan; a bare name that names nothing is
one line; and a hub that cannot be reached is one line in seconds, not minutes of retries."""

import os
import socket
import subprocess
import sys
import time

import huggingface_hub.constants
import pytest
import torch

import evaluate
import sage
from machinery import cli, hub, memory_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 as the loaders read it (tests/conftest.py sets the variable)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize(
    "given, loaded",
    [
        ("Qwen2.5-Math-7B", "Qwen/Qwen2.5-Math-7B"),
        ("qwen2.5-math-1.5b", "Qwen/Qwen2.5-Math-1.5B"),
        ("DeepSeek-R1-Distill-Qwen-7B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"),
        ("DeepSeek-R1-Distill-Qwen-1.5B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
        ("Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
        ("Qwen/Qwen2.5-Math-7B", "Qwen/Qwen2.5-Math-7B"),
        ("some-org/some-model", "some-org/some-model"),
    ],
)
def test_the_papers_models_go_by_their_short_names(given, loaded):
    assert hub.hub_name(given) == loaded


def test_a_local_directory_wins_over_a_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen2.5-Math-7B").mkdir()
    assert hub.hub_name("Qwen2.5-Math-7B") == "Qwen2.5-Math-7B"


def test_sage_evaluate_and_the_plan_load_the_short_name_as_org_name(
    offline, tmp_path, monkeypatch, capsys
):
    """Offline: `--model Qwen2.5-Math-7B` reaches sage.py's loader as Qwen/Qwen2.5-Math-7B, said
    once (on CUDA the memory plan's config.json read comes first, with the same name);
    evaluate.py's --model and the memory plan resolve it the same way."""

    class Loaded(Exception):
        pass

    def load_policy(config, base_path):
        raise Loaded(base_path)

    def read_model_config(name):  # on CUDA, what the plan reads before the model loads
        raise Loaded(name)

    read_the_config = memory_plan.read_model_config  # the real one, for the last check
    monkeypatch.setattr(sage, "load_policy", load_policy)
    monkeypatch.setattr(memory_plan, "read_model_config", read_model_config)
    monkeypatch.setattr(memory_plan, "card_of", lambda config: 80 * 10**9)  # on CUDA: an 80 GB card
    for device in ("cpu", "cuda"):  # the plan runs on CUDA only: both halves, forced
        with monkeypatch.context() as forced, pytest.raises(Loaded) as loaded:
            forced.setattr(torch.cuda, "is_available", lambda device=device: device == "cuda")
            forced.setenv(
                "CUDA_VISIBLE_DEVICES", ""
            )  # (no GPU on purpose: the device check agrees)
            sage.main(["--model", "Qwen2.5-Math-7B", "--out", str(tmp_path / "runs")])
        assert str(loaded.value) == "Qwen/Qwen2.5-Math-7B"
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[model]")]
        assert said == ["[model] Qwen2.5-Math-7B is Qwen/Qwen2.5-Math-7B on the hub"]

    evaluated = []
    monkeypatch.setattr(evaluate, "evaluate_and_report", evaluated.append)
    assert evaluate.main(["--model", "Qwen2.5-Math-7B", "--out", str(tmp_path / "r.json")]) == 0
    assert evaluated[0].model == "Qwen/Qwen2.5-Math-7B"

    with pytest.raises(SystemExit, match="cannot load model 'Qwen/Qwen2.5-Math-7B'"):
        read_the_config("Qwen2.5-Math-7B")  # not cached here: the loader's line


def test_a_bare_name_that_names_nothing_is_one_line_naming_org_name(offline, tmp_path, capsys):
    with pytest.raises(cli.UsageError) as refused:
        sage.main(["--model", "Qwen2.5-Math-7", "--out", str(tmp_path / "runs")])
    message = str(refused.value)
    assert "neither a local directory nor a known model" in message and "\n" not in message
    assert "org/name" in message and not (tmp_path / "runs").exists()
    assert evaluate.main(["--model", "Qwen2.5-Math-7", "--out", str(tmp_path / "r.json")]) == 2
    assert "org/name" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("hub_there", ["refusing", "silent"])
def test_without_a_network_a_run_fails_in_seconds_in_one_line(hub_there, tmp_path):
    """HF_HUB_OFFLINE unset and no hub: a loopback port that refuses connections, or one that
    accepts them and never answers (a network that drops packets). huggingface_hub alone would
    retry five times (25 s refused, minutes silent) and end in a traceback."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if hub_there == "refusing":
        listener.close()
    else:
        listener.listen(8)  # connections complete in the backlog; nothing is ever read or sent
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf")}
    env |= {"NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}  # loopback, not through a proxy
    start = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, os.path.join(REPO, "sage.py"), "--model", "Qwen2.5-Math-7B"]
            + ["--out", str(tmp_path / "runs")],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=120,
        )
    finally:
        listener.close()
    took = time.monotonic() - start
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1], errors
    assert f"the hub at http://127.0.0.1:{port} cannot be reached" in errors[0]
    assert "Qwen/Qwen2.5-Math-7B" in errors[0] and took < 30, (took, errors)
    assert not (tmp_path / "runs").exists()
