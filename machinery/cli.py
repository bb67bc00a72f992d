"""Command lines from typed dataclasses, and the checks that run before anything loads.

sage.py's ``Config``, evaluate.py's and the extras' argument classes are plain dataclasses whose
fields carry a docstring (the cleanrl style). ``parse_config`` turns one into an argparse command
line (docs/implementation.md says why argparse, not HfArgumentParser or tyro):

* ``--some-field`` of the field's type, ``--flag / --no-flag`` for booleans, positional arguments
  for fields marked ``positional``, and the docstring (with the default) as the help;
* a field whose type is itself a dataclass (``Config.loss: LossConfig``) contributes that
  dataclass's fields as flags of their own, so each chapter keeps its knobs beside its code;
* ``metadata={"flag": "loss-agg"}`` renames a field's flag, ``{"flag": None}`` keeps it off the
  command line (a value the program sets, not the user), ``{"choices": (...)}`` lists the values
  argparse accepts;
* ``metadata={"range": ">= 1"}`` (or "> 0", "in [0, 1)", ...) is the field's range; it and the
  choices are checked by ``field_problem`` on every instance the command line builds, and by the
  chapters' dataclasses on their own;
* ``sections`` adds the knobs of optional features, returned beside the main instance.

Bad input ends in argparse's usage and one line, ``prog: error: ...``, naming the flag and the
fix; then ``check_config`` refuses the combinations that cannot run, missing local paths, a reward
that does not import, a tracker that is unknown or not installed, and a torch that cannot use
this machine's GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import inspect
import json
import math
import os
import sys
import tempfile
import typing
from collections.abc import Sequence

import docstring_parser

from machinery import UsageError
from task import problems
from task.grading import load_reward_function
from task.problems import LOCAL_FORMATS


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source by docstring_parser.

    >>> import rollout
    >>> field_docs(rollout.SamplingConfig)["n"]
    'Completions per prompt (the group size G).'
    """
    fields = docstring_parser.parse_from_object(cls).params
    return {f.arg_name: " ".join(f.description.split()) for f in fields if f.args[0] == "attribute"}


def flag_of(item: dataclasses.Field) -> str | None:
    """A field's flag without its dashes ("loss-agg"), or None for a field that is no flag."""
    flag = item.metadata.get("flag", item.name)
    return flag and flag.replace("_", "-")


