"""sage.py as a user runs it: the CLI as a subprocess, through the CPU demo (extras/demo.py,
which builds its tiny model and task and then calls sage.py's main with every flag it is given)
and directly, vLLM on CPU.

Sizes are cut to the bone (2 steps, 2 prompts x 2 rollouts, a 2-step SFT) so each run costs
mostly the engine's start-up; the code path is the demo's and the paper's.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import bounds

# The guide's clamp as the metrics see it: q = exp(log q) of float32(clamp(q, 0.6, 1.4)). The
# clamp is exact (float32(0.6) = 0.6000000238..., float32(1.4) = 1.3999999761...); log then exp
# err by at most |log q| u + u < gamma_2 relatively (float32, the coarsest dtype the runs use).
Q_LOW = torch.tensor(0.6).item() * (1 - bounds.gamma(2, torch.float32))
Q_HIGH = torch.tensor(1.4).item() * (1 + bounds.gamma(2, torch.float32))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DEMO = [
    "--demo-sft-examples",
    "16",
    "--sft-batch-size",
    "8",
    "--demo-eval-problems",
    "2",
]  # the demo's knobs
TINY_SAGE = [  # sage.py's
    "--steps",
    "2",
    "--prompts-per-step",
    "2",
    "--rollouts",
    "2",
    "--micro-batch-size",
    "4",
    "--eval-n",
    "2",
    "--max-seq-len",
    "144",
    "--max-prompt-len",
    "100",
    "--save-every",
    "1",
]
TINY = [*TINY_DEMO, *TINY_SAGE]


def run_demo(args, out, timeout=900, **env_overrides):
    """``python -m extras.demo --out OUT ARGS``: the tiny model's SFT start, then sage.py's main."""
    return run(
        [sys.executable, "-m", "extras.demo", "--out", str(out), *args], timeout, env_overrides
    )


def run_sage(args, out, timeout=900, **env_overrides):
    """``python sage.py --out OUT ARGS``."""
    return run(
        [sys.executable, os.path.join(REPO, "sage.py"), "--out", str(out), *args],
        timeout,
        env_overrides,
    )


def run(command, timeout, env_overrides):
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **env_overrides,
    }
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def demo_files(run_dir):
    """The files a demo run trains on, as extras.demo.prepare writes them."""
    return {
        "model": str(run_dir / "sft_model"),
        "train": str(run_dir / "train.jsonl"),
        "held_out": str(run_dir / "demo.jsonl"),
    }


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


# Each guide but none on the vLLM backend, each under another --algo preset. (--guide none runs
# as processes in `make demo`'s test, tests/test_two_mode.py, in its k1_return and k3 arms; the
# presets' flags, grpo's too, are held in tests/test_sage.py.)
@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, guide", [("dapo", "random"), ("bnpo", "token"), ("dr_grpo", "branch")]
)
def test_two_step_cli_run(tmp_path, algo, guide):
    # One run asks for the multiprocessing engine: the trainer must keep its engine in-process.
    multiprocessing = "1" if algo == "bnpo" else "0"
    # DAPO trains only on groups whose rewards differ (before the length penalty): a plug-in
    # reward for longer answers gives the tiny run's groups signal, so every step updates.
    shaping = []
    if algo == "dapo":
        (tmp_path / "longer.py").write_text(
            "def longer(completions, problems, answers):\n"
            "    return [len(text) / 100 for text in completions]\n"
        )
        shaping = ["--overlong-buffer", "40", "--reward", f"{tmp_path / 'longer.py'}:longer"]
    # One run reports to TensorBoard and W&B (offline: no network) besides metrics.jsonl.
    trackers = ["--report-to", "tensorboard,wandb"] if algo == "dr_grpo" else []
    # The branch run's q is Eq. 11 unclamped and from H = 0 (q_t = 1 + 0.3 H_t), so its q/mean is
    # 1 + 0.3 times the logged entropy, the policy's: q read from pi_ref's entropies (which the
    # policy leaves after its first update) would break that at step 1.
    linear_q = ["--tau", "0", "--q-max", "10"] if guide == "branch" else []
    q_high = 10.0 * (1 + bounds.gamma(2, torch.float32)) if linear_q else Q_HIGH
    result = run_demo(
        [*TINY, *shaping, *trackers, *linear_q, "--algo", algo, "--guide", guide, "--name", "run"],
        tmp_path,
        VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing,
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # a quiet terminal: vLLM's warnings only, and none for the layers a weight push has nothing for
    shown = result.stdout + result.stderr
    assert "Failed to load weights" not in shown and " INFO " not in shown
    run_dir = tmp_path / "run"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1]
    # each step's learning rate, the one it trained with: the demo's --lr 5e-4, no warmup step
    # (--warmup-ratio 0.05 of 2 steps), then linear decay to 0 over the 2 steps
    assert [m["lr"] for m in metrics] == pytest.approx([5e-4, 2.5e-4], rel=1e-12)
    for record in metrics:
        for key in (
            "reward",
            "accuracy",
            "frac_zero_signal_groups",
            "response_length",
            "time/rollout_s",
            "time/reward_s",
            "time/reference_s",
            "time/update_s",
            "time/sync_s",
            "time/step_s",
            "time/other_s",
        ):
            assert key in record
        assert "loss" in record and "grad_norm" in record and "entropy" in record
        assert ("overlong_penalty" in record) == (algo == "dapo")
        if guide != "none":
            assert "q/mean" in record and record["q/min"] >= Q_LOW and record["q/max"] <= q_high
        if linear_q:  # float32: pairwise means of at most 176 tokens (8 levels) and q's few
            # operations, at q < 3; reading pi_ref's entropies misses by 2.6e-5 at step 1
            from_entropy = 1.0 + 0.3 * record["entropy"]
            assert abs(record["q/mean"] - from_entropy) < bounds.gamma(16, torch.float32) * 3.0
    summary = json.loads((run_dir / "summary.json").read_text())
    probed = {"hard log pi(y*)", "hard supp"}  # when a held-out sum is hard
    assert set(summary["before"]) == set(summary["after"])
    assert {"pass@1", "pass@2"} <= set(summary["before"]) <= {"pass@1", "pass@2"} | probed
    assert (run_dir / "passk.png").stat().st_size > 0 and (
        run_dir / "curves.png"
    ).stat().st_size > 0
    evaluations = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evaluations] == [0, 2] and all(
        "pass@1" in row for row in evaluations
    )
    for row in evaluations:  # the support probe of both held-out sums, at each evaluation
        assert (
            row["support"]["all"]["problems"] == 2 and row["support"]["all"]["mean_logp_full"] < 0
        )
        for shown in row["guide_map"]:
            assert len(shown["tokens"]) == len(shown["entropy"]) == len(shown["q"])
            assert all(Q_LOW <= q <= q_high for q in shown["q"])
    assert (run_dir / "guide_map.png").stat().st_size > 0
    if trackers:
        assert os.listdir(run_dir / "tensorboard") and any(
            name.startswith("offline-run-") for name in os.listdir(run_dir / "wandb")
        )
    assert json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())["step"] == 2


@pytest.mark.slow
@pytest.mark.cpu_only("a resumed run repeats the CPU's float32 arithmetic exactly")
def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    # Self-hints on (the tiny model writes poor hints, which are used all the same): resuming
    # mid-run must reproduce their rounds too.
    common = [
        *TINY,
        "--steps",
        "4",
        "--backend",
        "hf",
        "--guide",
        "token",
        "--eval-every",
        "2",
        "--self-hints",
        "--max-seq-len",
        "448",
        "--max-prompt-len",
        "384",
    ]  # room for a hint request (~340 tokens)
    whole = run_demo([*common, "--name", "whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_demo([*common, "--name", "split", "--stop-after", "2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "continue with --resume" in first.stderr + first.stdout
    # sage.py itself never overwrites a checkpoint without --resume (the demo replaces its own runs)
    from extras import demo

    sage_argv = [
        *demo.sage_flags(demo_files(tmp_path / "split")),
        *common[len(TINY_DEMO) :],
        "--name",
        "split",
    ]
    import sage

    with pytest.raises(SystemExit, match="already holds a checkpoint"):  # before anything loads
        sage.main([*sage_argv, "--out", str(tmp_path)])
    second = run_demo([*common, "--name", "split", "--resume"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]

    def comparable(records):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]

    def evaluations(run):
        return [
            json.loads(line) for line in (tmp_path / run / "eval.jsonl").read_text().splitlines()
        ]

    assert [row["step"] for row in evaluations("split")] == [0, 2, 4]
    assert evaluations("split") == evaluations(
        "whole"
    )  # pass@k of the same policies, resumed or not
    expected, resumed = (
        comparable(read_metrics(tmp_path / "whole")),
        comparable(read_metrics(tmp_path / "split")),
    )
    assert all("hints/prompt_usage_rate" in r and "hints/groups_hinted" in r for r in resumed)
    assert sum(r["hints/groups_hinted"] for r in resumed) > 0  # hints were written and resampled
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert len(expected) == len(resumed)
    for a, b in zip(expected, resumed):
        assert a.keys() == b.keys()
        for key in a:  # the same float32 arithmetic, repeated exactly: equal (NaN to NaN)
            same = a[key] == b[key] or (a[key] != a[key] and b[key] != b[key])
            assert same, (a["step"], key, a[key], b[key])


def test_bad_input_gives_one_clear_line(tmp_path):
    """As a process (a missing --dataset and an unknown --guide take the same path in-process:
    tests/test_flags.py, tests/test_sage.py)."""
    result = run_sage(["--model", "/no/such/model", "--name", "bad"], tmp_path, timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    message = "--model /no/such/model: no such file or directory"
    assert message in last and "Traceback" not in result.stderr


def test_resume_without_a_checkpoint_is_one_line_before_anything_loads(
    tmp_path, tiny_model_dir, monkeypatch
):
    """--resume with no checkpoint to continue (a rerun over a checkpoint without --resume:
    test_interrupted_and_resumed_run_matches_an_uninterrupted_one)."""
    import sage
    from machinery import models

    monkeypatch.setattr(models, "load_tokenizer", None)  # (it would fail if called)
    argv = ["--model", str(tiny_model_dir), "--resume", "--name", "fresh", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match=r"^error: --resume but no checkpoint in .*--resume to"):
        sage.main(argv)
    assert not (tmp_path / "fresh").exists()


def test_full_finetune_of_a_7b_model_is_refused_before_loading_anything(tmp_path):
    """A 7B model's weights, gradients, AdamW states, reference and engine copy exceed one GPU
    (and this machine): one line naming what fits, from the config alone (the directory has no
    weights). On the CPU the coarse count refuses it; on CUDA the memory plan's closed form does,
    which also counts the activations (a 150 GB H200 holds the states but not the update). Which
    one is what torch says in the run's own process (a simulated GPU lives only in this one)."""
    from transformers import Qwen2Config

    from machinery import memory_plan

    seven_b = Qwen2Config(**memory_plan.QWEN25_MATH_7B, tie_word_embeddings=False)
    seven_b.save_pretrained(tmp_path / "7b")
    result = run_sage(
        ["--model", str(tmp_path / "7b"), "--full-finetune", "--name", "full"],
        tmp_path,
        timeout=300,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "drop --full-finetune" in last
    probe = "import torch; print(torch.cuda.is_available())"
    cuda = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    if cuda.stdout.strip() == "True":
        assert last.startswith("error: the run does not fit a ")
    else:
        assert "--full-finetune of a 7.6B-parameter model needs about" in last


@pytest.mark.cuda_kernels  # in this process, so on the device torch offers
def test_sft_only_writes_the_sft_model_and_its_stats(tmp_path, tiny_model_dir):
    """Table 1's recipe runs SFT once (--sft-only) and starts every RL row from its model (in
    this process: it starts no engine)."""
    import sage

    rows = [
        {
            "problem": f"What is {a} + 2?",
            "generated_solution": f"<think>{a}+2={a + 2}</think>",
            "expected_answer": str(a + 2),
        }
        for a in range(6)
    ]
    rows.append({"problem": "Long", "generated_solution": "1+1=2 " * 300, "expected_answer": "2"})
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--model", str(tiny_model_dir), "--sft-dataset", str(tmp_path / "sft.jsonl")]
    argv += ["--sft-only", "--sft-epochs", "1", "--max-seq-len", "256", "--max-prompt-len", "128"]
    with pytest.raises(SystemExit) as ended:
        sage.main([*argv, "--name", "sft", "--out", str(tmp_path)])
    assert ended.value.code == 0
    stats = json.loads((tmp_path / "sft" / "sft_stats.json").read_text())
    assert stats["kept"] == 6 and stats["dropped_too_long"] == 1 and stats["max_tokens"] == 128
    assert (tmp_path / "sft" / "sft_model" / "config.json").exists()
    assert not (tmp_path / "sft" / "metrics.jsonl").exists()
    # the same directory, as an RL run from this SFT start left it (a checkpoint: --resume may
    # continue it): --sft-only --resume finds its SFT model saved and ends at once, as before
    (tmp_path / "sft" / "checkpoint").mkdir()
    (tmp_path / "sft" / "checkpoint" / "trainer_state.pt").write_bytes(b"")
    written = (tmp_path / "sft" / "config.json").read_bytes()
    with pytest.raises(SystemExit) as ended:
        sage.main([*argv, "--name", "sft", "--out", str(tmp_path), "--resume"])
    assert ended.value.code == 0 and (tmp_path / "sft" / "config.json").read_bytes() == written


def test_a_plug_in_reward_is_the_one_trained_on(tmp_path):
    """--reward path.py:function: the trainer calls it on each step's completions, problems and
    reference answers, and trains on what it returns."""
    (tmp_path / "my_reward.py").write_text(
        "import json\n"
        "def quarter(completions, problems, answers):\n"
        "    with open(__file__ + '.calls', 'a') as handle:\n"
        "        handle.write(json.dumps([len(completions), problems[0], answers[0]]) + '\\n')\n"
        "    return [0.25] * len(completions)\n"
    )
    result = run_demo(
        [
            *TINY,
            "--steps",
            "1",
            "--backend",
            "hf",
            "--name",
            "plug",
            "--reward",
            f"{tmp_path / 'my_reward.py'}:quarter",
        ],
        tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [
        json.loads(line) for line in (tmp_path / "my_reward.py.calls").read_text().splitlines()
    ]
    assert (
        calls
        and calls[0][0] == 4
        and calls[0][1].startswith(("What", "Compute", "Add"))
        and calls[0][2].isdigit()
    )
    assert read_metrics(tmp_path / "plug")[0]["reward"] == 0.25


@pytest.mark.slow
def test_the_demo_runs_again_when_run_again(tmp_path, capsys):
    """make demo-sums twice: the second replaces the first run and says so in one line (in this
    process: test_two_step_cli_run runs the demo as one)."""
    from extras import demo

    argv = [*TINY, "--steps", "1", "--eval-every", "0", "--backend", "hf", "--name", "demo"]
    demo.main([*argv, "--out", str(tmp_path)])
    capsys.readouterr()
    demo.main([*argv, "--out", str(tmp_path)])
    said = capsys.readouterr().err
    assert f"demo: replacing the previous demo run in {tmp_path / 'demo'}" in said
    assert [m["step"] for m in read_metrics(tmp_path / "demo")] == [0]
