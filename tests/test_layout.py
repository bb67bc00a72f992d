"""The repository reads as chapters: no import cycle, short files and functions, a first line that
says what each file holds, and no reference to a document the repository does not hold."""

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(name[:-3] for name in os.listdir(REPO) if name.endswith(".py"))
PACKAGES = ["toy"]


def source_files():
    files = [os.path.join(REPO, f"{name}.py") for name in MODULES]
    for package in PACKAGES:
        folder = os.path.join(REPO, package)
        files += [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".py")]
    return files


def module_name(path):
    relative = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return relative.removesuffix(".__init__")


def imported_project_modules(path):
    """Every project module a file imports, at the top or inside a function."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from toy import exact` needs the submodule toy.exact; `from data import Problem`, data.
            submodules = [f"{node.module}.{alias.name}" for alias in node.names
                          if os.path.exists(os.path.join(REPO, *node.module.split("."), f"{alias.name}.py"))]
            names = submodules or [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            package = module_name(path).rsplit(".", 1)[0] if "." in module_name(path) else module_name(path)
            names = [f"{package}.{node.module}" if node.module else package]
        for name in names:
            top = name.split(".")[0]
            if top in MODULES:
                found.add(top)
            elif top in PACKAGES:
                found.add(".".join(name.split(".")[:2]))
    found.discard(module_name(path))
    return found


def import_graph():
    graph = {}
    for path in source_files():
        known = set(MODULES) | {module_name(p) for p in source_files()}
        graph[module_name(path)] = {name for name in imported_project_modules(path) if name in known}
    return graph


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            cycle = trail[trail.index(node):] + [node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            visit(child, trail + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])
    assert "sage" not in graph["evaluate"] and "evaluate" in graph["sage"]


@pytest.mark.parametrize("name, limit", [("sage.py", 900), ("evaluate.py", 800)])
def test_the_trainer_and_the_evaluator_stay_readable_in_one_sitting(name, limit):
    with open(os.path.join(REPO, name)) as handle:
        assert len(handle.read().splitlines()) <= limit


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in source_files() + [os.path.join(REPO, "bench", n) for n in os.listdir(os.path.join(REPO, "bench"))
                                  if n.endswith(".py")]:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name}")
    assert not long, long


def test_every_file_opens_with_what_it_holds():
    for path in source_files():
        docstring = ast.get_docstring(ast.parse(open(path).read()))
        assert docstring and len(docstring.splitlines()[0]) > 20, f"{os.path.relpath(path, REPO)} has no opening line"


def test_nothing_cites_a_document_the_repository_does_not_hold():
    pattern = re.compile(r"\bSPEC\b|\bthe issue\b|\bSTYLE\.md\b|\bLAYOUT\.md\b")
    offenders = []
    for folder, directories, files in os.walk(REPO):
        directories[:] = [d for d in directories if not d.startswith(".") and d not in ("docs", "runs", "__pycache__")]
        for name in files:
            if name.endswith((".py", ".md")) and name != "test_layout.py":
                path = os.path.join(folder, name)
                for number, line in enumerate(open(path), 1):
                    if pattern.search(line):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{number}")
    assert not offenders, offenders
