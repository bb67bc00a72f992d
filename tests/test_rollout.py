"""Claims about rollout.py, each checked against an independent computation.

The engine under test is an in-process vLLM on CPU; the reference is transformers: greedy
completions agree token for token after a weight sync (of a full model and of a peft LoRA model),
the engine's log-probs agree with the trainer's (loss.py, float32, temperature and min-p
replayed), seeds reproduce samples, EOS and the length limit end completions as reported, and
the usual mistakes give one-line errors. One vLLM engine serves the whole module (start-up and
warm-up cost about 10 s); each test pushes the weights it needs first. On a CUDA node the engine
runs on the GPU (vLLM's V2 runner and sampler) against the same CPU float32 reference: greedy
completions agree up to a near-tie and log-probs within a tolerance that holds across devices.
"""

import copy
import dataclasses
import doctest
import json
import os
import shutil

import pytest
import torch

import bounds
import evaluate
import loss
import rollout
from extras import hf_engine as hf_backend
from machinery import vllm_backend

MAX_MODEL_LEN = 256
ON_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("module", [rollout, vllm_backend, hf_backend])
def test_doctests_pass(module):
    assert doctest.testmod(module).failed == 0


# --------------------------------------------------------------------------------------------
# One-line errors that need no engine
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("n", 0, "--n 0: must be a finite number >= 1"),
        ("temperature", -0.1, "--temperature -0.1: must be a finite number >= 0"),
        ("top_p", 0.0, "--top-p 0.0: must be a finite number in (0, 1]"),
        ("top_k", -2, "--top-k -2: must be a finite number >= -1"),
        ("min_p", 1.0, "--min-p 1.0: must be a finite number in [0, 1)"),
        ("max_tokens", 0, "--max-tokens 0: must be a finite number >= 1"),
        ("temperature", float("nan"), "--temperature nan: must be a finite number >= 0"),
    ],
)
def test_sampling_config_rejects_bad_values_in_one_line(field, value, expected):
    with pytest.raises(rollout.RolloutError) as raised:
        rollout.SamplingConfig(**{field: value})
    assert expected in str(raised.value) and "\n" not in str(raised.value)


# Each backend's engine maker: the trainer and evaluate.py pick one by --backend.
MAKERS = {"vllm": rollout.make_engine, "hf": hf_backend.make_engine}


def test_each_backend_has_its_engine_maker():
    assert sorted(MAKERS) == sorted(rollout.BACKENDS)
    assert evaluate.engine_maker("vllm") is rollout.make_engine
    assert evaluate.engine_maker("hf") is hf_backend.make_engine


@pytest.mark.parametrize("backend", rollout.BACKENDS)
def test_missing_model_path_is_a_one_line_error(tmp_path, backend):
    with pytest.raises(
        rollout.RolloutError, match="does not exist: pass a directory written by save_pretrained"
    ):
        MAKERS[backend](str(tmp_path / "no_such_model"))


