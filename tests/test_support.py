"""The support probe (evaluate.py, section 3): log pi(y*|x) of a known solution, exactly."""

import copy
import dataclasses
import math

import pytest
import torch

import bounds
import evaluate
import loss
from task.problems import Problem, build_prompt_ids

PROBLEMS = [
    Problem(problem="What is 7 + 5?", answer="12", solution="7+5=12", group="hard"),
    Problem(problem="Add 2 and 3.", answer="5", solution="2+3=5", group="easy"),
    Problem(problem="What is the sum of 9 and 9?", answer="18", solution="9+9=18", group="hard"),
    Problem(problem="Compute 1 + 1.", answer="2", group="easy"),  # no reference: not probed
]


def definition_logps(model, tokenizer, problem, temperature, min_p):
    """The per-token log-probs of y* by the definition, on the one unpadded sequence."""
    prompt = build_prompt_ids(tokenizer, problem.problem)
    completion = evaluate.solution_completion_ids(tokenizer, problem.solution, problem.answer)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]  # [1, C, V]
    logps, entropies = loss.token_logps_and_entropies(
        logits, torch.tensor([completion]), temperature, min_p
    )
    return logps[0], entropies[0], logits[0]


def float64_tiny(tiny):
    """The tiny model in float64 (with the ``float64_qwen2`` fixture: float64 throughout)."""
    model, tokenizer = tiny
    return copy.deepcopy(model).double(), tokenizer


def probe_bound(model, tokenizer, problems):
    """How far the probe's log-prob or entropy of one token (a padded batch, logits_to_keep) and
    the definition's (one unpadded sequence) can differ in float64: bounds.difference_bound with
    n = bounds.forward_length over the longest sequence (no padded batch is longer), terms up to
    the largest activation of any of them."""
    sequences = [
        build_prompt_ids(tokenizer, p.problem)
        + evaluate.solution_completion_ids(tokenizer, p.solution, p.answer)
        for p in problems
        if p.solution
    ]
    with torch.no_grad():
        magnitude = max(
            bounds.activation_magnitude(model(torch.tensor([ids]), output_hidden_states=True))
            for ids in sequences
        )
    n = bounds.forward_length(model.config, tokens=max(len(ids) for ids in sequences))
    return bounds.difference_bound(n=n, magnitude=magnitude, dtype=torch.float64)


def sum_bound(token_logps, per_token):
    """A sum of C log-probs, each within ``per_token``, summed in another order: C * per_token
    plus bounds.difference_bound(n = C, terms up to max |log p|)."""
    count = len(token_logps)
    magnitude = token_logps.abs().max().item()
    return count * per_token + bounds.difference_bound(count, magnitude, torch.float64)


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.0), (0.7, 0.0), (1.0, 1e-4)])
def test_probe_equals_the_definition_summed_over_y_star(tiny, float64_qwen2, temperature, min_p):
    model, tokenizer = float64_tiny(tiny)  # float64: a float32 bound (n ~ 3000) catches nothing
    per_token = probe_bound(model, tokenizer, PROBLEMS)
    summary, probes = evaluate.support_probe(
        model, tokenizer, PROBLEMS, temperature=temperature, min_p=min_p, batch_size=2
    )
    assert len(probes) == 3  # the problem without a reference solution is left out
    for problem, probe, logp in zip(PROBLEMS, probes, summary["per_problem_logp"]):
        expected, entropies, _ = definition_logps(model, tokenizer, problem, temperature, min_p)
        assert all(probe.kept)  # a random model's distribution is flat: min-p keeps y*
        tolerance = sum_bound(expected, per_token)
        assert probe.logp == pytest.approx(expected.sum().item(), abs=tolerance)
        assert logp == pytest.approx(expected.sum().item(), abs=tolerance)
        assert probe.entropies == pytest.approx(entropies.tolist(), abs=per_token)
    assert summary["all"]["problems"] == 3 and summary["hard"]["problems"] == 2
    assert summary["all"]["outside"] == 0.0
    hard = [probes[0].logp, probes[2].logp]
    assert summary["hard"]["mean_logp"] == pytest.approx(sum(hard) / 2)
    for delta in evaluate.SUPPORT_DELTAS:
        expected = sum(logp >= math.log(delta) for logp in hard) / 2
        assert summary["hard"][evaluate.supp_key(delta)] == expected


