"""Engine side: a rank is a batch process, as a ``torchrun`` worker is.

Libraries ask whether they run interactively and change what they do: ``tqdm.auto``,
transformers and datasets draw notebook widgets (dead on a rank: nobody renders its
displays), Lightning refuses its ddp strategies (``sys.ps1`` is set on an engine). Scripts
expect ``python script.py ARGS``: ``%run`` on a rank runs them so, their ``exit(n)`` ends the
rank's part of the cell with that code, and their own ``init_process_group`` joins the
fleet's group instead of failing on it. :func:`become_batch_process` does all of it once,
when the engine joins a fleet run (before any user code imports those libraries).
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import sys

from workbench.messages import REDRAW_MARK
from workbench.rank_state import STATE

_CARRIAGE_RETURN = re.compile(r"\r(?!\n)")  # not a \r\n line end

NOTICES: list[str] = []  # one-line notices for the kernel, sent with the cell's reply


class RankExit:
    """``exit()`` / ``quit()`` on a rank: end this rank's part of the cell with a code
    (SystemExit, as in a script), not the engine (IPython's would end it after the cell)."""

    def __repr__(self) -> str:
        return "Use exit(code) to end this rank's part of the cell with that exit code"

    def __call__(self, code=None):
        raise SystemExit(code)


def become_batch_process() -> None:
    """Make this engine look like a torchrun worker to libraries and scripts (idempotent)."""
    for prompt in ("ps1", "ps2"):  # Lightning's _IS_INTERACTIVE, code.interact-style checks
        if hasattr(sys, prompt):
            delattr(sys, prompt)
    import builtins

    builtins.exit = builtins.quit = RankExit()
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        # transformers' is_in_notebook (and older tqdm) look for IPKernelApp in the shell's config
        shell.config.pop("IPKernelApp", None)
        # IPython puts these in builtins while it runs a request: its exit() would end the engine
        # after the cell; rich asks a builtin get_ipython() (cells and scripts keep the user_ns one)
        trap = shell.builtin_trap.auto_builtins
        trap["exit"] = trap["quit"] = builtins.exit
        trap.pop("get_ipython", None)
        builtins.__dict__.pop("get_ipython", None)
        shell.user_ns["exit"] = shell.user_ns["quit"] = builtins.exit
        shell.register_magic_function(run_script, "line", "run")
    text_progress_bars()
    _mark_redraws()
    _join_instead_of_init()


def text_progress_bars() -> None:
    """``tqdm.auto`` (used by transformers, datasets, huggingface_hub, accelerate) picks its text
    bars: it chooses the notebook flavour whenever ipykernel is loaded, as on every engine. Call it
    before anything imports ``tqdm.auto`` (accelerate does): it decides once, at import."""
    kernel_shell = sys.modules.pop("ipykernel.zmqshell", None)
    try:
        import tqdm.auto  # noqa: F401
    except ImportError:
        pass
    finally:
        if kernel_shell is not None:
            sys.modules["ipykernel.zmqshell"] = kernel_shell


def run_script(line: str) -> None:
    """``%run script.py ARGS`` (or ``%run -m module ARGS``) on a rank, as ``torchrun script.py
    ARGS`` runs it: ``__name__ == "__main__"``, ``sys.argv``, the script's folder first on
    ``sys.path``; its exceptions (and ``sys.exit``) are the cell's. As its process would under
    torchrun, its changes to the environment end with it (libraries that launch rewrite
    ``WORLD_SIZE`` and the like; the rank's next cells need the fleet's)."""
    words = shlex.split(line)
    module = bool(words) and words[0] == "-m"
    if module:
        words = words[1:]
    if not words or (words[0].startswith("-") and not module):
        raise _usage_error()
    target, args = words[0], words[1:]
    saved_argv, saved_path, saved_environ = sys.argv[:], sys.path[:], dict(os.environ)
    try:
        if module:
            sys.argv = [target, *args]  # runpy replaces argv[0] with the module's file
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(os.path.expanduser(target))
            if not os.path.isfile(path):
                raise FileNotFoundError(f"%run: no script {target!r} on this rank (its folder is {os.getcwd()})")
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        if dict(os.environ) != saved_environ:
            os.environ.clear()
            os.environ.update(saved_environ)


def _usage_error() -> Exception:
    from workbench.errors import OptionsError

    return OptionsError("%run on a rank takes a script and its arguments (%run train.py --epochs 3) or "
                        "-m module ARGS; IPython's own %run options (-i, -t, -d, ...) do not apply on ranks")


def _mark_redraws() -> None:
    """Mark each carriage return this rank writes (:data:`~workbench.messages.REDRAW_MARK`), so that
    the kernel shows a progress bar's newest state, and another rank's bars only when asked."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "_workbench_marks_redraws", False):
            continue
        write = stream.write

        def marked(text, _write=write):
            if isinstance(text, str) and "\r" in text:
                text = _CARRIAGE_RETURN.sub("\r" + REDRAW_MARK, text)
            return _write(text)

        stream.write = marked
        stream._workbench_marks_redraws = True


def _join_instead_of_init() -> None:
    """A script's own ``dist.init_process_group(...)`` joins the fleet's group when it asks for
    the same backend, world size and rank (a notice the first time), and refuses in one line
    when not. With no fleet group (destroyed by the user) it makes a group, as it would."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = getattr(c10d.init_process_group, "_workbench_original", c10d.init_process_group)

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, *args,
                           **kwargs):
        if not (dist.is_initialized() and STATE.group is not None and STATE.group_intact()):
            return original(backend, init_method, timeout, world_size, rank, *args, **kwargs)
        _check_same_group(backend, world_size, rank)
        _notice_joined()
        return None

    init_process_group._workbench_original = original
    init_process_group.__doc__ = original.__doc__
    c10d.init_process_group = dist.init_process_group = init_process_group


def _check_same_group(backend, world_size: int, rank: int) -> None:
    import torch.distributed as dist

    from workbench.errors import WorkbenchError

    spec = STATE.spec
    have = str(dist.get_backend()).lower()
    asked = {part.split(":")[-1] for part in str(backend).lower().split(",")} if backend else set()
    wrong = []
    if asked and not asked <= {part.split(":")[-1] for part in have.split(",")}:
        wrong.append(f"backend {backend!r}")
    if world_size not in (-1, None) and int(world_size) != spec.world_size:
        wrong.append(f"world_size={world_size}")
    if rank not in (-1, None) and int(rank) != spec.rank:
        wrong.append(f"rank={rank}")
    if wrong:
        raise WorkbenchError(
            f"init_process_group({', '.join(wrong)}) does not match this fleet's process group "
            f"({have}, {spec.world_size} ranks); start a fleet that matches "
            f"(%fleet start -n {world_size if world_size not in (-1, None) else spec.world_size}"
            f"{' --backend ' + sorted(asked)[0] if asked else ''}) or drop the argument")


def _notice_joined() -> None:
    if not STATE.joined_notice_sent:
        STATE.joined_notice_sent = True
        NOTICES.append("the code's init_process_group joined the fleet's process group (it exists already; "
                       "nothing was created)")


def take_notices() -> list[str]:
    """The notices gathered since the last reply."""
    taken = NOTICES[:]
    NOTICES.clear()
    return taken