def _copy_model(tiny_model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    return target


@pytest.mark.parametrize("backend", rollout.BACKENDS)
def test_corrupt_model_files_are_one_line_errors(tiny_model_dir, tmp_path, backend):
    model_dir = _copy_model(tiny_model_dir, tmp_path)
    (model_dir / "config.json").write_text("{ not json")
    with pytest.raises(rollout.RolloutError, match="cannot read the model config") as raised:
        MAKERS[backend](str(model_dir))
    assert "\n" not in str(raised.value)

    shutil.copy(os.path.join(tiny_model_dir, "config.json"), model_dir / "config.json")
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a truncated download
    with pytest.raises(rollout.RolloutError, match="corrupt weights file .*model.safetensors"):
        MAKERS[backend](str(model_dir))

    weights.unlink()
    with pytest.raises(rollout.RolloutError, match="no weights in"):
        MAKERS[backend](str(model_dir))


@pytest.mark.slow  # imports vllm (about 5 s)
@pytest.mark.skipif(ON_CUDA, reason="the head-size list is the CPU backend's")
def test_unsupported_head_size_on_cpu_names_the_sizes_that_work(tiny_model_dir, tmp_path):
    model_dir = _copy_model(tiny_model_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["head_dim"] = 48
    (model_dir / "config.json").write_text(json.dumps(config))
    expected = r"head size 48 is not supported .*supported: 32, 64, .*backend='hf'"
    with pytest.raises(rollout.RolloutError, match=expected):
        rollout.make_engine(str(model_dir))


@pytest.mark.skipif(
    ON_CUDA, reason="on CPU the KV cache is a share of RAM, checked before vLLM starts"
)
def test_out_of_memory_names_the_knob_to_lower(tiny_model_dir):
    # The CPU KV cache is what max_num_seqs sequences can use, capped at gpu_memory_utilization
    # x RAM: ten million sequences make the cap bind, and 99% of RAM is more than is free.
    with pytest.raises(rollout.RolloutError, match="out of memory: .*lower gpu_memory_utilization"):
        rollout.make_engine(
            tiny_model_dir,
            max_model_len=MAX_MODEL_LEN,
            gpu_memory_utilization=0.99,
            max_num_seqs=10**7,
        )


def test_cpu_engine_arguments_size_the_kv_cache_for_the_batch(tiny_model_dir):
    """On CPU: 32-token blocks, no chunked prefill, and a KV cache of what max_num_seqs
    sequences of max_model_len tokens can use (the tiny model: 2 layers, 2 KV heads of size 64)."""
    config = vllm_backend.load_model_config(tiny_model_dir)
    kwargs = vllm_backend.cpu_engine_kwargs(
        config, None, MAX_MODEL_LEN, "float32", {"max_num_seqs": 4}
    )
    per_token = 2 * 2 * 2 * 64 * 4  # K and V, layers, KV heads, head size, float32 bytes
    assert kwargs == {
        "gpu_memory_utilization": 0.05,
        "kv_cache_memory_bytes": 4 * MAX_MODEL_LEN * per_token,
        "enable_chunked_prefill": False,
        "block_size": 32,
    }


def test_out_of_memory_during_a_weight_push_is_not_called_an_architecture_mismatch():
    """torch.OutOfMemoryError is a RuntimeError: the push must name memory, not the architecture."""

    class OutOfMemoryLLM:
        def collective_rpc(self, method, kwargs=None):
            list(kwargs["weights_iterator"])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine = object.__new__(rollout.VLLMEngine)  # no vLLM start: only the push's error handling
    engine.llm, engine._asleep, engine.model_path = OutOfMemoryLLM(), set(), "m"
    engine.weight_dtype = None  # push the weights as they are
    with pytest.raises(
        rollout.RolloutError,
        match="out of memory pushing the weights .*lower gpu_memory_utilization",
    ):
        engine.sync_weights(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------
# Models: the trainer's (perturbed) policy and a peft LoRA policy
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def perturbed(model, seed, scale=0.1):
    """A copy of ``model`` with seeded Gaussian noise on every weight: "the trainer's weights".

    The noise is 5x the init scale: the random tiny model's greedy completions merely repeat
    the last token, the perturbed one's are varied, so "greedy equal" says something.
    """
    policy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return policy


def lora_policy(model, seed):
    """A peft LoRA model on every projection of a copy of ``model``, its adapter non-zero."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(
        perturbed(model, seed), LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:  # peft initializes B = 0 (a no-op adapter)
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return peft_model.eval()


def test_engine_weights_of_a_lora_model_are_the_merged_weights_and_leave_the_base_untouched(
    base_model,
):
    peft_model = lora_policy(base_model, seed=0)
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    base_weight = layer.base_layer.weight.detach().clone()
    expected = (
        base_weight
        + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    probe = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        adapted_logits = peft_model(probe).logits

    weights = list(rollout.engine_weights(peft_model))  # one pass, as the engine consumes them
    names = [name for name, _ in weights]
    pushed = dict(weights)["model.layers.0.self_attn.q_proj.weight"].clone()
    assert names == [name for name, _ in base_model.named_parameters()]  # base names, no lora_*
    # peft scales B A after the product, the test B before it (by 2, exact): the rank-r sums
    # differ in order only, each entry one add to W more (tests/bounds.py)
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    rank, scaling = lora_a.shape[0], layer.scaling["default"]
    magnitude = (base_weight.abs() + scaling * lora_b.abs() @ lora_a.abs()).max().item()
    tolerance = bounds.difference_bound(n=rank + 1, magnitude=magnitude, dtype=torch.float32)
    torch.testing.assert_close(pushed, expected, rtol=0, atol=tolerance)
    # Merged out of place: the base weight is bit-for-bit what it was and the adapter still acts.
    assert torch.equal(layer.base_layer.weight, base_weight)
    with torch.no_grad():
        assert torch.equal(peft_model(probe).logits, adapted_logits)  # the same computation
        with peft_model.disable_adapter():  # the adapter's effect, far above any rounding
            assert not torch.allclose(peft_model(probe).logits, adapted_logits, atol=1e-3)


def test_a_push_into_a_bf16_engine_casts_float32_weights_one_tensor_at_a_time(base_model):
    """--full-finetune trains float32 weights; the engine on CUDA is bf16: each pushed tensor is
    the weight (or the merged LoRA weight) rounded to bf16, and the trainer's stay float32."""
    weights = rollout.engine_weights(base_model, dtype=torch.bfloat16)
    for (name, pushed), parameter in zip(weights, base_model.parameters()):
        assert pushed.dtype == torch.bfloat16, name
        assert torch.equal(pushed, parameter.detach().to(torch.bfloat16)), name
    assert all(p.dtype == torch.float32 for p in base_model.parameters())
    peft_model = lora_policy(base_model, seed=0)
    merged = dict(rollout.engine_weights(peft_model))["model.layers.0.mlp.up_proj.weight"]
    pushed = dict(rollout.engine_weights(peft_model, dtype=torch.bfloat16))[
        "model.layers.0.mlp.up_proj.weight"
    ]
    assert pushed.dtype == torch.bfloat16 and torch.equal(pushed, merged.to(torch.bfloat16))


# --------------------------------------------------------------------------------------------
# The hf engine alone (cheap)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    """Four chat-templated prompts of different lengths (the hf engine left-pads them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    questions = ["What is 2 + 3?", "Compute 17 + 25.", "Add 9 and 8, then double it.", "x?"]
    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    return [list(e["input_ids"] if hasattr(e, "keys") else e) for e in encoded]


def hf_engine(model_dir, model=None):
    """The reference: transformers generate, through ``model`` if given (else the saved weights)."""
    return hf_backend.make_engine(
        model_dir, max_model_len=MAX_MODEL_LEN, dtype="float32", model=model
    )


@torch.no_grad()
def trainer_logprobs(model, prompt, completion, temperature, min_p):
    """log pi(y_t) as the trainer computes them: a full-sequence forward through loss.py, in
    float32."""
    ids = torch.tensor([prompt + completion.token_ids])
    logits = model(ids).logits.float()
    aligned = logits[:, len(prompt) - 1 : -1]  # position t predicts completion token t
    logps, _ = loss.token_logps_and_entropies(aligned, ids[:, len(prompt) :], temperature, min_p)
    return logps[0]


def test_hf_engine_logprobs_are_those_of_the_temperature_and_min_p_distribution(
    tiny_model_dir, base_model, prompts
):
    policy = perturbed(base_model, seed=1)
    engine = hf_engine(tiny_model_dir, policy)
    sampling = rollout.SamplingConfig(n=3, temperature=0.7, min_p=0.2, max_tokens=24, seed=5)
    groups = engine.generate(prompts, sampling)
    assert [len(group) for group in groups] == [3] * len(prompts)
    for prompt, group in zip(prompts, groups):
        for completion in group:
            reference = trainer_logprobs(policy, prompt, completion, 0.7, 0.2)
            # generate's cached forward against the trainer's full one, both float32: not yet a
            # bound (the engine's log_softmax is float32 whatever the scores' dtype, so a float64
            # check would need it to keep their dtype); 1e-5 holds on every CPU kind seen
            torch.testing.assert_close(
                torch.tensor(completion.logprobs), reference, rtol=0, atol=1e-5
            )
            # The mask is real: min_p = 0.2 removes most of the vocabulary, so without the replay
            # the log-probs would be far lower.
            unmasked = trainer_logprobs(policy, prompt, completion, 0.7, 0.0)
            assert (reference - unmasked).max() > 0.1


# --------------------------------------------------------------------------------------------
# vLLM vs the reference (one engine for the module)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    engine = rollout.make_engine(tiny_model_dir, max_model_len=MAX_MODEL_LEN, dtype="float32")
    yield engine
    engine.close()  # vLLM's distributed state is global: release it for the next engine


def greedy(engine, prompts, max_tokens=40):
    groups = engine.generate(
        prompts, rollout.SamplingConfig(n=1, temperature=0.0, max_tokens=max_tokens)
    )
    return [group[0].token_ids for group in groups]


NEAR_TIE = 2e-2  # logits this close may be ordered either way by CUDA's and the CPU's kernels


def assert_greedy_agrees(model, prompts, got, expected):
    """Greedy completions of ``prompts`` against ``expected`` (HF's on the CPU in float32): equal
    token for token on the CPU; on CUDA (vLLM's V2 runner, other kernels and reduction orders)
    equal up to the first token where ``model``'s two best logits, given the common prefix, are
    within NEAR_TIE of each other, after which either device may go either way."""
    if not ON_CUDA:
        assert got == expected
        return
    for prompt, mine, theirs in zip(prompts, got, expected):
        common = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if common is None:  # equal up to the shorter: the same EOS, or the same length limit
            assert len(mine) == len(theirs), (prompt, mine, theirs)
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + theirs[:common]])).logits[0, -1].float()
        best, second = logits.topk(2).values.tolist()
        assert best - second <= NEAR_TIE, f"diverged at token {common} by {best - second:.3g}"


