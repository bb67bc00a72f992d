"""The repository reads as a tutorial: five top-level chapters that hold the method, machinery/
that every step runs on and task/ that poses the problems and grades them (both imported at the
top of the chapters), extras/ behind their flags; one step's update, from the graded rollouts to
the optimizer's step, runs chapter code only; no import cycle; a first line that says what each
file holds; the method findable by one grep; a formatter and a linter that pass; no reference to
a document the repository does not hold.
machinery/'s and task/'s sizes are ceilings that catch growth, not limits to pack code into."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ["sage", "rollout", "guides", "loss", "evaluate"]
PACKAGES = ["extras", "machinery", "task", "toy"]
MACHINERY_LIMIT = 2100  # the machinery/ modules that `import sage` loads (2,100 now)
TASK_LIMIT = 850  # the task/ modules that `import sage` loads (849 now)
EXTRAS_EVERY_RUN = ["extras", "extras.flags"]  # the extras' flags (dataclasses), parsed by sage.py


def source_files():
    files = [os.path.join(REPO, name) for name in sorted(os.listdir(REPO)) if name.endswith(".py")]
    for package in PACKAGES:
        folder = os.path.join(REPO, package)
        files += [
            os.path.join(folder, name)
            for name in sorted(os.listdir(folder))
            if name.endswith(".py")
        ]
    return files


def module_name(path):
    relative = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return relative.removesuffix(".__init__")


def path_of(module):
    base = os.path.join(REPO, *module.split("."))
    return base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")


def known_modules():
    return {module_name(path) for path in source_files()}


def imported_project_modules(path, top_level_only=False):
    """The project modules a file imports: everywhere, or only at module level (not inside a
    function or class: what ``import`` of the file runs)."""
    tree = ast.parse(open(path).read())
    nodes = tree.body if top_level_only else ast.walk(tree)
    known, found = known_modules(), set()
    for node in nodes:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from extras import demo` imports extras.demo; `from task.grading import X`,
            # task.grading
            submodules = [
                f"{node.module}.{alias.name}"
                for alias in node.names
                if f"{node.module}.{alias.name}" in known
            ]
            names = submodules or [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            package = module_name(path).rsplit(".", 1)[0]
            names = [f"{package}.{node.module}" if node.module else package]
        for name in names:
            parts = name.split(".")
            for depth in range(
                len(parts), 0, -1
            ):  # the deepest project module named, and its packages
                if ".".join(parts[:depth]) in known:
                    found.update(
                        ".".join(parts[:d])
                        for d in range(1, depth + 1)
                        if ".".join(parts[:d]) in known
                    )
                    break
    found.discard(module_name(path))
    return found


def core_path(root="sage"):
    """``root`` and every project module it imports at module level, transitively."""
    seen, todo = set(), [root]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imported_project_modules(path_of(module), top_level_only=True)
    return seen


def lines(module):
    with open(path_of(module)) as handle:
        return len(handle.read().splitlines())


def test_the_top_level_holds_the_five_chapters_and_only_those():
    top = sorted(name for name in os.listdir(REPO) if name.endswith(".py"))
    assert top == sorted(f"{name}.py" for name in CORE)


def test_import_sage_loads_the_chapters_machinery_the_task_and_of_the_extras_their_flags():
    path = core_path("sage")
    extras = sorted(m for m in path if m.split(".")[0] not in [*CORE, "machinery", "task"])
    assert extras == EXTRAS_EVERY_RUN, f"sage imports more at module level: {extras}"
    machinery = sum(lines(module) for module in path if module.split(".")[0] == "machinery")
    task = sum(lines(module) for module in path if module.split(".")[0] == "task")
    assert machinery <= MACHINERY_LIMIT, f"machinery/ {machinery} lines, task/ {task}"
    assert task <= TASK_LIMIT, f"machinery/ {machinery} lines, task/ {task}"


# What the update may run besides the chapters: the fast log-prob kernel, kept beside its
# definition (loss.token_logps_and_entropies), as nanoGPT keeps its flash attention
UPDATE_MACHINERY = {"machinery/fast_logprobs.py"}


def test_one_update_runs_chapter_code_only_from_the_graded_rollouts_to_the_optimizer_step(
    tiny, monkeypatch
):
    """The default step (LoRA, pi_ref the adapter switched off, the branch guide, k3, the fast
    log-prob kernel) from graded rollouts on: the batch, pi_ref's log-probs, the advantages, log
    q, the loss and its metrics, the backward and AdamW. Every project function it calls is in a
    chapter, so a learner reads all of it there."""
    import copy

    import torch
    from transformers import masking_utils

    import loss
    import sage
    from machinery import models

    mapping = masking_utils.AttentionMaskInterface._global_mapping
    monkeypatch.setitem(mapping, "sdpa", mapping["sdpa"])  # restored after the test
    loss.attend_somewhere_under_sdpa()  # the SDPA mask load_policy installs runs in the update
    model, tokenizer = tiny
    config = sage.Config(model="tiny", prompts_per_step=2, rollouts=4, micro_batch_size=4)
    assert config.guide.name == "branch" and config.fast_logprobs  # the default step
    policy, reference = sage.make_policy(
        copy.deepcopy(model), full_finetune=False, lora_rank=4, lora_alpha=8, with_reference=True
    )
    optimizer, _ = models.make_optimizer(
        policy, lr=1e-3, weight_decay=0.0, total_steps=2, warmup_steps=0
    )
    prompts = [[11, 12, 13, 14]] * 4 + [[21, 22, 23]] * 4
    completions = [[30 + i, 40 + i, 50 + i][: 1 + i % 3] for i in range(8)]
    rollouts = sage.Rollouts(
        prompt_ids=prompts,
        completion_ids=completions,
        texts=[""] * 8,
        finish_reasons=["stop"] * 8,
        engine_logps=[[-1.0] * len(c) for c in completions],
        problems=[""] * 8,
        answers=[""] * 8,
    )
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    called = set()

    def record(frame, event, arg):  # the project's files, not the venv's nor this test's
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(REPO + os.sep):
            path = os.path.relpath(path, REPO)
            if not path.startswith((".venv", "tests")):
                called.add(path)

    sys.setprofile(record)
    try:
        batches = sage.micro_batches(rollouts, config, pad_id=0, device="cpu")
        held = [sage.held_fixed_logps(policy, reference, batch, config) for _, batch in batches]
        advantages = sage.step_advantages(
            rewards, batches, held=held, config=config, step=0, generator=generator
        )
        metrics = sage.update_policy(
            policy, optimizer, batches, held, advantages, config, step=0, generator=generator
        )
    finally:
        sys.setprofile(None)
    assert "q/mean" in metrics and "kl/ref_k3" in metrics  # the guide and the anchor ran
    outside = {path for path in called if path not in {f"{m}.py" for m in CORE}}
    assert outside <= UPDATE_MACHINERY, sorted(outside - UPDATE_MACHINERY)


def test_import_sage_imports_of_extras_only_their_flags():
    """What README.md and extras/__init__.py say: a run imports extras/flags.py (the extras'
    flags), and each extra's code only behind its flag."""
    code = "import sage, sys; print(sorted(m for m in sys.modules if m.startswith('extras')))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert ast.literal_eval(result.stdout.strip().splitlines()[-1]) == EXTRAS_EVERY_RUN


