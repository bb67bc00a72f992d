"""models.py: LoRA with gradient checkpointing keeps the adapters' gradient."""

import torch

import demo
import loss
import models


def test_gradient_checkpointing_keeps_the_lora_gradient(tmp_path):
    """With the adapters the only trainable weights, checkpointed layers must still pass them a
    gradient (the input-gradient hook) and the same one as without checkpointing."""
    model_dir = demo.save_tiny_model(tmp_path / "model", max_position_embeddings=160)
    gradients = []
    for checkpointing in (False, True):
        model, tokenizer = models.load_base_model(model_dir, gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        policy = models.wrap_lora(model, rank=4, alpha=8)
        with torch.no_grad():  # a nonzero B, so every adapter weight gets a gradient
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
        policy.train()
        prompt, completion = tokenizer("What is 3 + 4?")["input_ids"], tokenizer("3+4=7")["input_ids"]
        batch = loss.collate([prompt, prompt[2:]], [completion, completion[:3]], tokenizer.pad_token_id, "cpu")
        logps, _ = loss.completion_logps(policy, batch, 1.0, 0.0)
        (logps * batch["completion_mask"]).sum().backward()
        gradients.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad})
    assert gradients[1].keys() == gradients[0].keys() and all(g.abs().sum() > 0 for g in gradients[1].values())
    for name in gradients[0]:
        torch.testing.assert_close(gradients[1][name], gradients[0][name], atol=1e-5, rtol=1e-4)
