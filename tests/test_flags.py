"""Every bad flag of sage.py is stopped before anything loads: one line naming the flag, exit 2,
no run directory. The sweep takes every numeric flag from the ranges in the fields' metadata, so
a flag given a range is swept too; the subprocess cases are the ones a user types."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

import sage
from machinery import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def numeric_flags():
    return [
        ("--" + flag, rule) for flag, rule in cli.ranges(sage.Config, *sage.EXTRAS.values()).items()
    ]


def bad_values(rule):
    """nan and inf always; a negative number unless the rule allows one; zero where it is out."""
    values = ["nan", "inf"]
    for value in ("-5", "0"):
        if not cli.in_range(float(value), rule):
            values.append(value)
    return values


CASES = [(flag, value) for flag, rule in numeric_flags() for value in bad_values(rule)]


@pytest.mark.parametrize("flag, value", CASES)
def test_a_bad_number_is_one_line_naming_its_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        sage.parse_config(["--model", "m", flag, value])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("sage.py: error: ") and flag in last, last


def test_the_sweep_covers_every_numeric_flag():
    flags = {flag for flag, _ in numeric_flags()}
    config = sage.parse_config(["--model", "m"])
    numeric = set()
    for section in (config, config.loss, config.guide, config.eval, *config.extras.values()):
        for field in dataclasses.fields(section):
            value, flag = getattr(section, field.name), field.metadata.get("flag", field.name)
            if flag and isinstance(value, (int, float)) and not isinstance(value, bool):
                numeric.add(flag.replace("-", "_"))
    named = {flag.removeprefix("--").replace("-", "_") for flag in flags}
    unchecked = numeric - named
    assert not unchecked, f"numeric flags without a range check: {sorted(unchecked)}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "/no/such/train.jsonl"], "--dataset /no/such/train.jsonl: no such file"),
        (["--sft-dataset", "./no/such.jsonl"], "--sft-dataset ./no/such.jsonl: no such file"),
        (["--eval-benchmarks", "aime,/no/such.jsonl"], "--eval-benchmarks /no/such.jsonl: no such"),
        (["--eval-every", "5", "--eval-benchmarks", "aimee"], "--eval-benchmarks aimee: unknown"),
        (["--reward", "/no/such/reward.py:f"], "no file"),
        (["--reward", "nosuchmod_xyz:f"], "cannot import 'nosuchmod_xyz'"),
        (["--max-prompt-len", "600", "--max-seq-len", "512"], "--max-prompt-len must be below"),
        (["--overlong-buffer", "5000"], "--overlong-buffer must be below the completion budget"),
        (["--eval-every", "10"], "--eval-every needs --eval-benchmarks"),
        (["--eval-solution-key", "w", "--top-p", "0.9"], "not top-p or top-k; train with"),
        (["--self-hints"], "--self-hints needs --solution-key"),
        (
            ["--algo", "bnpo", "--overlong-buffer", "8"],
            "--overlong-buffer takes returns out of --advantage bnpo's [0, 1]: drop one",
        ),
        (["--advantage", "bnpo", "--kl-estimator", "k1_return"], "k1_return's returns leave"),
        (
            ["--eval-solution-format", "raw"],
            "argument --eval-solution-format: invalid choice: 'raw'",
        ),
    ],
)
def test_missing_paths_and_impossible_combinations(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        sage.parse_config(["--model", "m", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


TYPED = [
    ["--lr", "nan"],
    ["--lr", "-1"],
    ["--temperature", "0"],
    ["--model", "/no/such/model/dir"],
    ["--reward", "nosuchmod:f"],
    ["--beta", "nan"],
    ["--max-seq-len", "-5"],
    ["--report-to", "jsonl,mlflow"],
]


def with_model(argv):
    return argv if "--model" in argv else ["--model", "Qwen/Qwen2.5-Math-7B", *argv]


@pytest.mark.parametrize("argv", TYPED)
def test_as_a_user_types_it_one_line_and_nothing_written(argv, tmp_path, capsys):
    """sage.py's main on each: exit 2, one error line, nothing on stdout, no run directory."""
    with pytest.raises(SystemExit) as stop:
        sage.main([*with_model(argv), "--out", str(tmp_path / "runs")])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len([line for line in captured.err.splitlines() if "error:" in line]) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [TYPED[0], TYPED[3], TYPED[4]])  # a number, a path, a module
