"""The memory plan (machinery/memory_plan.py): its simulated update agrees with a real CPU step
counted the same way, --plan-memory prints a verdict and a JSON line from config.json alone
(extras/memory_report.py), a CUDA run that cannot fit is refused before the model loads (the CPU
torch beside an NVIDIA GPU: tests/test_flags.py)."""

import copy
import dataclasses
import json
import math
import os
import sys
import types

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

import evaluate
import sage
from extras import memory_report, memory_sim
from machinery import memory_plan, models, vllm_backend

TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
SEVEN_B_SHAPE = dict(  # Qwen2.5-Math-7B
    **memory_plan.QWEN25_MATH_7B, max_position_embeddings=4096, tie_word_embeddings=False
)
TINY_RUN = ["--prompts-per-step", "2", "--rollouts", "4", "--max-seq-len", "160"]
TINY_RUN += ["--max-prompt-len", "32"]


@pytest.fixture(scope="module")
def tiny_config_dir(tmp_path_factory):
    """A directory that holds only a tiny Qwen2's config.json (no weights, no tokenizer)."""
    folder = tmp_path_factory.mktemp("tiny_config")
    Qwen2Config(**TINY_SHAPE).save_pretrained(folder)
    return str(folder)


def run_config(**overrides):
    settings = dict(model="tiny", prompts_per_step=2, rollouts=4, max_seq_len=160)
    return sage.Config(**{**settings, "max_prompt_len": 32, "steps": 10, **overrides})


@pytest.mark.slow
def test_the_simulated_update_peak_is_a_real_cpu_steps_within_5_percent():
    """The same step, once on the meta device (no values) and once for real on the CPU, both
    counted storage by storage: the simulation's peak is the real one within 5% (the
    activations, not the weights, make most of it)."""
    model_config, config = Qwen2Config(**TINY_SHAPE), run_config(micro_batch_size=4)
    simulated = memory_sim.simulate_update(model_config, config, torch.float32, "meta")
    real = memory_sim.simulate_update(model_config, config, torch.float32, "cpu")
    assert simulated["weights"] == real["weights"]
    assert simulated["peak"] == pytest.approx(real["peak"], rel=0.05)
    assert real["peak"] > 5 * real["weights"]


@pytest.mark.slow  # six simulations of the 7B's update on the meta device (about 60 s in all)
@pytest.mark.parametrize(
    "length, full_finetune, checkpointing",
    [
        pytest.param(2048, False, True, id="2048-lora-checkpointing"),
        pytest.param(2048, True, True, id="2048-full-finetune-checkpointing"),
        pytest.param(8192, False, True, id="8192-lora-checkpointing"),
        pytest.param(8192, True, True, id="8192-full-finetune-checkpointing"),
        pytest.param(2048, False, False, id="2048-lora-no-checkpointing"),
        pytest.param(8192, True, False, id="8192-full-finetune-no-checkpointing"),
    ],
)
def test_the_formula_is_the_simulated_7b_update_within_5_percent(
    length, full_finetune, checkpointing
):
    """The run's refusal reads ``estimate_update_peak``; the meta-device simulation checks it at
    the paper's shapes: Qwen2.5-Math-7B, micro-batch 4, prompts of up to 512 tokens, 2,048 and
    8,192 tokens (docs/gpu.md), LoRA and full fine-tune, with gradient checkpointing (the
    default); and the formula's other branch, without it, once at each length (LoRA at 2,048,
    the full fine-tune at 8,192)."""
    model_config = Qwen2Config(**{**SEVEN_B_SHAPE, "max_position_embeddings": 32768})
    config = sage.Config(
        model="seven-b",
        max_seq_len=length,
        max_prompt_len=512,
        full_finetune=full_finetune,
        gradient_checkpointing=checkpointing,
    )
    dtype = memory_plan.trainer_dtype(config)
    simulated = memory_sim.simulate_update(model_config, config, dtype)
    estimate = memory_plan.estimate_update_peak(model_config, config, dtype, True)
    assert estimate["resident"] == pytest.approx(simulated["resident"], rel=1e-6)
    assert estimate["peak"] == pytest.approx(simulated["peak"], rel=0.05)


