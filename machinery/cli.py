"""Command lines from typed dataclasses: a flag per field, its help the docstring under the field.

sage.py's ``Config`` and evaluate.py's argument classes are plain dataclasses whose fields carry
a docstring (the cleanrl style). ``parse_config`` turns one into an argparse command line:

* ``--some-field`` of the field's type, ``--flag / --no-flag`` for booleans, positional arguments
  for fields marked ``positional``, and the docstring (with the default) as the help;
* a field whose type is itself a dataclass (``Config.loss: LossConfig``) contributes that
  dataclass's fields as flags of their own, so each chapter keeps its knobs beside its code;
* ``metadata={"flag": "loss-agg"}`` renames a field's flag, ``{"flag": None}`` keeps it off the
  command line (a value the program sets, not the user);
* ``sections`` adds the knobs of optional features, returned beside the main instance.

``parse`` returns only the values given on the command line. Bad input ends in argparse's usage
and one line, ``prog: error: ...``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing
from collections.abc import Sequence

SIMPLE_TYPES = (str, int, float, bool, list)


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source.

    >>> import rollout
    >>> field_docs(rollout.SamplingConfig)["n"]
    'Completions per prompt (the group size G).'
    """
    try:
        body = ast.parse(inspect.getsource(cls).strip()).body[0].body
    except (OSError, TypeError):  # a class without source (defined in a doctest, say)
        return {}
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            if isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _argument_type(annotation):
    """str, int, float, bool or list from ``int`` or ``float | None``; a dataclass as it is;
    else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) is tuple:  # (a schedule's bounds, say): no flag
        return None
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = typing.get_origin(options[0]) or options[0]
    return base if base in SIMPLE_TYPES else None


def _add_flags(parser, cls, dests: dict) -> None:
    """Add a flag per field of ``cls`` (recursing into dataclass fields); ``dests`` maps each
    argparse destination to its (dataclass, field name) for building the instances back."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    group = parser.add_argument_group(inspect.getdoc(cls).splitlines()[0]) if dests else parser
    for item in dataclasses.fields(cls):
        kind, flag = _argument_type(hints[item.name]), item.metadata.get("flag", item.name)
        if dataclasses.is_dataclass(kind):
            _add_flags(parser, kind, dests)
            continue
        if kind is None or flag is None:
            continue
        dest = flag.replace("-", "_")
        dests[dest] = (cls, item.name)
        has_default = (
            item.default is not dataclasses.MISSING
            or item.default_factory is not dataclasses.MISSING
        )
        shown = f" (default: {item.default!r})" if item.default is not dataclasses.MISSING else ""
        help_text = docs.get(item.name, "") + shown
        if item.metadata.get("positional"):
            group.add_argument(dest, nargs="+", help=help_text)
        elif kind is bool:
            group.add_argument(
                "--" + flag.replace("_", "-"),
                dest=dest,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            group.add_argument(
                "--" + flag.replace("_", "-"),
                dest=dest,
                type=kind,
                help=help_text,
                required=not has_default,
            )


def _build(cls, given: dict, dests: dict):
    """An instance of ``cls`` from the parsed values, nested dataclasses built the same way."""
    hints, values = typing.get_type_hints(cls), {}
    by_field = {(owner, name): dest for dest, (owner, name) in dests.items()}
    for item in dataclasses.fields(cls):
        if dataclasses.is_dataclass(_argument_type(hints[item.name])):
            values[item.name] = _build(hints[item.name], given, dests)
        elif by_field.get((cls, item.name)) in given:
            values[item.name] = given[by_field[(cls, item.name)]]
    return cls(**values)


def build_parser(
    cls,
    prog: str,
    description: str = "",
    epilog: str | None = None,
    sections: dict[str, type] | None = None,
) -> tuple[argparse.ArgumentParser, dict]:
    """An argparse parser whose options are the fields of ``cls`` and of ``sections`` (defaults
    suppressed), and the map from each option's destination to its field."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, argument_default=argparse.SUPPRESS
    )
    dests: dict = {}
    _add_flags(parser, cls, dests)
    for section in (sections or {}).values():
        _add_flags(parser, section, dests)
    return parser, dests


def parse(
    cls, argv: Sequence[str] | None, prog: str, description: str = "", epilog: str | None = None
) -> tuple[dict, argparse.ArgumentParser]:
    """The values given on the command line (only those), by field name, and the parser."""
    parser, _ = build_parser(cls, prog, description, epilog)
    return vars(parser.parse_args(None if argv is None else list(argv))), parser


def parse_config(
    cls,
    argv: Sequence[str] | None,
    prog: str,
    description: str = "",
    epilog: str | None = None,
    sections: dict[str, type] | None = None,
):
    """(an instance of ``cls``, {name: an instance of each section}, the parser) from ``argv``.

    >>> import rollout
    >>> parse_config(rollout.SamplingConfig, ["--n", "4", "--min-p", "0.1"], prog="demo")[0].n
    4
    """
    parser, dests = build_parser(cls, prog, description, epilog, sections)
    given = vars(parser.parse_args(None if argv is None else list(argv)))
    try:  # a dataclass that checks its own values raises ValueError: one line, as argparse's own
        built = {name: _build(section, given, dests) for name, section in (sections or {}).items()}
        return _build(cls, given, dests), built, parser
    except ValueError as error:
        parser.error(str(error))


def positional(**kwargs):
    """A dataclass field read from positional arguments (one or more)."""
    return dataclasses.field(default_factory=list, metadata={"positional": True}, **kwargs)


class UsageError(ValueError):
    """Input a command cannot use (data, a reward, a tracker); the message names the problem and
    the fix."""


def run(main) -> None:
    """Run a command's ``main()``; the errors it reports for bad input (``UsageError``, which
    rollout.RolloutError is too) end in one line, exit 1."""
    try:
        main()
    except (UsageError, FloatingPointError) as error:
        sys.exit(f"error: {error}")


def expand_preset(
    argv: list[str], presets: dict[str, list[str]], default_guide: str = "none"
) -> list[str]:
    """The user's flags after their --algo preset's flags, so that the user's win. A guide acts
    only through the KL anchor, so a preset's ``--kl none`` is dropped when a guide is on
    (``default_guide`` when --guide is not given).

    >>> presets = {"b": ["--advantage", "x", "--kl", "none"]}
    >>> expand_preset(["--algo", "b", "--guide", "branch"], presets)
    ['--advantage', 'x', '--algo', 'b', '--guide', 'branch']
    >>> expand_preset(["--algo", "b", "--guide", "none"], presets, default_guide="branch")
    ['--advantage', 'x', '--kl', 'none', '--algo', 'b', '--guide', 'none']
    """
    algo, guide = flag_value(argv, "--algo", "grpo"), flag_value(argv, "--guide", default_guide)
    preset = presets.get(algo, [])  # an unknown --algo: the flag checks say so
    if guide != "none" and "--kl" in preset:
        at = preset.index("--kl")
        preset = preset[:at] + preset[at + 2 :]
    return [*preset, *argv]


def flag_value(argv: list[str], flag: str, default: str) -> str:
    """The last value given to ``flag`` (``--flag v`` or ``--flag=v``), else ``default``.

    >>> flag_value(["--steps", "3", "--steps=5"], "--steps", "1")
    '5'
    """
    value = default
    for index, item in enumerate(argv):
        if item == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value
