"""models.py: a --model as users write it (the paper's models by their short names, once and in
one place for sage.py, evaluate.py and the memory plan; a bare name that names nothing is one
line; a hub that cannot be reached is one line in seconds, not minutes of retries); LoRA with
gradient checkpointing keeps the adapters' gradient; full fine-tuning keeps float32 weights; on
the CPU, freed activations are reused without page faults."""

import contextlib
import os
import socket
import subprocess
import sys

import huggingface_hub.constants
import pytest
import torch

import bounds
import evaluate
import loss
import sage
from extras import demo
from machinery import cli, memory_plan, models

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
        ("runs/sft/sft_model", "runs/sft/sft_model"),  # not there yet: the loader says so
    ],
)
def test_the_papers_models_go_by_their_short_names(offline, given, loaded):
    assert models.resolve_model(given) == loaded


def test_a_local_directory_wins_over_a_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen2.5-Math-7B").mkdir()
    assert models.resolve_model("Qwen2.5-Math-7B") == "Qwen2.5-Math-7B"


def test_sage_evaluate_and_the_plan_load_the_short_name_as_org_name(
    offline, tmp_path, monkeypatch, capsys
):
    """Offline: `--model Qwen2.5-Math-7B` reaches sage.py's loader as Qwen/Qwen2.5-Math-7B, said
    once (on CUDA the memory plan's config.json read comes first, with the same name);
    evaluate.py's --model and the memory plan resolve it the same way."""

    class Loaded(Exception):
        pass

    def load_tokenizer(base_path):  # the first of the model's files a run loads
        raise Loaded(base_path)

    def read_model_config(name):  # on CUDA, what the plan reads before the model loads
        raise Loaded(name)

    read_the_config = memory_plan.read_model_config  # the real one, for the last check
    monkeypatch.setattr(models, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(memory_plan, "read_model_config", read_model_config)
    monkeypatch.setattr(memory_plan, "card_of", lambda config: 80 * 10**9)  # on CUDA: an 80 GB card
    for device in ("cpu", "cuda"):  # the plan runs on CUDA only: both halves, forced
        with monkeypatch.context() as forced, pytest.raises(Loaded) as loaded:
            forced.setattr(torch.cuda, "is_available", lambda device=device: device == "cuda")
            forced.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU on purpose: the device check agrees
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
    retry five times (25 s refused, minutes silent) and end in a traceback; the run asks once,
    for a few seconds (``models.REACH_TIMEOUT_S``), and ends in one line."""
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
    try:
        result = subprocess.run(
            [sys.executable, os.path.join(REPO, "sage.py"), "--model", "Qwen2.5-Math-7B"]
            + ["--out", str(tmp_path / "runs")],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=120,  # (retries against a silent hub would take minutes)
        )
        asked = []  # the silent hub's requests, each left in its backlog: "GET /api/models/..."
        if hub_there == "silent":
            listener.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    connection = listener.accept()[0]
                    asked.append(connection.recv(4096).decode(errors="replace").split(" HTTP")[0])
                    connection.close()
    finally:
        listener.close()
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1], errors
    assert f"the hub at http://127.0.0.1:{port} cannot be reached" in errors[0]
    assert "Qwen/Qwen2.5-Math-7B" in errors[0]
    if hub_there == "silent":  # one try for the model, no retry
        assert [line for line in asked if "/api/models/" in line] == [
            "GET /api/models/Qwen/Qwen2.5-Math-7B"
        ], asked
    assert not (tmp_path / "runs").exists()


def test_gradient_checkpointing_keeps_the_lora_gradient(tmp_path, monkeypatch, float64_qwen2):
    """With the adapters the only trainable weights, checkpointed layers must still pass them a
    gradient (the input-gradient hook) and the same one as without checkpointing. Pinned to the
    CPU in float32 (on a GPU node the model would load on CUDA in bf16 beside a CPU batch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model_dir = demo.save_tiny_model(tmp_path / "model", max_position_embeddings=160)
    gradients = []
    for checkpointing in (False, True):
        model = models.load_base_model(model_dir, gradient_checkpointing=checkpointing)
        tokenizer = models.load_tokenizer(model_dir)
        # float64 (float64_qwen2: throughout): float32's bound over a forward and backward pass
        # is too loose
        model.double()
        torch.manual_seed(0)
        policy = sage.wrap_lora(model, rank=4, alpha=8)
        with torch.no_grad():  # a nonzero B, so every adapter weight gets a gradient
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
        policy.train()
        prompt, completion = (
            tokenizer("What is 3 + 4?")["input_ids"],
            tokenizer("3+4=7")["input_ids"],
        )
        batch = loss.collate(
            [prompt, prompt[2:]], [completion, completion[:3]], tokenizer.pad_token_id, "cpu"
        )
        logps, _ = loss.completion_logps(policy, batch, 1.0, 0.0)
        (logps * batch["completion_mask"]).sum().backward()
        gradients.append(
            {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        )
    assert gradients[1].keys() == gradients[0].keys() and all(
        g.abs().sum() > 0 for g in gradients[1].values()
    )
    # n = bounds.gradient_length over the batch's tokens, terms up to the largest entry
    n = bounds.gradient_length(model.config, tokens=batch["input_ids"].numel())
    for name in gradients[0]:
        magnitude = gradients[0][name].abs().max().item()
        tolerance = bounds.difference_bound(n=n, magnitude=magnitude, dtype=torch.float64)
        torch.testing.assert_close(gradients[1][name], gradients[0][name], atol=tolerance, rtol=0)


def test_full_finetuning_keeps_float32_weights_on_cuda_because_bf16_rounds_adamw_steps_away(
    monkeypatch,
):
    """In bf16, an AdamW step of lr = 5e-6 on a weight of 0.02 is lost to rounding (why the
    trained weights stay float32); LoRA keeps the frozen base in bf16 and gets no flash-attention
    in float32."""
    weight = torch.tensor([0.02], dtype=torch.bfloat16)
    assert torch.equal(weight - 5e-6, weight)  # the update rounds away
    assert not torch.equal(weight.float() - 5e-6, weight.float())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.device_and_dtype(full_finetune=True) == (torch.device("cuda"), torch.float32)
    assert models.device_and_dtype() == (torch.device("cuda"), torch.bfloat16)
    assert models.attention_implementation(torch.float32) == "sdpa"


# Six 16 MiB activations alive at once, then freed (a micro-batch's pattern), three times to warm
# up and ten times counted: prints the page faults of the ten.
REUSE_PROGRAM = """
import resource, torch
from machinery import models
assert models.keep_freed_memory()
def micro_batch():
    blocks = [torch.ones(4 * 2**20) for _ in range(6)]
    del blocks
micro_batch(); micro_batch(); micro_batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    micro_batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's page faults"
)
def test_keep_freed_memory_reuses_freed_activations_without_page_faults():
    """With it the ten micro-batches reuse the memory of the first three: at most one 16 MiB block
    (4,096 pages) faults in again. The warm-up is three because an aligned 16 MiB request needs a
    hole slightly larger than the block freed before it, so the freed holes take up to three
    micro-batches to merge, depending on what the imports left on the heap (measured: 0 to 8,192
    pages in the third, 0 from the fourth on). Without it glibc usually unmaps the freed blocks
    or trims them off the heap, and the ten fault ~245k pages (measured; a rare address layout
    keeps them by luck). Its own process: mallopt is process-wide."""
    result = subprocess.run(
        [sys.executable, "-c", REUSE_PROGRAM], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert int(result.stdout.split()[-1]) <= 4096 + 64, result.stdout