@pytest.mark.parametrize("full_finetune", [False, True], ids=["lora", "full-finetune"])
def test_the_formulas_terms_on_a_tiny_shape(full_finetune):
    """On a tiny Qwen2, the formula's weights and resident bytes (the adapters or every weight,
    the frozen reference, AdamW's moments) are the simulation's but for the rotary table's few
    floats (64 bytes a copy here). Its peak is the
    simulation's within 10%: at this size the small tensors the formula leaves out (rotary
    tables, per-token values of the loss) weigh more than at a 7B's."""
    model_config = Qwen2Config(**TINY_SHAPE)
    config = run_config(micro_batch_size=4, full_finetune=full_finetune)
    dtype = memory_plan.trainer_dtype(config)
    simulated = memory_sim.simulate_update(model_config, config, dtype)
    estimate = memory_plan.estimate_update_peak(model_config, config, dtype, True)
    assert estimate["weights"] == pytest.approx(simulated["weights"], abs=2 * 64)
    assert estimate["resident"] == pytest.approx(simulated["resident"], abs=2 * 64)
    assert estimate["peak"] == pytest.approx(simulated["peak"], rel=0.10)


def test_plan_memory_prints_a_verdict_and_a_json_line_and_writes_nothing(
    tiny_config_dir, tmp_path, capsys
):
    argv = ["--model", tiny_config_dir, "--plan-memory", "--gpu-gb", "48", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as ended:
        sage.main([*argv, *TINY_RUN])
    assert ended.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(lines[-1])
    assert lines[-2].startswith("verdict: fits a 48 GB card")
    assert plan["fits"] and plan["gpu_gb"] == 48 and plan["largest_micro_batch"] == 8
    assert "the update by the formula" in lines[0] and not plan["update_simulated"]
    assert plan["update_peak_gb"] == plan["update_peak_formula_gb"]
    assert plan["update_peak_gb"] <= plan["run_peak_gb"] <= plan["usable_gb"]
    assert plan["engine_share"] >= 0.3 and "not counted" in plan["not_counted"]
    assert os.listdir(tmp_path) == []  # no run directory
    # python -m extras.memory_sim with the same flags: the update simulated, the formula beside
    memory_sim.print_plan(sage.parse_config([*argv, *TINY_RUN]))
    lines = capsys.readouterr().out.strip().splitlines()
    simulated = json.loads(lines[-1])
    assert "simulated on the meta device" in lines[0] and simulated["update_simulated"]
    update_line = next(line for line in lines if "update peak" in line)
    assert f"the formula: {simulated['update_peak_formula_gb']:.2f} GB" in update_line
    assert simulated["update_peak_formula_gb"] == plan["update_peak_formula_gb"]


@pytest.mark.slow
def test_the_plan_of_the_7b_step_is_the_simulated_20_1_gb_of_docs_gpu(tmp_path):
    """docs/gpu.md's meta-device figure for the 256 + 1,536-token step at micro-batch 4."""
    Qwen2Config(**SEVEN_B_SHAPE).save_pretrained(tmp_path)
    config = sage.Config(model=str(tmp_path), max_seq_len=1792, max_prompt_len=256)
    config.extras["memory"] = memory_plan.PlanConfig()
    plan = memory_report.plan(
        config, card_bytes=48 * 10**9, with_reference=sage.needs_reference(config)
    )
    assert plan["update_peak_gb"] == pytest.approx(20.1, rel=0.05)
    assert plan["update_peak_formula_gb"] == pytest.approx(20.1, rel=0.05)
    assert plan["trainer_weights_gb"] == pytest.approx(15.3, abs=0.1) and plan["fits"]


def test_a_cuda_run_that_cannot_fit_is_refused_before_the_model_loads(
    tiny_config_dir, tmp_path, monkeypatch
):
    """Forced onto the plan's CUDA path on a card its update peak exceeds at micro-batch 4 but
    not at 1 (the HF backend: no engine beside it): one line naming --micro-batch-size. The
    refusal reads the formula's peak: no simulation runs on the run's path."""
    config = run_config(model=tiny_config_dir, backend="hf")
    peaks = {}
    for micro_batch in (1, 4):
        trial = run_config(model=tiny_config_dir, backend="hf", micro_batch_size=micro_batch)
        model_config = memory_plan.read_model_config(tiny_config_dir)
        dtype = memory_plan.trainer_dtype(config)
        estimate = memory_plan.estimate_update_peak(model_config, trial, dtype, True)
        peaks[micro_batch] = estimate["peak"]
    card_gb = (peaks[1] + peaks[4]) / 2 / 0.95 / 1e9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def simulate_update(*args, **kwargs):
        raise AssertionError("the run's path simulated the update")

    monkeypatch.setattr(memory_sim, "simulate_update", simulate_update)

    def load_policy(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(sage, "load_policy", load_policy)
    argv = ["--model", tiny_config_dir, "--backend", "hf", "--gpu-gb", str(card_gb)]
    with pytest.raises(SystemExit) as refused:
        sage.main([*argv, *TINY_RUN, "--out", str(tmp_path)])
    message = str(refused.value)
    assert message.startswith("error: the run does not fit a") and "\n" not in message
    assert message.endswith("pass --micro-batch-size 2") or message.endswith("size 1")
    assert os.listdir(tmp_path) == []
    # The same run on a card it fits says nothing and goes on.
    fits = run_config(model=tiny_config_dir, backend="hf")
    fits.extras["memory"] = memory_plan.PlanConfig(gpu_gb=card_gb * 10)
    # its forecast, for the run's logger
    forecast_gb = memory_plan.before_loading(fits, sage.needs_reference(fits))
    assert forecast_gb is not None and 0 <= forecast_gb < card_gb


def test_the_engine_share_that_cannot_fit_names_its_flags(tiny_config_dir, monkeypatch):
    config = run_config(model=tiny_config_dir)
    config.extras["memory"] = memory_plan.PlanConfig(gpu_gb=2)  # the engine alone needs > 2 GB
    with pytest.raises(SystemExit, match="lower --max-seq-len or use a larger GPU, or pass "):
        # --backend hf: its plan fits (no engine)
        memory_plan.before_loading(config, sage.needs_reference(config))
    config.full_finetune = True  # the trainer's float32 state is what crowds the engine out
    with pytest.raises(SystemExit, match="use a larger GPU, or drop --full-finetune"):
        memory_plan.before_loading(config, sage.needs_reference(config))


def test_a_full_finetune_is_one_refusal_on_cuda_and_a_weights_check_where_no_plan_runs(
    tmp_path, monkeypatch
):
    """On CUDA the plan refuses a 7B --full-finetune on an 80 GB card from its float32 weights,
    AdamW's moments and reference alone, naming --full-finetune and no flag that cannot help. Where
    no plan runs (the CPU, extras/trl_sage.py), ``check_full_finetune_fits`` counts the same
    weights, their gradients and a bf16 engine's copy on CUDA: 168 GB."""
    Qwen2Config(**SEVEN_B_SHAPE).save_pretrained(tmp_path)
    config = sage.Config(model=str(tmp_path), full_finetune=True)
    config.extras["memory"] = memory_plan.PlanConfig(gpu_gb=80)
    with pytest.raises(SystemExit) as refused:
        memory_plan.before_loading(config, sage.needs_reference(config))
    message = str(refused.value)
    assert message.endswith("alone take 121.8 GB: drop --full-finetune (LoRA, the paper's setting)")
    assert "--max-seq-len" not in message and "--backend hf" not in message
    card = type("Card", (), {"total_memory": 80 * 10**9})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    with pytest.raises(SystemExit, match="7.6B-parameter model needs about 168 GB") as refused:
        memory_plan.check_full_finetune_fits(str(tmp_path), with_reference=True, with_engine=True)
    assert "drop --full-finetune" in str(refused.value) and "\n" not in str(refused.value)
    # A model that does not read passes here: the loader says why, in its own line.
    assert memory_plan.check_full_finetune_fits(str(tmp_path / "none"), True, True) is None


@pytest.mark.slow
def test_the_plan_of_the_hf_backend_counts_generates_kv_cache(tmp_path, capsys):
    """--backend hf samples the step's 64 rows at once with the trainer's model: at 8,192 tokens
    the plan's sampling term is their KV cache (2 x layers x kv_heads x head_dim x bf16 bytes x
    rows x length) within 10%, a row of the report and a part of the run's peak. On a 24 GB card
    the engine does not fit, and the hf backend is not named, since its plan does not fit either."""
    Qwen2Config(**{**SEVEN_B_SHAPE, "max_position_embeddings": 32768}).save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--plan-memory", "--backend", "hf", "--gpu-gb", "80"]
    with pytest.raises(SystemExit) as ended:
        sage.main([*argv, "--max-seq-len", "8192", "--out", str(tmp_path / "runs")])
    assert ended.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(lines[-1])
    assert any(line.strip().startswith("sampling (generate)") for line in lines)
    shape = memory_plan.QWEN25_MATH_7B
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_cache = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2
    kv_cache *= 64 * 8192
    assert plan["hf_kv_cache_gb"] == pytest.approx(kv_cache / 1e9, abs=0.01)
    assert kv_cache <= plan["hf_sampling_gb"] * 1e9 <= 1.1 * kv_cache
    resident, sampling = plan["trainer_resident_gb"], plan["hf_sampling_gb"]
    assert plan["run_peak_gb"] == pytest.approx(max(plan["update_peak_gb"], resident + sampling))
    config = sage.Config(model=str(tmp_path), max_seq_len=8192)
    config.extras["memory"] = memory_plan.PlanConfig(gpu_gb=24)
    result = memory_report.plan(
        config, card_bytes=24 * 10**9, with_reference=sage.needs_reference(config)
    )
    assert result["engine_problem"] and not result["hf_backend_fits"]
    assert "--backend hf" not in result["verdict"]


def test_a_step_whose_kv_cache_does_not_fit_samples_in_waves(tmp_path):
    """The R1-distill rows (8,192 tokens) on a 48 GB card: the KV cache of all 64 sequences
    (30 GB) cannot sit beside two bf16 copies of the 7B, so the engine holds as many as fit and
    the step samples in waves; at 2,048 tokens on 80 GB the whole step fits at once."""
    Qwen2Config(**SEVEN_B_SHAPE).save_pretrained(tmp_path)
    model_config = memory_plan.read_model_config(str(tmp_path))
    long_run = sage.Config(model=str(tmp_path), max_seq_len=8192)
    peaks = memory_plan.forecast(long_run, 48 * 10**9, True)
    engine, resident = peaks["engine"], peaks["update"]["resident"]
    assert not peaks["engine_problem"] and 1 <= engine["sequences"] < 64
    assert engine["waves"] == math.ceil(64 / engine["sequences"])
    per_sequence = 8192 * memory_plan.kv_bytes_per_token(model_config)
    assert engine["kv_cache"] == engine["sequences"] * per_sequence
    awake = resident + engine["weights"] + engine["working"] + engine["kv_cache"]
    # It fits with its margin, and one more sequence would not: the count is the largest.
    margin = memory_plan.SHARE_MARGIN * 48e9
    usable = (1 - memory_plan.GPU_HEADROOM) * 48e9
    assert awake + margin <= usable < awake + per_sequence + margin
    assert engine["share"] * 48e9 >= engine["weights"] + engine["working"] + engine["kv_cache"]
    paper_run = sage.Config(model=str(tmp_path), max_seq_len=2048)
    peaks = memory_plan.forecast(paper_run, 80 * 10**9, True)
    assert peaks["engine"]["sequences"] == 64 and peaks["engine"]["waves"] == 1


def test_the_trainers_engine_is_given_the_waves_it_can_hold(monkeypatch, capsys):
    """On CUDA, the trainer's engine gets max_num_seqs = what fits (and says so in one line);
    a standalone engine keeps its own batching."""
    model_config = Qwen2Config(**SEVEN_B_SHAPE)
    card = type("Card", (), {"total_memory": 48 * 10**9})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    trainer_bytes = 2 * models.parameter_count(model_config)  # the LoRA policy's bf16
    limits = {"max_num_seqs": 64, "max_num_batched_tokens": 8192}
    share, kwargs = memory_plan.gpu_share_and_limits(
        model_config,
        max_model_len=8192,
        llm_kwargs=limits,
        requested=None,
        default=0.3,
        trainer_bytes=trainer_bytes,
    )
    at_once, _ = memory_plan.size_engine(
        model_config, max_model_len=8192, step_sequences=64, total_bytes=48 * 10**9
    )
    assert kwargs == {"max_num_seqs": at_once, "max_num_batched_tokens": 8192} and at_once < 64
    assert f"holds {at_once} and samples the step in about 3 waves" in capsys.readouterr().out
    assert 0.3 < share < 0.95
    standalone = memory_plan.gpu_share_and_limits(
        model_config, max_model_len=8192, llm_kwargs={}, requested=None, default=0.9
    )
    assert standalone == (0.9, {})


def test_a_requested_share_too_small_or_too_large_names_the_share_that_works():
    """--gpu-memory-utilization for R1-distill's length on 48 GB: too small for one sequence,
    the error names a share that is then accepted; above what the trainer leaves free, it names
    the most that is; in between, the engine holds what the share's cache fits."""
    model_config = Qwen2Config(**SEVEN_B_SHAPE)
    sizing = dict(max_model_len=8192, step_sequences=64, total_bytes=48 * 10**9)

    def at_once(requested: float | None) -> int:  # the sequences the engine holds at once
        return memory_plan.size_engine(model_config, requested=requested, **sizing)[0]

    for requested in (0.3, 0.37, 0.375):
        with pytest.raises(vllm_backend.CheckError, match=r"pass (\d\.\d\d) or more") as small:
            at_once(requested)
        suggested = float(small.value.args[0].split("pass ")[1].split(" ")[0])
        assert at_once(suggested) >= 1
    with pytest.raises(vllm_backend.CheckError, match=r"pass at most (\d\.\d\d)") as large:
        at_once(0.9)
    most = float(large.value.args[0].split("at most ")[1].split(",")[0])
    fit = at_once(most)
    default = at_once(None)
    assert default - 1 <= fit <= default  # (the most is rounded down to a hundredth)
    assert 1 <= at_once(0.5) < fit


def test_the_trainers_resident_bytes_count_adamws_moments_before_they_exist(tiny):
    """models.resident_bytes (what the engine is sized beside) is the same before the first
    AdamW step and after it, when the moments are there to count."""
    model, _ = tiny
    policy, reference = sage.make_policy(
        copy.deepcopy(model), full_finetune=False, lora_rank=4, lora_alpha=8, with_reference=True
    )
    optimizer, _ = models.make_optimizer(
        policy, lr=1e-3, weight_decay=0.0, total_steps=10, warmup_steps=0
    )
    before = models.resident_bytes(policy, reference)
    for parameter in policy.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    weights = {t.untyped_storage().data_ptr(): t for t in [*policy.parameters(), *policy.buffers()]}
    counted = sum(t.untyped_storage().nbytes() for t in weights.values())
    for state in optimizer.state.values():
        counted += state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes
    assert before == counted == models.resident_bytes(policy, reference)
    assert reference is None  # LoRA: the reference is the policy with its adapters off


def test_on_cuda_the_trainers_engine_starts_with_the_sequences_that_fit(monkeypatch, capsys):
    """rollout.VLLMEngine on a (pretended) 48 GB GPU beside a loaded 7B trainer: vLLM is asked
    for the sequences that fit (max_num_seqs), the share they need, and sleep mode."""
    import rollout

    seven_b = Qwen2Config(**{**SEVEN_B_SHAPE, "max_position_embeddings": 32768})
    trainer_bytes = 15_500_000_000
    card = type("Card", (), {"total_memory": 48 * 10**9})
    monkeypatch.setattr(vllm_backend, "load_model_config", lambda path: seven_b)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: trainer_bytes)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    started = {}
    fake_vllm = types.SimpleNamespace(LLM=lambda **kwargs: started.update(kwargs))
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)  # no engine starts: its arguments only
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    limits = rollout.engine_limits(prompts_per_call=8, n=8, max_prompt_len=512, max_model_len=8192)
    rollout.VLLMEngine("/a/7b", max_model_len=8192, **limits)
    at_once, needed = memory_plan.size_engine(
        seven_b,
        max_model_len=8192,
        step_sequences=64,
        total_bytes=48 * 10**9,
        trainer_bytes=trainer_bytes,
    )
    assert 1 <= at_once < 64 and started["max_num_seqs"] == at_once
    assert started["max_num_batched_tokens"] == limits["max_num_batched_tokens"]
    assert started["gpu_memory_utilization"] == needed and started["enable_sleep_mode"]
    assert trainer_bytes + needed * 48e9 <= (1 - memory_plan.GPU_HEADROOM) * 48e9
    assert "waves" in capsys.readouterr().out


