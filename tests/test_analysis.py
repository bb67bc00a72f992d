"""analysis.py: Eq. 13's pattern frequencies by hand, Eq. 39's perplexity against a per-sample loop,
and the plot / patterns / perplexity subcommands of evaluate.py on saved files."""

import json
import math
import random

import pytest

import bounds
import evaluate
from extras import analysis, demo


def write_jsonl(path, rows):
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def test_patterns_and_plot_subcommands_on_saved_results(tmp_path):
    samples = tmp_path / "base"
    samples.mkdir()
    rows = [
        {
            "benchmark": "b",
            "seed": 0,
            "problem_index": 0,
            "problem": "p",
            "answer": "1",
            "prompt_ids": [1],
            "completions": [
                {"text": "Let x be 1.", "correct": True},
                {"text": "Direct.", "correct": True},
                {"text": "Let y be 2.", "correct": False},
            ],
        },
        {
            "benchmark": "b",
            "seed": 0,
            "problem_index": 1,
            "problem": "q",
            "answer": "2",
            "prompt_ids": [1],
            "completions": [{"text": "Assume for contradiction that ...", "correct": True}],
        },
    ]
    path = write_jsonl(samples / "b.seed0.jsonl", rows)
    assert (
        evaluate.main(["patterns", f"base={path}", "--out", str(tmp_path / "patterns.json")]) == 0
    )
    with open(tmp_path / "patterns.json") as handle:
        table = json.load(handle)
    # Eq. 13 by hand: constraint setup (1/2 + 0) / 2, contradiction (0 + 1) / 2.
    assert table["base"] == {
        "constraint_setup": 0.25,
        "structural_reasoning": 0.0,
        "proof_by_contradiction": 0.5,
        "num_problems": 2,
    }

    results = {
        "model": {"path": "/m/base", "adapter": None},
        "ks": [1, 2],
        "benchmarks": {
            "b": {"pass_at_k": {"1": {"mean": 0.2, "std": 0.01}, "2": {"mean": 0.3, "std": 0.02}}}
        },
    }
    for name in ("a.json", "b.json"):
        with open(tmp_path / name, "w") as handle:
            json.dump(results, handle)
    out = tmp_path / "passk.png"
    assert (
        evaluate.main(
            ["plot", f"GRPO={tmp_path / 'a.json'}", str(tmp_path / "b.json"), "--out", str(out)]
        )
        == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "text, sets_up",
    [
        ("Let x be the side.", True),
        ("Let $a_1$ be the first term.", True),  # a subscripted variable
        ("let \\(n\\) denote the count", True),
        ("Let us compute the sum.", False),  # a word, not a variable
        ("We denote the roots by r and s.", True),
    ],
)
def test_constraint_setup_reads_a_variable_after_let(text, sets_up):
    assert bool(analysis.REASONING_PATTERNS["constraint_setup"].search(text)) == sets_up


