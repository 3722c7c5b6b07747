"""Magic flags generated from the option dataclasses of :mod:`workbench.options`, and the
parser the magics use (:class:`MagicParser`: one-line errors, did-you-mean, generated help).

A field becomes ``--field-name`` (or its ``flag`` metadata), its docstring the help, its
default and ``Literal`` choices are shown; a parsed line becomes the dataclass again.
Kernel side.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import re
import shlex
import textwrap
import types
import typing

from IPython.core.error import UsageError

from workbench.options import CellCall, CellOptions, FleetOptions, TuneOptions


class MagicParser(argparse.ArgumentParser):
    """argparse that reports errors as one-line UsageErrors instead of exiting, suggests the
    nearest sub-command or flag for a typo, and answers ``-h``/``--help`` with help generated
    from the parser (:meth:`parse_line`)."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}{self._did_you_mean(message)} (see {self.prog.split()[0]} -h)")

    def parse_line(self, line: str, defaults: dict | None = None) -> argparse.Namespace | None:
        """Parse a magic's line (``defaults``: values of the flags not given, instead of the
        parser's); with ``-h``/``--help`` print the help instead and return None."""
        try:
            tokens = shlex.split(line)
        except ValueError as exc:  # an unbalanced quote, a trailing backslash
            raise UsageError(f"{self.prog}: cannot read {line.strip()!r}: {exc} (quote a value as 'a b' or \"a b\")")
        if "-h" in tokens or "--help" in tokens:
            print(self.help_text(tokens[0] if tokens else None))
            return None
        return self.parse_args(tokens, namespace=argparse.Namespace(**(defaults or {})))

    def help_text(self, command: str | None = None) -> str:
        """Usage and every flag with its help; one sub-command's if ``command`` names one."""
        commands = self._commands()
        if command in commands:
            return commands[command].format_help().rstrip()
        return "\n\n".join([self.format_help().rstrip(), *(p.format_help().rstrip() for p in commands.values())])

    def _commands(self) -> dict[str, "MagicParser"]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def _did_you_mean(self, message: str) -> str:
        if match := re.search(r"invalid choice: '([^']*)'", message):
            candidates = list(self._commands())
        elif match := re.search(r"unrecognized arguments: (\S+)", message):
            candidates = [flag for parser in [self, *self._commands().values()]
                          for flag in parser._option_string_actions]
        else:
            return ""
        close = difflib.get_close_matches(match.group(1), candidates, n=1, cutoff=0.6)
        return f"; did you mean {close[0]!r}?" if close else ""

    def exit(self, status=0, message=None):
        if message:
            raise UsageError(message.strip())
        raise UsageError(self.format_help())


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