def test_as_a_user_types_it_one_line_in_seconds_and_nothing_written(argv, tmp_path):
    """The same, as a process started from the shell (import costs included): no traceback."""
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "sage.py"), *with_model(argv)]
        + ["--out", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stdout == ""
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_bad_flag_is_refused_before_transformers_peft_or_vllm_is_imported():
    """Refusing a flag costs torch's import and little more: the flags are read and checked
    before any library that loads models (they are imported where they are used)."""
    code = (
        "import sys, sage\n"
        "try:\n"
        "    sage.parse_config(['--model', 'x', '--lr', '-1'])\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 2\n"
        "heavy = ('transformers', 'peft', 'vllm', 'datasets', 'math_verify')\n"
        "print(sorted(name for name in heavy if name in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "0.95"], "replays temperature and min-p, not top-p or top-k"),
        (["--top-p", "1.0", "--top-k", "20"], "pass --top-p 1.0 --top-k -1"),
    ],
)
def test_evaluate_refuses_a_probe_that_would_not_measure_the_sampler(argv, message, capsys):
    """evaluate.py --solution-key: the support probe replays the temperature and min-p only, so
    top-p or top-k (which would change the sampled-from distribution) is one line, before any
    model loads."""
    import evaluate

    code = evaluate.main(["--model", "m", "--benchmarks", "aime", "--solution-key", "s", *argv])
    error = capsys.readouterr().err
    assert code == 2 and message in error and len(error.strip().splitlines()) == 1


def test_evaluate_refuses_a_probe_at_temperature_0_as_argparse_does(capsys):
    """--temperature 0 (greedy) leaves the probe no log-probs (logits / 0): every one was NaN
    and every problem counted outside the support. Refused as a range is, before any work."""
    import evaluate

    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--model", "m", "--solution-key", "s", "--temperature", "0"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "--solution-key with --temperature 0" in last
    assert "pass --temperature > 0" in last


def test_evaluate_refuses_an_unknown_solution_format_as_argparse_does(capsys):
    import evaluate

    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--model", "m", "--solution-key", "s", "--solution-format", "raw"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2
    assert last.startswith("evaluate.py: error: argument --solution-format: invalid choice: 'raw'")