def assert_logprobs_close(errors: list[float]):
    """The engine's log-probs minus the reference's, token by token: each within 1e-3 on the CPU
    (float32 on both sides); on CUDA (vLLM's V2 runner and sampler, TF32 in its attention
    kernels) the median within 5e-3 and 95% of the tokens within 5e-2, since a token at the edge
    of the min-p, top-k or top-p set may be kept on one device and dropped on the other."""
    errors = torch.tensor(errors).abs()
    if not ON_CUDA:  # two engines (vLLM's CPU kernels, HF's): other algorithms, not rounding
        assert errors.max() <= 1e-3
        return
    assert errors.median() <= 5e-3 and (errors <= 5e-2).float().mean() >= 0.95


@pytest.mark.slow
def test_vllm_greedy_equals_hf_greedy_after_a_sync_of_perturbed_weights(
    tiny_model_dir, base_model, prompts, vllm_engine
):
    policy = perturbed(base_model, seed=2)
    expected = greedy(hf_engine(tiny_model_dir, policy), prompts)
    vllm_engine.sync_weights(base_model)
    assert greedy(vllm_engine, prompts) != expected  # the engine starts from other weights...
    vllm_engine.sync_weights(policy)  # ...and the sync makes it the trainer's
    assert_greedy_agrees(policy, prompts, greedy(vllm_engine, prompts), expected)