def test_a_file_of_the_other_kind_or_an_out_it_cannot_write_is_one_line(tmp_path, capsys):
    """patterns given a results file, plot given a completions file (each reads the other's),
    or either given an --out nothing can be written in: one line naming the file and what to
    pass (they were tracebacks from json, a KeyError and the write)."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"model": {}, "ks": [1], "benchmarks": {}}, indent=1))
    completions = write_jsonl(tmp_path / "b.seed0.jsonl", [{"benchmark": "b", "seed": 0}])
    for argv, said in (
        (["patterns", f"base={results}"], f"{results} line 1 is not a row of evaluate.py"),
        (["plot", str(completions)], f"{completions} is not a results file of evaluate.py"),
    ):
        assert evaluate.main([*argv, "--out", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and said in error[0]
    for command in ("plot", "patterns"):  # an --out it cannot write: one line, before the work
        assert evaluate.main([command, str(results), "--out", "/proc/out/figure"]) == 2
        said = "--out /proc/out/figure: cannot write in /proc; pass another"
        assert capsys.readouterr().err.strip().splitlines() == [f"evaluate.py: error: {said}"]


def test_perplexity_equals_a_per_sample_log_softmax_loop(float64_qwen2):
    import torch

    tokenizer = demo.build_tiny_tokenizer()
    # float64 (the fixture makes it float64 throughout): a float32 bound (n ~ 3000) catches nothing
    model = demo.build_tiny_model(tokenizer, seed=3).double().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 9))] for _ in range(5)]
    completions = [[rng.randrange(256) for _ in range(rng.randint(1, 7))] for _ in range(5)]
    got = analysis.completion_perplexities(
        model, prompts, completions, batch_size=2, progress=False
    )
    # One log-prob, padded batch against one unpadded sequence: bounds.difference_bound with
    # n = bounds.forward_length over the longest pair, terms up to the largest activation.
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    count = max(len(c) for c in completions)  # the mean's sum runs over the padded completion
    with torch.no_grad():
        outputs = [
            model(torch.tensor([p + c]), output_hidden_states=True)
            for p, c in zip(prompts, completions)
        ]
    magnitude = max(bounds.activation_magnitude(output) for output in outputs)
    n = bounds.forward_length(model.config, tokens=longest)
    per_token = bounds.difference_bound(n=n, magnitude=magnitude, dtype=torch.float64)
    u = bounds.unit_roundoff(torch.float64)
    for prompt, completion, value, output in zip(prompts, completions, got, outputs):
        logps = (
            output.logits[0]
            .log_softmax(-1)[len(prompt) - 1 : -1]
            .gather(-1, torch.tensor(completion)[:, None])
        )
        # the mean: per_token, its sum in another order (n = count) and a division each side;
        # exp(-mean) then errs by expm1(that) relatively, plus exp's rounding on each side
        largest = logps.abs().max().item()
        mean_error = (
            per_token
            + bounds.difference_bound(count, largest, torch.float64) / len(completion)
            + 2 * u * largest
        )
        rel = math.expm1(mean_error) + bounds.gamma(2, torch.float64)
        assert value == pytest.approx(math.exp(-logps.mean().item()), rel=rel, abs=0)


@pytest.mark.cuda_kernels
def test_perplexity_subcommand_scores_saved_completions_under_the_base_model(
    tmp_path, tiny_model_dir
):
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    paths = {}
    for label in ("grpo", "branch"):
        rows = [
            {
                "benchmark": "b",
                "seed": 0,
                "problem_index": index,
                "problem": "p",
                "answer": "1",
                "prompt_ids": [rng.randrange(256) for _ in range(6)],
                "completions": [
                    {
                        "token_ids": [rng.randrange(256) for _ in range(rng.randint(2, 9))],
                        "correct": i % 2 == 0,
                        "text": "",
                    }
                    for i in range(4)
                ],
            }
            for index in range(2)
        ]
        paths[label] = write_jsonl(tmp_path / f"{label}.jsonl", rows)
    out = tmp_path / "ppl.png"
    command = [
        "perplexity",
        "--base-model",
        tiny_model_dir,
        "--problems",
        "b:1",
        "--only-correct",
        "--out",
        str(out),
        "--no-progress",
    ] + [f"{label}={path}" for label, path in paths.items()]
    assert evaluate.main(command) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "ppl.json") as handle:
        values = json.load(handle)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for label, path in paths.items():
        row = [json.loads(line) for line in open(path)][1]
        correct = [c["token_ids"] for c in row["completions"] if c["correct"]]
        expected = analysis.completion_perplexities(
            model, [row["prompt_ids"]] * 2, correct, progress=False
        )
        # Not a rounding bound: on a CUDA node the CLI scores on the GPU (other kernels, TF32)
        # and the reference on the CPU; on the CPU the two are one computation.
        assert values["b:1"][label] == pytest.approx(expected, rel=1e-5)


def capture_figures(monkeypatch):
    figures = []
    monkeypatch.setattr(analysis, "_save_figure", lambda figure, out: figures.append(figure))
    monkeypatch.setattr(analysis.plt, "close", lambda figure: None)
    return figures


def test_pass_at_k_plots_show_k_and_the_standard_errors_as_error_bars(monkeypatch):
    from matplotlib.container import ErrorbarContainer

    figures = capture_figures(monkeypatch)
    summary = {str(k): {"mean": 0.1 * k, "std": 0.0, "stderr": 0.01 * k} for k in (1, 2, 4, 8)}
    analysis.plot_pass_at_k({"GRPO": {"benchmarks": {"b": {"pass_at_k": summary}}}}, "unused.png")
    axis = figures[0].axes[0]
    assert [label.get_text() for label in axis.get_xticklabels()] == ["1", "2", "4", "8"]
    (bars,) = [
        container for container in axis.containers if isinstance(container, ErrorbarContainer)
    ]
    half_heights = [
        abs(segment[1][1] - segment[0][1]) / 2 for segment in bars.lines[2][0].get_segments()
    ]
    # Closed form in Python floats (matplotlib's (y + e) - (y - e), halved): approx's default
    # (rel 1e-6) covers those few roundings (~1e-15) and no plotting mistake; not a bound.
    assert half_heights == pytest.approx([0.01, 0.02, 0.04, 0.08])


def test_plot_of_a_run_directory_draws_its_training_curves_and_evaluations(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    metrics = [
        {
            "step": s,
            "reward": s / 10,
            "accuracy": s / 10,
            "kl/ref_k3": 0.01,
            "kl/anchor_k3": 0.02,
            "entropy": 1.0,
            "q/mean": 1.1,
            "q/min": 1.0,
            "q/max": 1.3,
            "response_length": 20 + s,
        }
        for s in range(4)
    ]
    write_jsonl(run / "metrics.jsonl", metrics)
    write_jsonl(
        run / "eval.jsonl",
        [
            {
                "step": s,
                "benchmark": "demo",
                "n": 8,
                "pass@1": 0.3 + s / 10,
                "pass@8": 0.9,
                "support": {"hard": {"mean_logp_full": -9.0 + s, "supp@0.01": s / 10}},
            }
            for s in (0, 2, 4)
        ],
    )
    assert evaluate.main(["plot", str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = capture_figures(monkeypatch)
    analysis.plot_run([str(run)], "unused.png")
    titles = [axis.get_title() for axis in figures[0].axes]
    assert titles == [
        "reward",
        "KL estimates",
        "entropy (nats)",
        "guide q",
        "response length (tokens)",
        "pass@k (--eval-every)",
        "support probe: mean log pi(y*)",
        "support probe: supp_0.01, P(pi(y*) >= 0.01)",
    ]
    evaluation_lines = figures[0].axes[5].get_lines()
    assert [line.get_label() for line in evaluation_lines] == ["demo pass@1", "demo pass@8"]
    assert list(evaluation_lines[0].get_xdata()) == [0, 2, 4]
    (logp_line,) = figures[0].axes[6].get_lines()  # the support probe of the hard problems
    assert logp_line.get_label() == "demo hard" and list(logp_line.get_ydata()) == [-9, -7, -5]
    assert list(figures[0].axes[7].get_lines()[0].get_ydata()) == [0.0, 0.2, 0.4]
    with pytest.raises(analysis.AnalysisError, match="no metrics.jsonl"):
        analysis.plot_run([str(tmp_path)], "unused.png")


def test_evaluate_help_names_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in ("plot", "patterns", "perplexity"))