def probe_config(**overrides):
    config = run_config(model="tiny", micro_batch_size=2, max_seq_len=48, max_prompt_len=16)
    config.eval.eval_solution_key, config.eval.eval_every = "solution", 1
    return dataclasses.replace(config, **overrides)


@pytest.mark.parametrize("min_p", [0.01, 0.0])
def test_the_support_probes_count_is_a_real_cpu_probes_peak(min_p):
    """evaluate.solution_logps on a tiny float32 model whose logits dominate, counted storage by
    storage on the CPU: its peak (at the ``where`` of the entropy) is the plan's count, the
    logits and their float32 copies, plus less than one copy of the lm_head weight (the CPU's
    matmul makes one; CUDA's does not) and a few small tensors."""
    shape = {**TINY_SHAPE, "hidden_size": 32, "intermediate_size": 64, "vocab_size": 8192}
    model_config = Qwen2Config(**{**shape, "num_attention_heads": 2, "num_key_value_heads": 1})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa")
    prompts = [[(7 * i + j) % 8192 for j in range(16)] for i in range(2)]
    solutions = [[(11 * i + 3 * j) % 8192 for j in range(32)] for i in range(2)]
    counter = memory_sim.LiveStorages("cpu")
    with counter:
        evaluate.solution_logps(
            model, prompts, solutions, temperature=1.0, min_p=min_p, pad_id=0, batch_size=2
        )
    counted = memory_plan.probe_activations(model_config, probe_config(min_p=min_p), torch.float32)
    assert counted["peak"] == counted["logits"] > 50 * counted["layer"]
    lm_head = 8192 * 32 * 4
    assert counted["peak"] <= counter.peak <= counted["peak"] + 1.1 * lm_head