@pytest.mark.slow
def test_vllm_greedy_equals_hf_greedy_through_a_lora_adapter(
    tiny_model_dir, base_model, prompts, vllm_engine
):
    peft_model = lora_policy(base_model, seed=3)
    expected = greedy(hf_engine(tiny_model_dir, peft_model), prompts)
    with peft_model.disable_adapter():  # the adapter changes the completions
        assert expected != greedy(hf_engine(tiny_model_dir, peft_model), prompts)
    vllm_engine.sync_weights(peft_model)  # on CUDA: the LoRA push into a CUDA engine
    assert_greedy_agrees(peft_model, prompts, greedy(vllm_engine, prompts), expected)
    # The hf engine's own copy (on CUDA, on the GPU) syncs from the peft model the same way.
    plain = hf_engine(tiny_model_dir)  # its own copy of the saved weights
    plain.sync_weights(peft_model)
    assert_greedy_agrees(peft_model, prompts, greedy(plain, prompts), expected)


@pytest.mark.slow
def test_vllm_logprobs_match_the_trainers_within_1e_3(base_model, prompts, vllm_engine):
    """(On CUDA within the tolerance of ``assert_logprobs_close``.)"""
    policy = perturbed(base_model, seed=4)
    vllm_engine.sync_weights(policy)
    sampling = rollout.SamplingConfig(n=4, temperature=0.9, min_p=0.05, max_tokens=32, seed=11)
    errors = []
    for prompt, group in zip(prompts, vllm_engine.generate(prompts, sampling)):
        for completion in group:
            assert len(completion.logprobs) == len(completion.token_ids) > 0
            reference = trainer_logprobs(policy, prompt, completion, 0.9, 0.05)
            errors += (torch.tensor(completion.logprobs) - reference).tolist()
    assert_logprobs_close(errors)


