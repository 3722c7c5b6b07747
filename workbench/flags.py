"""Magic flags generated from the option dataclasses of :mod:`workbench.options`.

A field becomes ``--field-name`` (or its ``flag`` metadata), its docstring the help, its
default and ``Literal`` choices are shown; a parsed line becomes the dataclass again.
Kernel side.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The string written under each field of dataclass ``cls`` (one line, spaces collapsed)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _base_type(hint):
    """``int | None`` → int; ``Literal[...]`` stays; ``str | list[str] | None`` → str."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def number(kind: type, what: str, zero_ok: bool = False):
    """An argparse type: a whole number (``int``) or seconds (``float``), > 0 unless ``zero_ok``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if kind is float and (value < 0 if zero_ok else value <= 0):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'0 or ' if zero_ok else ''}more than 0 seconds")
        return value

    return parse


def rank_list(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ranks, e.g. --ranks 0,1") from None


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of dataclass ``cls`` (fields marked ``api_only`` have none)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("api_only"):
            continue
        name = meta.get("flag") or "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        help_text = docs.get(f.name, "")
        kwargs: dict = {"dest": f.name, "default": f.default}
        if name.startswith("--no-"):
            kwargs.update(action="store_const", const=False)
        elif kind is bool:
            kwargs.update(action="store_true")
        elif meta.get("flag") == "--launcher-option":
            kwargs.update(action="append", default=[], metavar=meta["metavar"])
        else:
            if typing.get_origin(kind) is typing.Literal:
                kwargs["metavar"] = "|".join(typing.get_args(kind))
            elif kind is int:
                kwargs["type"] = number(int, "a whole number, e.g. 2")
            elif kind is float:
                kwargs["type"] = number(float, "a number of seconds", meta.get("zero_ok", False))
            elif typing.get_origin(kind) is list:
                kwargs["type"] = rank_list
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            if f.default not in (None, False):
                help_text += f" (default {f.default:g})" if isinstance(f.default, float) else f" (default {f.default})"
        parser.add_argument(name, help=help_text.replace("%", "%%"), **kwargs)


def options_from(args: argparse.Namespace, cls, **extra):
    """The ``cls`` instance a parsed line asked for (its fields that have a flag, plus ``extra``)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**values, **extra)