def _add_flags(parser, cls, nested: bool) -> None:
    """A flag per str, int, float or bool field of ``cls`` (``float | None`` too), and per pair of
    floats (a schedule's bounds: ``--token-alpha 0.3 0.1``); the fields of a nested dataclass in
    a group of their own; other types (a dict): no flag."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    group = parser.add_argument_group(inspect.getdoc(cls).splitlines()[0]) if nested else parser
    for item in dataclasses.fields(cls):
        kind, flag = hints[item.name], flag_of(item)
        if type(None) in typing.get_args(kind):  # float | None: a float
            kind = typing.get_args(kind)[0]
        has_default = item.default is not dataclasses.MISSING
        shown = f" (default: {item.default!r})" if has_default else ""
        help_text = docs.get(item.name, "") + shown
        if item.metadata.get("positional"):
            group.add_argument(item.name, nargs="+", help=help_text)
        elif dataclasses.is_dataclass(kind):
            _add_flags(parser, kind, nested=True)
        elif kind in (str, int, float, bool) and flag:
            required = not has_default and item.default_factory is dataclasses.MISSING
            typed = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
            choices = item.metadata.get("choices")
            group.add_argument(
                "--" + flag, required=required, choices=choices, help=help_text, **typed
            )
        elif typing.get_origin(kind) is tuple and flag:  # (upper, lower)
            pair = {"nargs": 2, "type": float, "metavar": ("UPPER", "LOWER")}
            group.add_argument("--" + flag, help=help_text, **pair)


def _build(cls, given: dict):
    """An instance of ``cls`` from the parsed values (argparse's names: the flag's, "-" read as
    "_"), nested dataclasses built the same way; a value out of its range raises ValueError."""
    hints, values = typing.get_type_hints(cls), {}
    for item in dataclasses.fields(cls):
        name = (flag_of(item) or "").replace("-", "_")
        if dataclasses.is_dataclass(hints[item.name]):
            values[item.name] = _build(hints[item.name], given)
        elif name in given:
            value = given[name]
            values[item.name] = tuple(value) if isinstance(value, list) else value
    instance = cls(**values)
    if (problem := field_problem(instance)) is not None:
        raise ValueError(problem)
    return instance


def build_parser(cls, sections: dict[str, type] | None = None, **parser_args):
    """An argparse parser (``parser_args``: prog, description, epilog) whose options are the
    fields of ``cls`` and of ``sections``; defaults suppressed: it returns the values given."""
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS, **parser_args)
    _add_flags(parser, cls, nested=False)
    for section in (sections or {}).values():
        _add_flags(parser, section, nested=True)
    return parser


def parse_config(cls, argv: Sequence[str] | None, sections: dict | None = None, **parser_args):
    """(an instance of ``cls``, {name: an instance of each section}, the parser) from ``argv``.

    >>> import rollout
    >>> parse_config(rollout.SamplingConfig, ["--n", "4", "--min-p", "0.1"], prog="demo")[0].n
    4
    """
    parser = build_parser(cls, sections, **parser_args)
    given = vars(parser.parse_args(argv))
    try:  # a value out of range, or a dataclass's own check: one line, as argparse's own
        built = {name: _build(section, given) for name, section in (sections or {}).items()}
        return _build(cls, given), built, parser
    except ValueError as error:
        parser.error(str(error))


def positional(**kwargs):
    """A dataclass field read from positional arguments (one or more)."""
    return dataclasses.field(default_factory=list, metadata={"positional": True}, **kwargs)


# ---- Choices and ranges: declared on the fields, checked here ---------------------------------


def in_range(value: float, rule: str) -> bool:
    """Whether a finite ``value`` satisfies ``rule`` ("> 0", ">= 1", "in [0, 1)", ...).

    >>> in_range(0.0, "in [0, 1)"), in_range(1.0, "in [0, 1)"), in_range(-1, ">= -1")
    (True, False, True)
    """
    if rule.startswith("in "):
        low, high = (float(bound) for bound in rule[4:-1].split(","))
        above = value >= low if rule[3] == "[" else value > low
        below = value <= high if rule[-1] == "]" else value < high
        return above and below
    operator, bound = rule.split()
    return value > float(bound) if operator == ">" else value >= float(bound)


def field_problem(instance, rules: dict[str, str] | None = None) -> str | None:
    """The one-line complaint about the first field of ``instance`` (not the nested dataclasses)
    not among its metadata's choices, or out of its range: its metadata's, else ``rules``' for
    its flag; None (unset) passes.

    >>> import evaluate
    >>> field_problem(evaluate.EvalSampling(), rules={"top-p": "in (0, 0.9]"})
    '--top-p 0.95: must be a finite number in (0, 0.9]'
    """
    for item in dataclasses.fields(instance):
        flag, value = flag_of(item), getattr(instance, item.name)
        choices = item.metadata.get("choices")
        if choices is not None and value not in choices:
            return f"unknown --{flag} {value!r}: choose one of {', '.join(choices)}"
        rule = item.metadata.get("range") or (rules or {}).get(flag)
        if rule is None or value is None:
            continue
        if isinstance(value, tuple):  # a schedule's bounds: each in the range
            if not all(math.isfinite(v) and in_range(v, rule) for v in value):
                return f"--{flag} {' '.join(map(str, value))}: each must be a finite number {rule}"
        elif not math.isfinite(value) or not in_range(value, rule):
            return f"--{flag} {value}: must be a finite number {rule}"
    return None


def ranges(*classes) -> dict[str, str]:
    """{flag: rule} of every field with a range, nested dataclasses included.

    >>> import loss
    >>> ranges(loss.LossConfig)["eps-low"]
    'in [0, 1)'
    """
    found = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for item in dataclasses.fields(cls):
            if dataclasses.is_dataclass(kind := hints[item.name]):
                found.update(ranges(kind))
            elif "range" in item.metadata:
                found[flag_of(item)] = item.metadata["range"]
    return found


# ---- One line for bad input, and the flags read first -----------------------------------------


def run(main) -> None:
    """Run a command's ``main()``; the errors it reports for bad input (``UsageError``, which
    rollout.RolloutError is too) end in one line, exit 1."""
    try:
        main()
    except (UsageError, FloatingPointError) as error:
        sys.exit(f"error: {error}")


def peek(argv: list[str], **defaults: str) -> dict[str, str | None]:
    """The values of a few flags (``defaults``: each flag's name and its value when absent), read
    from ``argv`` before the full parse and leaving the rest alone (a flag given without its
    value reads None: the full parser then says so).

    >>> peek(["--algo", "dapo", "--steps", "5"], algo="grpo", guide="branch")
    {'algo': 'dapo', 'guide': 'branch'}
    """
    first = argparse.ArgumentParser(add_help=False)
    for name, default in defaults.items():
        first.add_argument(f"--{name}", nargs="?", default=default)
    return vars(first.parse_known_args(argv)[0])


# ---- What a flag's value names: local files, the reward, this machine's torch ------------------

MODEL, DATA = "a local model directory or a hub name", "a local data file or a hub dataset"
BENCHMARKS = "benchmark names or local files"


def missing_path(flag: str, path: str, what: str) -> str | None:
    """The one line for a local ``path`` (not a hub name, "org/name", which is checked when it
    loads) that does not exist, else None.

    >>> missing_path("--model", "Qwen/Qwen2.5-Math-7B", MODEL) is None
    True
    >>> missing_path("--model", "./no/such", MODEL)
    '--model ./no/such: no such file or directory; pass a local model directory or a hub name'
    """
    local = path.startswith(("/", ".", "~")) or path.count("/") > 1
    if local or os.path.splitext(path)[1].lower() in LOCAL_FORMATS:
        if not os.path.exists(os.path.expanduser(path)):
            return f"{flag} {path}: no such file or directory; pass {what}"
    return None


def benchmark_problem(flag: str, spec: str) -> str | None:
    """The one line for the first of a comma-separated list of benchmarks that is neither a name
    of ``task.problems.BENCHMARKS`` nor a local data file that exists, else None.

    >>> benchmark_problem("--benchmarks", "aime, amc23") is None
    True
    >>> benchmark_problem("--benchmarks", "amc")  # doctest: +ELLIPSIS
    '--benchmarks amc: unknown benchmark; name one of aime, amc23, ..., or a local data file'
    """
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        local = os.path.splitext(entry)[1].lower() in LOCAL_FORMATS
        if local and (problem := missing_path(flag, entry, BENCHMARKS)):
            return problem
        if not local and entry not in problems.BENCHMARKS:
            known = ", ".join(problems.BENCHMARKS)
            return f"{flag} {entry}: unknown benchmark; name one of {known}, or a local data file"
    return None


def check_config(config, error) -> None:
    """Call ``error(message)`` for the first setting of ``config`` (a ``sage.Config``, its ranges
    and choices checked as it was built) that cannot run."""
    guide, anchor, evaluation = config.guide.name, config.loss, config.eval
    sft, budget = config.extras["sft"], config.max_seq_len - config.max_prompt_len
    if not config.model:
        error(
            "--model is required: a hub name or a local model directory "
            "(for the CPU demo run `make demo`)"
        )
    if budget <= 0:
        error("--max-prompt-len must be below --max-seq-len")
    if anchor.kl_estimator == "k1_return" and anchor.kl != "reverse":  # Eq. 8 is the reverse KL's
        error("--kl-estimator k1_return needs --kl reverse")
    if guide != "none" and (anchor.kl == "none" or anchor.beta == 0):
        error(f"--guide {guide} acts only through the KL anchor: use --kl reverse with --beta > 0")
    if sft.sft_only and not sft.sft_dataset:
        error("--sft-only needs --sft-dataset")
    if config.extras["hints"].self_hints and not config.extras["hints"].solution_key:
        error("--self-hints needs --solution-key, the training data's field of reference solutions")
    if evaluation.eval_every > 0 and not evaluation.eval_benchmarks:
        error(
            "--eval-every needs --eval-benchmarks (names such as aime, or local .jsonl files with "
            "problem and answer fields)"
        )
    if evaluation.eval_solution_key and not (config.top_p == 1.0 and config.top_k <= 0):
        error(
            "--eval-solution-key: the support probe replays the sampler's temperature and min-p, "
            "not top-p or top-k; train with --top-p 1.0 --top-k -1 (the paper's) to probe it"
        )
    if config.extras["dynamic_sampling"].overlong_buffer and anchor.advantage == "bnpo":
        error("--overlong-buffer takes returns out of --advantage bnpo's [0, 1]: drop one")
    if config.extras["dynamic_sampling"].overlong_buffer >= budget:
        error(
            f"--overlong-buffer must be below the completion budget (--max-seq-len minus "
            f"--max-prompt-len = {budget})"
        )
    paths = [("--model", config.model, MODEL), ("--dataset", config.dataset, DATA)]
    paths += [("--sft-dataset", sft.sft_dataset, DATA)]
    for path in paths:
        if problem := missing_path(*path):
            error(problem)
    if problem := benchmark_problem("--eval-benchmarks", evaluation.eval_benchmarks):
        error(problem)
    from machinery import runs

    try:  # --reward's module and --report-to's trackers now: a typo costs no model load
        load_reward_function(config.reward)
        runs.parse_report_to(config.report_to)
    except UsageError as problem:
        error(str(problem))
    if problem := torch_build_problem():
        error(problem)


def unwritable(flag: str, path: str, typed: str | None = None) -> str | None:
    """The one line refusing an output ``path`` when nothing can be made in the nearest existing
    path at or above it (a file's own directory, for a file to be replaced): a file in the way,
    no write permission, a read-only file system; else None. ``typed``: the flag's value as
    given, where ``path`` is built from it (the run directory under --out). It is tried with a
    nameless file, removed at once: os.access says yes to root everywhere.

    >>> unwritable("--out", "/proc/x"), unwritable("--out", os.path.join(os.getcwd(), "new"))
    ('--out /proc/x: cannot write in /proc; pass another', None)
    """
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing == os.path.abspath(path) and os.path.isfile(existing):  # a file to replace
        existing = os.path.dirname(existing)
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError:
        return f"{flag} {typed or path}: cannot write in {existing}; pass another"


def check_eval_args(args) -> str | None:
    """evaluate.py's flags (an ``EvalArgs``, its ranges and choices checked as it was built) that
    cannot run, then the torch build: one line, else None."""
    seeds = [seed.strip() for seed in str(args.seeds).split(",") if seed.strip()]
    if not seeds or not all(seed.isdigit() for seed in seeds):
        return f"--seeds {args.seeds}: write comma-separated integers >= 0 such as 0,1,2"
    if args.solution_key and not (args.top_p == 1.0 and args.top_k <= 0):
        return (
            f"--solution-key with --top-p {args.top_p} --top-k {args.top_k}: the support probe "
            "replays temperature and min-p, not top-p or top-k; pass --top-p 1.0 --top-k -1 so "
            "that it measures the distribution the sampler draws from"
        )
    paths = [("--model", args.model, MODEL), ("--adapter", args.adapter or "", "a peft adapter")]
    if problem := next(filter(None, (missing_path(*path) for path in paths)), None):
        return problem
    if os.path.isdir(args.out):
        return (
            f"--out {args.out}: a directory; name the results file (e.g. {args.out}/results.json)"
        )
    outputs = {"--out": args.out, "--save-completions": args.save_completions}
    for flag, path in outputs.items():
        if path and (problem := unwritable(flag, path)):
            return problem
    return benchmark_problem("--benchmarks", args.benchmarks) or torch_build_problem()


def nvidia_gpu_visible() -> bool:
    """An NVIDIA GPU's device file is there, unless CUDA_VISIBLE_DEVICES hides every GPU."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def torch_build_problem() -> str | None:
    """A torch that cannot use this machine's NVIDIA GPU would train or sample a 7B on the CPU in
    float32 without a word: the one line that refuses it, else None. sage.py, evaluate.py,
    extras/trl_sage.py and bench/gpu_step.py all ask here."""
    import torch

    if not nvidia_gpu_visible():
        return None
    if torch.version.cuda is None:  # a .venv made on a CPU login node
        return (
            f"torch {torch.__version__} is a CPU build but this machine has an NVIDIA GPU (the "
            "work would run on the CPU in float32): run `make clean install` on this node"
        )
    if torch.cuda.is_available():
        return None
    return (
        f"torch {torch.__version__} is a CUDA build but sees no GPU: vLLM 0.32's CUDA 13 build "
        "needs NVIDIA driver >= 580 (see nvidia-smi); to run on the CPU, set "
        'CUDA_VISIBLE_DEVICES=""'
    )


# The flags that shape a checkpoint's tensors, or the base they train: a resume must keep them.
SHAPING = ("model", "full_finetune", "sft_dataset", "lora_rank")


def same_path(value):
    """A local path as one name however it is written (./tiny, tiny/, its absolute path); any
    other value as it is."""
    exists = isinstance(value, str) and os.path.exists(value)
    return os.path.realpath(value) if exists else value


def check_run_dir(run_dir: str, config, with_reference: bool) -> None:
    """Before anything loads, and before the memory plan (these are cheaper and say more): the
    run directory can be made, a checkpoint is continued only with --resume, --resume needs one
    and the flags that shaped it, and on the CPU (no plan) the weights of a --full-finetune model
    (and its reference, ``with_reference``) must fit the RAM."""
    import torch

    from machinery import memory_plan, runs

    if problem := unwritable("--out", run_dir, typed=config.out):
        raise SystemExit(f"error: {problem}")
    checkpoint = runs.checkpoint_dir(run_dir)
    if runs.has_checkpoint(run_dir) and not config.resume:  # (the rename commits one)
        raise SystemExit(
            f"error: {run_dir} already holds a checkpoint; pass --resume to continue it or "
            "--name for a new run"
        )
    if config.resume and not runs.has_checkpoint(run_dir):
        raise SystemExit(
            f"error: --resume but no checkpoint in {checkpoint}; drop --resume to start fresh"
        )
    if config.resume:
        check_resumed_flags(os.path.join(run_dir, "config.json"), config)
    if config.full_finetune and not torch.cuda.is_available():
        memory_plan.check_full_finetune_fits(
            config.model, with_reference=with_reference, with_engine=config.backend == "vllm"
        )


def check_resumed_flags(saved_config: str, config) -> None:
    """--resume with the flags that shaped the checkpoint's tensors (``SHAPING``), as the run's
    ``saved_config`` (its config.json) recorded them."""
    if not os.path.exists(saved_config):
        return
    with open(saved_config) as handle:
        saved = json.load(handle)
    saved["sft_dataset"] = saved.get("extras", {}).get("sft", {}).get("sft_dataset", "")
    now = {**vars(config), "sft_dataset": config.extras["sft"].sft_dataset}  # the base trained on
    shaping = SHAPING[:3] if config.full_finetune else SHAPING  # (no adapter: no rank)
    said = [
        f"--{name.replace('_', '-')} {now[name]!r} (was {saved.get(name)!r})"
        for name in shaping
        if same_path(saved.get(name)) != same_path(now[name])
    ]
    if said:
        raise SystemExit(
            f"error: --resume with {', '.join(said)}: the checkpoint's tensors fit the model and "
            "the flags the run started with; resume with those, or pass --name for a new run"
        )