def number_list(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers, e.g. 8,16") from None


def word_list(text: str) -> list[str]:
    return [word.strip() for word in text.split(",") if word.strip()]


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
                kwargs["type"] = (rank_list if f.name == "ranks" else
                                  number_list if typing.get_args(kind) == (int,) else word_list)
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            if f.default not in (None, False):
                help_text += f" (default {f.default:g})" if isinstance(f.default, float) else f" (default {f.default})"
        parser.add_argument(name, help=help_text.replace("%", "%%"), **kwargs)


def options_from(args: argparse.Namespace, cls, **extra):
    """The ``cls`` instance a parsed line asked for (its fields that have a flag, plus ``extra``)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**values, **extra)


count = number(int, "a whole number, e.g. 2")


@functools.cache  # built once: argparse costs ~0.6 ms per build, every cell parses
def fleet_parser() -> MagicParser:
    parser = MagicParser(prog="%fleet", add_help=False)
    sub = parser.add_subparsers(dest="command", parser_class=MagicParser)
    start = sub.add_parser("start", prog="%fleet start", add_help=False)
    add_flags(start, FleetOptions)
    sub.add_parser("status", prog="%fleet status", add_help=False)
    stacks = sub.add_parser("stacks", prog="%fleet stacks", add_help=False)
    stacks.add_argument("--native", action="store_true", help="C frames too, through py-spy (when installed)")
    stacks.add_argument("--all", action="store_true", dest="everything",
                        help="also the engine's own frames and threads (ipykernel, zmq, workbench)")
    scale = sub.add_parser("scale", prog="%fleet scale", add_help=False)
    scale.add_argument("n", type=count, help="the new number of ranks")
    scale.add_argument("--hosts", metavar="HOST:N,...", default=None,
                       help="more hosts for the new engines (--launcher ssh), e.g. hostC:2")
    recover = sub.add_parser("recover", prog="%fleet recover", add_help=False)
    recover.add_argument("--shrink", action="store_true", help="go on without the lost ranks")
    replace = sub.add_parser("replace", prog="%fleet replace", add_help=False)
    replace.add_argument("ranks", type=rank_list, metavar="R[,R]", help="the ranks to swap for fresh engines")
    sub.add_parser("stop", prog="%fleet stop", add_help=False)
    park = sub.add_parser("park", prog="%fleet park", add_help=False)
    park.add_argument("--if-nothing-lost", dest="anyway", action="store_false",
                      help="refuse when rank 0 holds names that no setup cell makes (default: list them and park)")
    sub.add_parser("unpark", prog="%fleet unpark", add_help=False)
    pull = sub.add_parser("pull", prog="%fleet pull", add_help=False)
    pull.add_argument("name", help="the name on the rank; bound to the same name in the kernel")
    pull.add_argument("--rank", type=int, default=0, help="the rank to copy from (default 0)")
    export = sub.add_parser("export", prog="%fleet export", add_help=False,
                            description="the --setup cells and the last training cell as a script for torchrun / "
                                        "accelerate launch (plus an sbatch file with --launcher slurm)")
    export.add_argument("path", help="the script to write, e.g. train.py")
    export.add_argument("--force", action="store_true", help="overwrite the files if they exist")
    tune = sub.add_parser("tune", prog="%fleet tune", add_help=False,
                          description="short trials of a training step over micro-batch sizes, gradient accumulation, "
                                      "strategies and precisions; the fastest that fits becomes the next cells' default")
    tune.add_argument("step", help="step(model, batch) -> loss, defined on the ranks (tune adds backward and the "
                                   "optimizer step)")
    tune.add_argument("--model", required=True, help="a model, or a function that builds one, on the ranks (never "
                                                     "changed: each trial uses a fresh copy)")
    tune.add_argument("--batch", required=True, help="batch(size) -> a batch of that many samples, on the ranks")
    tune.add_argument("--optimizer", default=None, help="optimizer(params) on the ranks (default AdamW)")
    add_flags(tune, TuneOptions)
    push = sub.add_parser("push", prog="%fleet push", add_help=False)
    push.add_argument("assignments", nargs="+", help="name=expression, evaluated in the kernel")
    return parser


@functools.cache
def distributed_parser() -> MagicParser:
    parser = MagicParser(prog="%%distributed", add_help=False)
    add_flags(parser, CellOptions)
    add_flags(parser, CellCall)
    return parser


@functools.cache
def checkpoint_parser() -> MagicParser:
    parser = MagicParser(prog="%checkpoint", add_help=False)
    sub = parser.add_subparsers(dest="command", parser_class=MagicParser)
    save = sub.add_parser("save", prog="%checkpoint save", add_help=False)
    save.add_argument("--tag", default=None, help="checkpoint name (default step-<workbench.step>)")
    save.add_argument("--async", dest="async_", action="store_true",
                      help="return once the state is copied; write in the background")
    save.add_argument("--keep-last", type=count, default=None, help="then delete all but the newest K complete checkpoints")
    save.add_argument("--to", default=None, metavar="DIR|URL",
                      help="save into this folder or fsspec URL (s3://bucket/prefix) instead of the fleet's")
    listing = sub.add_parser("list", prog="%checkpoint list", add_help=False)
    listing.add_argument("folder", nargs="?", default=None, metavar="DIR|URL",
                         help="list this folder or fsspec URL instead of the fleet's")
    restore = sub.add_parser("restore", prog="%checkpoint restore", add_help=False)
    restore.add_argument("tag", nargs="?", default="latest",
                         help="TAG, latest (default), a checkpoint's folder or URL, or a folder or URL of checkpoints "
                              "(its newest)")
    rm = sub.add_parser("rm", prog="%checkpoint rm", add_help=False)
    rm.add_argument("tag", help="the checkpoint to delete")
    sub.add_parser("wait", prog="%checkpoint wait", add_help=False)
    export = sub.add_parser("export", prog="%checkpoint export", add_help=False)
    export.add_argument("tag", help="TAG, latest or a checkpoint folder")
    export.add_argument("--hf", required=True, metavar="DIR", help="the Hugging Face folder to write (new or empty)")
    export.add_argument("--model", default=None, metavar="NAME",
                        help="the prepared model's name on the ranks (default: the only one)")
    return parser


@functools.cache
def metrics_parser() -> MagicParser:
    parser = MagicParser(prog="%metrics", add_help=False)
    parser.add_argument("--summary", action="store_true", help="text summary of the whole run: last/min/mean per rank")
    parser.add_argument("--path", action="store_true", help="where the run's metrics.jsonl, wandb run, TensorBoard files and logs are")
    return parser