def test_the_hf_processors_take_an_integer_temperature_as_vllm_does():
    # SamplingConfig(temperature=2) is valid and vllm.SamplingParams takes it; transformers'
    # TemperatureLogitsWarper raised a ValueError for a non-float
    sampling = rollout.SamplingConfig(temperature=2, min_p=0.0)
    scores = torch.tensor([[0.0, 1.0, 3.0]])
    (processor,) = hf_backend.sampling_processors(sampling)
    assert processor(None, scores).tolist() == [[0.0, 0.5, 1.5]]


@pytest.mark.slow
def test_vllm_top_k_top_p_logprobs_equal_the_hf_processors_on_the_trainers_logits(
    base_model, prompts, vllm_engine
):
    """The hf backend's processors (temperature, min-p, top-k, top-p, in that order) are vLLM's
    sampler (on CUDA within the tolerance of ``assert_logprobs_close``)."""
    from transformers import LogitsProcessorList

    policy = perturbed(base_model, seed=5)
    vllm_engine.sync_weights(policy)
    sampling = rollout.SamplingConfig(
        n=4, temperature=0.8, min_p=0.02, top_k=20, top_p=0.9, max_tokens=24, seed=3
    )
    processors = LogitsProcessorList(hf_backend.sampling_processors(sampling))
    errors = []
    for prompt, group in zip(prompts, vllm_engine.generate(prompts, sampling)):
        for completion in group:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
            scores = processors(ids, logits)  # each row transformed independently
            reference = (
                torch.log_softmax(scores, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
            )
            errors += (torch.tensor(completion.logprobs) - reference).tolist()
    assert_logprobs_close(errors)


@pytest.mark.slow
def test_vllm_same_seed_same_samples_and_n_per_prompt(base_model, prompts, vllm_engine):
    vllm_engine.sync_weights(base_model)
    sampling = rollout.SamplingConfig(n=3, temperature=1.0, max_tokens=16, seed=7)
    first = vllm_engine.generate(prompts + prompts[:1], sampling)
    again = vllm_engine.generate(prompts + prompts[:1], sampling)
    other = vllm_engine.generate(prompts + prompts[:1], dataclasses.replace(sampling, seed=8))
    ids = lambda groups: [[c.token_ids for c in group] for group in groups]  # noqa: E731
    assert [len(group) for group in first] == [3] * (len(prompts) + 1)
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)
    assert len({tuple(c.token_ids) for c in first[0]}) == 3  # n distinct samples of one prompt
    assert ids(first)[0] != ids(first)[-1]  # the same prompt twice in a call: different samples
    vllm_engine.sleep()  # no-ops on CPU; on CUDA the next generate wakes the engine
    vllm_engine.wake_up()
    text = first[0][0]
    assert text.text == vllm_engine.tokenizer.decode(text.token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_generate_refuses_discarded_weights_until_they_are_pushed(base_model, prompts, vllm_engine):
    """sleep(level=2) drops the weights on CUDA; an engine that generated from the garbage left
    in their place would corrupt a run silently. (Here the flag is set by hand: CPU engines do
    not sleep.)"""
    vllm_engine._weights_discarded = True
    with pytest.raises(rollout.RolloutError, match="discarded by sleep.* call sync_weights"):
        vllm_engine.generate(prompts, rollout.SamplingConfig(n=1, max_tokens=2))
    vllm_engine.sync_weights(base_model)
    assert len(vllm_engine.generate(prompts, rollout.SamplingConfig(n=1, max_tokens=2))) == len(
        prompts
    )


def test_the_engine_always_runs_in_process(monkeypatch):
    """Weight sync hands tensors over by a function call: an engine core in another process
    would never receive them, so a user's VLLM_ENABLE_V1_MULTIPROCESSING=1 is overridden, with a
    warning."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.warns(UserWarning, match="needs 0"):
        vllm_backend.force_in_process_engine()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def eos_at_step_policy(model, engine_tokenizer, prompt, reference_dir):
    """A copy of ``model`` whose greedy completion of ``prompt`` ends with EOS at a known step k.

    The greedy completion t_0, t_1, ... is computed; k is its first step whose token g is new
    (not in the prompt, not earlier). Swapping the (tied) embedding rows of g and EOS permutes
    only those two logits and leaves the inputs before step k unchanged, so the new greedy
    completion is t_0 .. t_{k-1}, EOS. Returns (policy, t_<k).
    """
    eos = engine_tokenizer.eos_token_id
    tokens = greedy(hf_engine(reference_dir, model), [prompt], max_tokens=40)[0]
    k = next(
        i
        for i, t in enumerate(tokens)
        if i >= 3 and t not in prompt and t not in tokens[:i] and t != eos
    )
    policy = copy.deepcopy(model)
    with torch.no_grad():
        rows = policy.get_input_embeddings().weight
        rows[[tokens[k], eos]] = rows[[eos, tokens[k]]].clone()
    return policy, tokens[:k]


@pytest.mark.slow
def test_eos_ends_a_completion_and_the_length_limit_is_reported(
    tiny_model_dir, base_model, vllm_engine
):
    prompt = list(range(40, 60))  # plain byte tokens, no EOS among them
    policy, head = eos_at_step_policy(
        perturbed(base_model, seed=6), vllm_engine.tokenizer, prompt, tiny_model_dir
    )
    eos = vllm_engine.tokenizer.eos_token_id
    vllm_engine.sync_weights(policy)
    greedy_sampling = rollout.SamplingConfig(n=1, temperature=0.0)
    for engine in (vllm_engine, hf_engine(tiny_model_dir, policy)):
        stopped = engine.generate(
            [prompt], dataclasses.replace(greedy_sampling, max_tokens=len(head) + 5)
        )[0][0]
        assert (stopped.token_ids, stopped.finish_reason) == (head + [eos], "stop")
        assert len(stopped.logprobs) == len(stopped.token_ids)
        cut = engine.generate(
            [prompt], dataclasses.replace(greedy_sampling, max_tokens=len(head) - 1)
        )[0][0]
        assert (cut.token_ids, cut.finish_reason) == (head[:-1], "length")
        # The end of the context is a length limit too: 3 free positions, 3 tokens.
        long_prompt = (
            prompt * ((MAX_MODEL_LEN - 3) // len(prompt))
            + prompt[: (MAX_MODEL_LEN - 3) % len(prompt)]
        )
        edge = engine.generate([long_prompt], rollout.SamplingConfig(n=4, max_tokens=50, seed=1))[0]
        for c in edge:
            stopped_early = c.token_ids[-1] == eos and len(c.token_ids) <= 3
            assert (len(c.token_ids), c.finish_reason) == (3, "length") or (
                stopped_early and c.finish_reason == "stop"
            )


@pytest.mark.slow
def test_prompt_longer_than_the_context_is_a_one_line_error(tiny_model_dir, vllm_engine):
    for engine in (vllm_engine, hf_engine(tiny_model_dir)):
        too_long = f"has {MAX_MODEL_LEN} tokens but the context .* is {MAX_MODEL_LEN}"
        with pytest.raises(rollout.RolloutError, match=too_long):
            engine.generate([[5, 6], [7] * MAX_MODEL_LEN], rollout.SamplingConfig(n=2))
        with pytest.raises(
            rollout.RolloutError, match="prompt 0 is a str, not a list of token ids"
        ):
            engine.generate(["What is 2 + 2?"], rollout.SamplingConfig(n=2))