def test_a_token_that_min_p_removes_puts_y_star_outside_the_support(tiny, float64_qwen2):
    model, tokenizer = float64_tiny(tiny)  # float64: the sum's bound stays far below any mistake
    problem = PROBLEMS[0]
    _, _, logits = definition_logps(model, tokenizer, problem, 1.0, 0.0)
    # the min-p that removes the least likely token of y*, and no more (the 1% margins below are
    # set-membership margins on pi(y*_t) / max pi, far above rounding, not rounding bounds)
    probs = logits.softmax(dim=-1)  # [C, V]
    completion = evaluate.solution_completion_ids(tokenizer, problem.solution, problem.answer)
    relative = probs[torch.arange(len(completion)), completion] / probs.max(dim=-1).values
    weakest = int(relative.argmin())
    min_p = float(relative[weakest]) * 1.01
    summary, (probe,) = evaluate.support_probe(
        model, tokenizer, [problem], temperature=1.0, min_p=min_p
    )
    assert probe.kept[weakest] is False and sum(probe.kept) == len(completion) - 1
    assert probe.logp == -math.inf and summary["per_problem_logp"] == [None]
    assert summary["all"]["outside"] == 1.0 and summary["all"]["mean_logp"] is None
    assert all(summary["all"][evaluate.supp_key(d)] == 0.0 for d in evaluate.SUPPORT_DELTAS)
    # the full softmax still gives a finite log-prob, the same as without min-p
    expected, _, _ = definition_logps(model, tokenizer, problem, 1.0, 0.0)
    tolerance = sum_bound(expected, probe_bound(model, tokenizer, [problem]))
    assert summary["all"]["mean_logp_full"] == pytest.approx(expected.sum().item(), abs=tolerance)
    # just below that min-p, every token is kept again
    _, (kept,) = evaluate.support_probe(model, tokenizer, [problem], 1.0, min_p / 1.02)
    assert all(kept.kept) and kept.logp > -math.inf


def test_the_probe_leaves_the_policy_in_training_mode(tiny):
    model, tokenizer = tiny
    model.train()
    try:
        evaluate.support_probe(model, tokenizer, PROBLEMS[:1], temperature=1.0, min_p=0.0)
        assert model.training
    finally:
        model.eval()


@pytest.mark.cuda_kernels
def test_evaluate_cli_probes_the_saved_model_and_names_a_missing_solution_field(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = evaluate.EvalArgs(model=str(tiny_model_dir), solution_key="working", temperature=1.0)
    results = {"benchmarks": {"sums": {}, "bare": {}}}
    evaluate.probe_benchmarks(args, {"sums": PROBLEMS}, results)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected, _ = evaluate.support_probe(model, tokenizer, PROBLEMS, temperature=1.0, min_p=0.01)
    probed = results["benchmarks"]["sums"]["support"]
    # Not a rounding bound: on a CUDA node the CLI's probe runs on the GPU (other kernels, TF32)
    # and the reference on the CPU; on the CPU the two are one computation.
    assert probed["per_problem_logp"] == pytest.approx(expected["per_problem_logp"], abs=1e-4)
    for group in ("all", "easy", "hard"):
        assert probed[group] == pytest.approx(expected[group], abs=1e-4)
    without = [Problem(problem="Add 2 and 3.", answer="5")]
    with pytest.raises(evaluate.EvalError, match="--solution-key working: no problem of bare"):
        evaluate.probe_benchmarks(args, {"bare": without}, results)
    ungrouped = [dataclasses.replace(problem, group="") for problem in PROBLEMS]
    grouped = dataclasses.replace(args, group_key="level")  # a field these rows do not have
    with pytest.raises(evaluate.EvalError, match="--group-key level: no problem has a group"):
        evaluate.probe_benchmarks(grouped, {"sums": ungrouped}, results)