def test_the_chapters_hold_no_formatter_escape():
    for module in CORE:
        source = open(path_of(module)).read()
        assert "fmt: skip" not in source and "fmt: off" not in source, module


def test_no_function_in_the_chapters_is_very_long_or_takes_very_many_parameters():
    offenders = []
    for module in CORE:
        for node in ast.walk(ast.parse(open(path_of(module)).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                count = len(arguments.posonlyargs + arguments.args + arguments.kwonlyargs)
                count -= bool(arguments.args and arguments.args[0].arg in ("self", "cls", "ctx"))
                if node.end_lineno - node.lineno + 1 > 100 or count > 10:
                    offenders.append(f"{module}.py:{node.lineno} {node.name}")
    assert not offenders, offenders


def test_no_function_anywhere_is_longer_than_100_lines():
    """(ruff's formatting at 100 columns)"""
    long = []
    bench = [
        os.path.join(REPO, "bench", n)
        for n in os.listdir(os.path.join(REPO, "bench"))
        if n.endswith(".py")
    ]
    for path in source_files() + bench:
        for node in ast.walk(ast.parse(open(path).read())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > 100
            ):
                long.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name}")
    assert not long, long


def test_one_grep_lists_what_sage_changes_in_grpo():
    marked = [line for module in CORE for line in open(path_of(module)) if "# SAGE:" in line]
    assert len(marked) >= 3, marked


def test_no_import_cycle_among_the_projects_modules():
    """Imports inside functions count too. Extras are plug-ins: the chapters reach them by flagged
    calls and they may use the chapters, so those calls are not dependencies; machinery and the
    task never import an extra."""
    graph = {module_name(path): imported_project_modules(path) for path in source_files()}
    for module, deps in graph.items():
        deps -= set(PACKAGES)  # a package's __init__ is not a dependency of its modules
        if module in CORE:
            deps -= {d for d in deps if d.startswith("extras.")}
        if module.split(".")[0] in ("machinery", "task"):
            assert not any(d.startswith("extras") for d in deps), (module, deps)
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            cycle = trail[trail.index(node) :] + [node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            visit(child, trail + [node])
        state[node] = "done"

    for module in sorted(graph):
        visit(module, [])
    assert "sage" not in graph["evaluate"] and "evaluate" in graph["sage"]


def test_the_chapters_import_of_extras_at_module_level_only_their_flags():
    """Each chapter on its own (what importing it runs): of extras/, only what README.md says
    every run imports; an extra's code is imported inside the branch of its flag."""
    offenders = {
        module: sorted(
            m
            for m in imported_project_modules(path_of(module), top_level_only=True)
            if m.startswith("extras") and m not in EXTRAS_EVERY_RUN
        )
        for module in CORE
    }
    assert not any(offenders.values()), offenders


def test_no_extra_is_imported_by_a_chapter_it_imports():
    """The chapters reach an extra behind its flag, and an extra may use the chapters; but no
    chapter imports (even inside a function) an extra that imports it back, directly or through
    other modules: the backend choice lives in the callers, not in rollout.py."""
    graph = {module_name(path): imported_project_modules(path) for path in source_files()}

    def reached_from(module):
        seen, todo = set(), list(graph[module])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += graph.get(name, ())
        return seen

    circles = [
        f"{chapter} -> {extra} -> ... -> {chapter}"
        for chapter in CORE
        for extra in sorted(graph[chapter])
        if extra.startswith("extras.") and chapter in reached_from(extra)
    ]
    assert not circles, circles


def test_machinery_and_the_task_import_no_chapter():
    """Imports go one way: the chapters use machinery/ and task/, never the reverse (an import
    inside a function counts); a chapter passes them what it needs as values."""
    offenders = []
    for path in source_files():
        if module_name(path).split(".")[0] not in ("machinery", "task"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [
                f"{os.path.relpath(path, REPO)}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[0] in CORE
            ]
    assert not offenders, offenders


def test_every_file_opens_with_what_it_holds():
    for path in source_files():
        docstring = ast.get_docstring(ast.parse(open(path).read()))
        assert docstring and len(docstring.splitlines()[0]) > 20, (
            f"{os.path.relpath(path, REPO)} has no opening line"
        )


def test_the_readme_is_short_and_gives_a_reading_order():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert len(readme.splitlines()) <= 250
    assert "read in this order" in readme.lower()
    for module in CORE:
        assert f"{module}.py" in readme


@pytest.mark.skipif(
    shutil.which("ruff") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ruff")),
    reason="ruff is not installed (make install installs it)",
)
@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff_format_and_check_pass(command):
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    ruff = ruff if os.path.exists(ruff) else shutil.which("ruff")
    result = subprocess.run([ruff, *command, "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_nothing_cites_a_document_the_repository_does_not_hold():
    pattern = re.compile(r"\bSPEC\b|\bthe issue\b|\bSTYLE\.md\b|\bLAYOUT\.md\b")
    offenders = []
    for folder, directories, files in os.walk(REPO):
        directories[:] = [
            d
            for d in directories
            if not d.startswith(".") and d not in ("docs", "runs", "__pycache__")
        ]
        for name in files:
            if name.endswith((".py", ".md")) and name != "test_layout.py":
                path = os.path.join(folder, name)
                for number, line in enumerate(open(path), 1):
                    if pattern.search(line):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{number}")
    assert not offenders, offenders