def test_with_eval_solution_key_the_run_peak_counts_the_probe_beside_the_awake_engine(
    tiny_config_dir, capsys
):
    """The probe's row of the report and its JSON keys: the trainer's resident bytes, the awake
    engine's share and the probe's activations, in the run's peak only with --eval-solution-key
    (and --eval-every). The 7B at the paper's step: the bf16 logits of 4 problems of 1,536
    tokens and their copies take 26 GB (28 bytes a logit)."""
    config = run_config(model=tiny_config_dir)
    config.extras["memory"] = memory_plan.PlanConfig()
    card = 48 * 10**9
    without = memory_report.plan(
        config, card_bytes=card, with_reference=sage.needs_reference(config)
    )
    probed = probe_config(model=tiny_config_dir, micro_batch_size=4, max_seq_len=160)
    probed = dataclasses.replace(probed, max_prompt_len=32)
    probed.extras["memory"] = memory_plan.PlanConfig()
    result = memory_report.plan(
        probed, card_bytes=card, with_reference=sage.needs_reference(probed)
    )
    assert not without["probe_counted"] and result["probe_counted"]
    activations = 4 * 128 * 512 * (2 + 6 * 4 + 2)  # B x C x V x (bf16 logits + copies)
    assert result["probe_activations_gb"] == pytest.approx(activations / 1e9, abs=0.006)
    awake = result["trainer_resident_gb"] + result["engine_share"] * 48
    assert result["probe_peak_gb"] == pytest.approx(awake + activations / 1e9, abs=0.02)
    assert result["run_peak_gb"] == max(without["run_peak_gb"], result["probe_peak_gb"])
    memory_report.print_report(result, probed)
    assert "support probe" in capsys.readouterr().out

    seven_b = memory_plan.probe_activations(
        Qwen2Config(**SEVEN_B_SHAPE),
        sage.Config(max_seq_len=1792, max_prompt_len=256),
        torch.bfloat16,
    )
    assert seven_b["logits"] == 4 * 1536 * 152064 * 28 and seven_b["peak"] == seven_b["logits"]


@pytest.mark.slow  # simulates the 7B's update on the meta device (about 5 s)
def test_the_7b_probe_does_not_fit_beside_the_engine_on_48_gb_and_names_the_flag(tmp_path):
    """docs/gpu.md: with --eval-solution-key the paper's step needs 66.1 GB at micro-batch 4 (the
    engine awake, the probe's 26.2 GB beside it); on 48 GB no micro-batch fits, and the verdict
    names --eval-solution-key."""
    Qwen2Config(**SEVEN_B_SHAPE).save_pretrained(tmp_path)
    config = sage.Config(model=str(tmp_path), max_seq_len=1792, max_prompt_len=256)
    config.eval.eval_solution_key, config.eval.eval_every = "solution", 50
    config.extras["memory"] = memory_plan.PlanConfig()
    result = memory_report.plan(
        config, card_bytes=48 * 10**9, with_reference=sage.needs_reference(config)
    )
    assert result["probe_peak_gb"] == pytest.approx(66.1, abs=0.5) and not result["fits"]
    assert result["run_peak_gb"] == result["probe_peak_gb"]
    assert "drop --eval-solution-key" in result["verdict"]
