"""trl_sage.py: SAGE on TRL's GRPOTrainer computes the loss sage.py computes.

Differential: on identical inputs the TRL path's loss and gradient equal those of sage.py's own
pieces (loss.collate, loss.completion_logps, guides.compute_log_q, loss.policy_loss) with the branch
and token guides; at q = 1 they equal TRL's own GRPO loss. End to end: a 2-step run of the CLI and a
1-step run under `accelerate launch --num_processes 2` on CPU (gloo), as subprocesses.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl", reason="trl is installed by `make install`")

import demo  # noqa: E402
import guides  # noqa: E402
import loss  # noqa: E402
import trl_sage  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    train, _ = demo.demo_problems(0, 10)
    path = tmp_path_factory.mktemp("trl_data") / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": p["problem"], "solution": p["answer"]}) + "\n" for p in train[:40]))
    return str(path)


def tiny_args(model_dir, data_file, out, **overrides):
    values = dict(model=model_dir, dataset=data_file, steps=2, prompts_per_step=2, rollouts=4, micro_batch_size=4,
                  max_seq_len=160, max_prompt_len=96, use_vllm=False, gradient_checkpointing=False, out=str(out),
                  guide="branch", tau=0.5)
    return trl_sage.TRLArgs(**{**values, **overrides})


def make_inputs(trainer, seed):
    """TRL's training inputs for 4 completions of equal-length prompts (so that TRL's forward,
    which does not pass position ids, and sage.py's, which does, see the same positions)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(10, vocab - 10, (4, 9), generator=generator)
    completion_ids = torch.randint(10, vocab - 10, (4, 7), generator=generator)
    completion_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4, [1] * 6 + [0]])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones_like(prompt_ids), completion_mask], 1), 7)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -0.5, 0.8, -1.3]),
        "old_per_token_logps": logps + 0.1 * torch.randn(logps.shape, generator=generator),
        "ref_per_token_logps": logps + 0.2 * torch.randn(logps.shape, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }


def loss_and_gradient(trainer, compute):
    trainer.model.zero_grad(set_to_none=True)
    value = compute()
    value.backward()
    gradient = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    trainer.model.zero_grad(set_to_none=True)
    return value.detach(), gradient


def sage_loss(trainer, inputs, guide, aggregation):
    """The same loss from sage.py's own pieces: its batching, forward pass, guide and loss."""
    batch = loss.collate(inputs["prompt_ids"].tolist(),
                         [row[: int(m.sum())].tolist() for row, m in zip(inputs["completion_ids"], inputs["completion_mask"])],
                         0, "cpu")
    logps, entropies = loss.completion_logps(trainer.model, batch, trainer.temperature, 0.0)
    mask = batch["completion_mask"]
    log_q = guides.compute_log_q(guide, inputs["old_per_token_logps"], entropies, mask, 0, trainer.args.max_steps,
                                 torch.Generator().manual_seed(123))
    value, _ = loss.policy_loss(logps, inputs["old_per_token_logps"], inputs["advantages"], mask,
                                inputs["ref_per_token_logps"], log_q, beta=trainer.beta, kl="reverse",
                                kl_estimator="k3", eps_low=trainer.epsilon_low, eps_high=trainer.epsilon_high,
                                aggregation=aggregation, max_completion_length=trainer.max_completion_length,
                                global_num_tokens=inputs["num_items_in_batch"].float())
    return value


@pytest.mark.parametrize("guide_name", ["branch", "token"])
def test_the_trl_loss_equals_sage_py_s_with_a_guide(tiny_model_dir, data_file, tmp_path, guide_name):
    trainer = trl_sage.build_trainer(tiny_args(tiny_model_dir, data_file, tmp_path, guide=guide_name, micro_batch_size=8,
                                               prompts_per_step=2))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by TRL's loop
    assert trainer.current_gradient_accumulation_steps == 1
    trainer.model.train()
    inputs = make_inputs(trainer, seed=1)
    trainer.guide_generator = torch.Generator().manual_seed(123)
    trl_value, trl_gradient = loss_and_gradient(trainer, lambda: trainer.compute_loss(trainer.model, inputs))
    guide = guides.GuideConfig(name=guide_name, tau=0.5)
    sage_value, sage_gradient = loss_and_gradient(trainer, lambda: sage_loss(trainer, inputs, guide, "grpo"))
    assert trl_gradient.abs().max() > 0
    torch.testing.assert_close(trl_value, sage_value, atol=1e-6, rtol=0)
    torch.testing.assert_close(trl_gradient, sage_gradient, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("aggregation", ["grpo", "batch_token_mean", "dr_grpo", "dapo"])
def test_at_q_equal_one_the_trl_loss_equals_trl_s_own(tiny_model_dir, data_file, tmp_path, aggregation):
    """No guide: SAGE's loss is TRL's GRPO loss (use_bias_correction_kl off), value and gradient,
    for each of TRL's loss types it reproduces (TRL's "bnpo" is batch_token_mean here)."""
    trainer = trl_sage.build_trainer(tiny_args(tiny_model_dir, data_file, tmp_path, guide="none", loss_agg=aggregation))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by TRL's loop
    trainer.model.train()
    inputs = make_inputs(trainer, seed=2)
    ours = loss_and_gradient(trainer, lambda: trainer.compute_loss(trainer.model, inputs))
    theirs = loss_and_gradient(trainer, lambda: GRPOTrainer._compute_loss(trainer, trainer.model, inputs))
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-6, rtol=1e-5)


def test_the_private_trl_method_we_call_has_the_pinned_signature():
    message = trl_sage.private_signature_matches()
    assert message is None, message


def test_knobs_trl_cannot_run_are_one_line_errors(tiny_model_dir, data_file, tmp_path):
    for overrides, text in [({"kl_estimator": "k1_return"}, "not available on TRL"),
                            ({"advantage": "bnpo"}, "--advantage bnpo is not available on TRL"),
                            ({"guide": "branch", "beta": 0.0}, "acts only through the KL anchor")]:
        with pytest.raises(ValueError, match=text):
            trl_sage.validate(tiny_args(tiny_model_dir, data_file, tmp_path, **overrides))


def run(command, timeout=600):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=ENV)


TINY_FLAGS = ["--steps", "2", "--prompts-per-step", "2", "--rollouts", "4", "--micro-batch-size", "2",
              "--max-seq-len", "160", "--max-prompt-len", "96", "--no-use-vllm", "--no-gradient-checkpointing",
              "--guide", "branch"]


@pytest.mark.slow
def test_a_two_step_trl_run(tiny_model_dir, data_file, tmp_path):
    result = run([sys.executable, "trl_sage.py", "--model", tiny_model_dir, "--dataset", data_file, *TINY_FLAGS,
                  "--out", str(tmp_path), "--name", "two"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(tmp_path / "two" / "adapter_model.safetensors")
    assert "'q/mean'" in result.stdout + result.stderr


@pytest.mark.slow
def test_one_step_on_two_processes_with_accelerate(tiny_model_dir, data_file, tmp_path):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    result = run([*launcher, "trl_sage.py", "--model", tiny_model_dir, "--dataset", data_file, *TINY_FLAGS,
                  "--steps", "1", "--out", str(tmp_path), "--name", "ddp"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(tmp_path / "ddp" / "adapter_model.safetensors")


def test_a_bad_flag_is_one_line(tmp_path):
    result = run([sys.executable, "trl_sage.py", "--model", "m", "--kl-estimator", "k1_return", "--out", str(tmp_path)])
    assert result.returncode != 0 and "not available on TRL" in result.stderr.strip().splitlines()[-1]
