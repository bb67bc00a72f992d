"""models.py: LoRA with gradient checkpointing keeps the adapters' gradient; full fine-tuning
keeps float32 weights; on the CPU, freed activations are reused without page faults."""

import os
import subprocess
import sys

import pytest
import torch

import bounds
import loss
import sage
from extras import demo
from machinery import models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gradient_checkpointing_keeps_the_lora_gradient(tmp_path, monkeypatch, float64_qwen2):
    """With the adapters the only trainable weights, checkpointed layers must still pass them a
    gradient (the input-gradient hook) and the same one as without checkpointing. Pinned to the
    CPU in float32 (on a GPU node the model would load on CUDA in bf16 beside a CPU batch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model_dir = demo.save_tiny_model(tmp_path / "model", max_position_embeddings=160)
    gradients = []
    for checkpointing in (False, True):
        model, tokenizer = models.load_base_model(model_dir, gradient_checkpointing=checkpointing)
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
    # a 7B model: float32 weights, gradients, AdamW's moments, a reference copy, a bf16 engine
    assert (
        round(models.full_finetune_bytes(7_615_616_512, 4, True, True, engine_bytes=2) / 1e9) == 168
    )


# Six 16 MiB activations alive at once, then freed (a micro-batch's pattern), twice to warm up and
# ten times counted: prints the page faults of the ten.
REUSE_PROGRAM = """
import resource, torch
from machinery import models
assert models.keep_freed_memory()
def micro_batch():
    blocks = [torch.ones(4 * 2**20) for _ in range(6)]
    del blocks
micro_batch(); micro_batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    micro_batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's page faults"
)
def test_keep_freed_memory_reuses_freed_activations_without_page_faults():
    """With it the ten micro-batches reuse the memory of the first two: at most one 16 MiB block
    (4,096 pages) faults in again. Without it glibc usually unmaps the freed blocks or trims them
    off the heap, and the ten fault ~245k pages (measured; a rare address layout keeps them by
    luck). Its own process: mallopt is process-wide."""
    result = subprocess.run(
        [sys.executable, "-c", REUSE_PROGRAM], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert int(result.stdout.split()[-1]) <= 4096 + 64, result.stdout