def test_an_unknown_benchmark_is_one_line_before_any_model_loads(capsys):
    """A benchmark that is neither a known name nor a local data file: evaluate.py and sage.py say
    so before the model loads (a 7B takes minutes to load)."""
    import evaluate

    code = evaluate.main(["--model", "m", "--benchmarks", "aime,amc,math500-l5"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1
    assert error[0].startswith("evaluate.py: error: --benchmarks amc: unknown benchmark; name one")


def test_a_cpu_torch_beside_an_nvidia_gpu_is_refused_by_every_entry_point(
    tmp_path, monkeypatch, capsys
):
    """One guard (cli.torch_build_problem), one line from each command that would run a
    model on the GPU: sage.py, evaluate.py, extras/trl_sage.py and bench/gpu_step.py."""
    import torch
    from test_bench import bench_script

    import evaluate
    from extras import trl_sage

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(cli, "nvidia_gpu_visible", lambda: True)
    refusal = r"CPU build but this machine has an NVIDIA GPU .*make clean install"
    assert re.search(refusal, cli.torch_build_problem())
    out = ["--out", str(tmp_path / "out")]
    for run in (
        lambda: sage.main(["--model", "m", *out]),
        lambda: trl_sage.main(["--model", "m", *out]),
        lambda: bench_script("gpu_step").main(["--small"]),
    ):
        with pytest.raises(SystemExit) as stop:
            run()
        said = capsys.readouterr().err.strip().splitlines() or [str(stop.value.code)]
        assert re.search(refusal, said[-1]), said  # the usage line (argparse), then the error
    assert evaluate.main(["--model", "m", "--out", str(tmp_path / "r.json")]) == 2
    assert re.search(refusal, capsys.readouterr().err.strip().splitlines()[-1])
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.json").exists()
    monkeypatch.setattr(cli, "nvidia_gpu_visible", lambda: False)
    assert cli.torch_build_problem() is None  # a CPU machine: nothing to say


def test_a_cuda_torch_that_sees_no_gpu_is_refused_where_there_is_one(monkeypatch):
    """A CUDA build whose driver is too old for it sees no GPU: one line, the driver named."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli, "nvidia_gpu_visible", lambda: True)
    assert re.search(r"CUDA build but sees no GPU: .*driver >= 580", cli.torch_build_problem())
    monkeypatch.setattr(cli, "nvidia_gpu_visible", lambda: False)  # no GPU, or hidden on purpose
    assert cli.torch_build_problem() is None


def test_hiding_every_gpu_on_purpose_is_no_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not cli.nvidia_gpu_visible()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--answer-key", "sol"], "no field 'sol' (fields: answer, generated_solution, problem)"),
        (["--self-hints", "--solution-key", "sol"], "has no field 'sol'"),
        (["--sft-dataset", "train.jsonl", "--sft-answer-key", "nope"], "has no field 'nope'"),
        (["--sft-dataset", "train.jsonl", "--answer-key", "sol"], "has no field 'sol'"),
        (
            ["--eval-every", "1", "--eval-benchmarks", "held.jsonl", "--eval-solution-key", "w"],
            "--eval-solution-key w: no problem of held has a reference solution in that field",
        ),
        (
            ["--eval-every", "1", "--eval-benchmarks", "held.jsonl", "--eval-group-key", "level"],
            "--eval-group-key level: no problem has a group in that field",
        ),
    ],
)
def test_a_field_the_data_lacks_is_one_line_before_the_model_loads(
    argv, message, tiny_model_dir, tmp_path, monkeypatch
):
    """A flag naming a field of the data (--answer-key, --solution-key, --eval-solution-key, the
    SFT data's) can only be checked against the data, which loads before the model does: a typo
    costs the tokenizer's load, not a 7B's."""
    from machinery import models

    def load_base_model(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(models, "load_base_model", load_base_model)
    rows = "".join(
        f'{{"problem": "{n} + 1?", "answer": "{n + 1}", "generated_solution": "+1"}}\n'
        for n in range(4)
    )
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "held.jsonl").write_text(rows)
    monkeypatch.chdir(tmp_path)
    data = ["--model", str(tiny_model_dir), "--dataset", "train.jsonl", "--problem-key", "problem"]
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        sage.main([*data, "--answer-key", "answer", *argv, "--out", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()


def test_an_out_that_cannot_be_written_is_one_line_before_anything_loads(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """--out where nothing can be written (here under a file, or /proc): sage.py and evaluate.py
    say so in one line before anything loads; it was a traceback after the model had loaded
    (sage.py) or after the first seed's samples (evaluate.py)."""
    import evaluate
    from machinery import models

    monkeypatch.setattr(models, "load_tokenizer", None)  # (it would fail if called)
    (tmp_path / "a-file").write_text("")
    for out in (tmp_path / "a-file" / "runs", "/proc/runs"):
        with pytest.raises(SystemExit) as refused:
            sage.main(["--model", str(tiny_model_dir), "--out", str(out)])
        assert re.fullmatch(
            rf"error: --out {out}: cannot write in \S+; pass another", str(refused.value)
        )
        argv = ["--model", str(tiny_model_dir), "--out", f"{out}/results.json"]
        assert evaluate.main(argv) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and said[0].startswith(f"evaluate.py: error: --out {out}/results")
        argv = ["--model", str(tiny_model_dir), "--save-completions", f"{out}/samples"]
        assert evaluate.main([*argv, "--out", str(tmp_path / "results.json")]) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert said[0].startswith(f"evaluate.py: error: --save-completions {out}/samples: cannot")
    assert evaluate.main(["--model", str(tiny_model_dir), "--out", str(tmp_path)]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        f"evaluate.py: error: --out {tmp_path}: a directory; name the results file "
        f"(e.g. {tmp_path}/results.json)"
    ]


def test_a_resume_that_changes_the_checkpoints_shapes_is_one_line_before_anything_loads(
    tmp_path, monkeypatch
):
    """--resume with another --lora-rank, --full-finetune, --model or --sft-dataset is refused
    before anything loads (a traceback from load_state_dict after the model had loaded, or for
    --sft-dataset an adapter put on another base without a word); other flags may change (a
    longer run, another learning rate), the model's directory may be written another way, and a
    --full-finetune run has no rank to keep."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "sft.jsonl").write_text("")

    def started(*argv):
        run_dir = tmp_path / "run"
        (run_dir / "checkpoint").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoint" / "trainer_state.pt").write_bytes(b"")
        config = sage.parse_config(["--model", "model", *argv])
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        return lambda *resumed: cli.check_run_dir(
            str(run_dir), sage.parse_config(["--resume", *resumed]), with_reference=True
        )

    resume = started("--guide", "branch")
    resume("--model", str(tmp_path / "model") + "/", "--steps", "2000", "--lr", "1e-5")
    for shaping, said in (
        (["--model", "model", "--lora-rank", "16"], "--lora-rank 16 (was 8)"),
        (["--model", "model", "--full-finetune"], "--full-finetune True (was False)"),
        (["--model", "org/other", "--lora-rank", "4"], "--model 'org/other' (was 'model'), --lo"),
        (["--model", "model", "--sft-dataset", "sft.jsonl"], "--sft-dataset 'sft.jsonl' (was '')"),
    ):
        with pytest.raises(SystemExit, match=rf"^error: --resume with {re.escape(said)}.*new run$"):
            resume(*shaping)
    started("--full-finetune")("--model", "model", "--full-finetune", "--lora-rank", "16")
    # the checkpoint's adapter was trained on the SFT start: without it, on another base
    resume = started("--sft-dataset", "sft.jsonl")
    resume("--model", "model", "--sft-dataset", "./sft.jsonl")
    with pytest.raises(SystemExit, match=r"^error: --resume with --sft-dataset '' \(was 'sft"):
        resume("--model", "model")


def test_a_checkpoint_a_crash_left_uncommitted_does_not_lock_the_run(tmp_path, monkeypatch):
    """Killed inside its first checkpoint's write, a run leaves checkpoint/model/ and a
    temporary trainer_state.pt: no checkpoint (the rename commits one). A rerun without --resume
    starts it again (it was refused: "already holds a checkpoint"), with --resume is told there
    is none."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "run" / "checkpoint" / "model").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / ".tmp-trainer_state.pt").write_bytes(b"half")
    fresh = sage.parse_config(["--model", "model", "--out", ".", "--name", "run"])
    cli.check_run_dir(str(tmp_path / "run"), fresh, with_reference=True)
    resumed = sage.parse_config(["--model", "model", "--out", ".", "--name", "run", "--resume"])
    with pytest.raises(SystemExit, match="^error: --resume but no checkpoint in"):
        cli.check_run_dir(str(tmp_path / "run"), resumed, with_reference=True)


def test_the_studies_and_the_demo_refuse_an_out_they_cannot_write_in_one_line(capsys):
    """make demo (extras/two_mode.py), make demo-sums (extras/demo.py) and make compare
    (extras/compare.py) check --out as sage.py does, before any work (they were tracebacks)."""
    from extras import compare, demo, two_mode

    for command in (two_mode.parse_args, compare.parse_args, demo.main):
        with pytest.raises(SystemExit) as stop:
            command(["--out", "/proc/study"])
        said = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and said.endswith(
            "--out /proc/study: cannot write in /proc; pass another"
        )
