"""Command lines from typed dataclasses: a flag per field, its help the docstring under the field.

sage.py's ``Config`` and evaluate.py's argument classes are plain dataclasses whose fields carry
a docstring (the cleanrl style). ``parse`` turns one into an argparse command line: ``--some-field``
of the field's type, ``--flag / --no-flag`` for booleans, positional arguments for fields marked
``positional`` in their metadata, and the docstring (with the default) as the help. It returns only
the values given on the command line, so a caller can layer defaults (presets) under them. Bad
input ends in argparse's usage and one line, ``prog: error: ...``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing
from typing import Sequence


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source.

    >>> import rollout
    >>> field_docs(rollout.SamplingConfig)["n"]
    'Completions per prompt (the group size G).'
    """
    body = ast.parse(inspect.getsource(cls).strip()).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            if isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _argument_type(annotation) -> type:
    """str, int, float or bool from an annotation such as ``int`` or ``float | None``."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = typing.get_origin(options[0]) or options[0]
    return base if base in (str, int, float, bool, list) else str


def build_parser(cls, prog: str, description: str = "", epilog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser whose options are the dataclass's fields (defaults suppressed)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     argument_default=argparse.SUPPRESS)
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        kind = _argument_type(hints[item.name])
        has_default = item.default is not dataclasses.MISSING or item.default_factory is not dataclasses.MISSING
        shown = f" (default: {item.default!r})" if item.default is not dataclasses.MISSING else ""
        help_text = docs.get(item.name, "") + shown
        if item.metadata.get("positional"):
            parser.add_argument(item.name, nargs="+", help=help_text)
        elif kind is bool:
            parser.add_argument("--" + item.name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument("--" + item.name.replace("_", "-"), dest=item.name, type=kind, help=help_text,
                                required=not has_default)
    return parser


def parse(cls, argv: Sequence[str] | None, prog: str, description: str = "", epilog: str | None = None
          ) -> tuple[dict, argparse.ArgumentParser]:
    """The values given on the command line (only those), and the parser (for ``parser.error``)."""
    parser = build_parser(cls, prog, description, epilog)
    return vars(parser.parse_args(None if argv is None else list(argv))), parser


def positional(**kwargs):
    """A dataclass field read from positional arguments (one or more)."""
    return dataclasses.field(default_factory=list, metadata={"positional": True}, **kwargs)
