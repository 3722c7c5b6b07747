"""Where every rank's threads are now (``%fleet stacks``), without stopping them.

Each engine registers :mod:`faulthandler` on ``SIGUSR1`` when it joins a run
(:func:`enable`): the signal makes the interpreter write every thread's Python stack to the
rank's stack file at once, also while the rank is inside a collective or any other C call,
and the rank goes on. The kernel (:func:`collect`) signals the local engines, reads what
each wrote and groups identical stacks across ranks, as it does for errors. ``--native``
asks ``py-spy dump --native`` instead (C frames too), where py-spy is installed.
Bottom layer: the engine half imports nothing of workbench; the kernel half gets the fleet.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time

from workbench.rank_state import STATE

SIGNAL = signal.SIGUSR1
WAIT_S = 3.0  # for a rank to write its stacks
_MACHINERY = re.compile(  # frames of the engine itself, not of the user's code
    r'File "[^"]*(/(ipyparallel|ipykernel|tornado|traitlets|zmq|jupyter_client)/|/(threading|selectors|runpy)\.py|'
    r'/asyncio/|/workbench/(rank/engine|rank/template|metrics/logger)\.py|<frozen runpy>|<string>)')
_THREAD_ID = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$", re.M)


def stack_file(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, "logs", f"stacks-{pid}.txt")


def enable(run_dir: str) -> None:
    """Engine side: dump every thread's stack to this rank's stack file on ``SIGUSR1``."""
    import faulthandler

    path = stack_file(run_dir, os.getpid())
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if STATE.stack_file is not None:
        STATE.stack_file.close()
    opened = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "w")  # noqa: SIM115 - kept open
    opened.write(f"main thread {threading.main_thread().ident:#x}\n")
    opened.flush()
    faulthandler.register(SIGNAL, file=opened, all_threads=True, chain=False)
    STATE.stack_file = opened


def collect(members: list, run_dir: str, world: int, native: bool = False, everything: bool = False) -> str:
    """Kernel side: every rank's stacks now, identical ones grouped (``members``: the ranks'
    engines, with ``rank``, ``pid`` and ``host``); ``everything``: the engine's own frames and
    threads too."""
    if native and shutil.which("py-spy") is None:
        from workbench.errors import OptionsError

        raise OptionsError("--native needs py-spy (pip install py-spy); without it, Python frames are shown")
    dumps: dict[int, str] = {}
    for member in members:
        if not member.local:
            dumps[member.rank] = f"(engine on {member.host}: stacks are read from local engines only)"
        elif native:
            dumps[member.rank] = _py_spy(member.pid)
        else:
            dumps[member.rank] = _faulthandler_dump(stack_file(run_dir, member.pid), member.pid, everything)
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(dumps.items()):
        groups.setdefault(text, []).append(rank)
    lines = []
    for text, ranks in groups.items():
        lines.append(f"── rank {','.join(map(str, ranks))} of {world} ──")
        lines.append(text.rstrip())
    return "\n".join(lines)


def _faulthandler_dump(path: str, pid: int, everything: bool) -> str:
    try:
        before = os.path.getsize(path)
        with open(path) as f:
            main = f.readline().split()[-1]
    except (OSError, IndexError):
        return "(no stack file: the engine started before this workbench version, or is gone)"
    try:
        os.kill(pid, SIGNAL)
    except ProcessLookupError:
        return "(the engine's process is gone)"
    deadline, size = time.monotonic() + WAIT_S, before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path)
        if now > before and now == size:  # written and settled
            break
        size = now
    with open(path) as f:
        f.seek(before)
        text = f.read()
    return _readable(text, int(main, 16), everything) if text else "(the rank did not answer within 3 s)"


def _readable(text: str, main: int, everything: bool) -> str:
    """faulthandler's dump, main thread first, thread ids dropped (so that ranks doing the same
    thing read the same); unless ``everything``, without the engine's machinery: the frames
    below the user's code, and threads that are all machinery (ipykernel, zmq, the metrics sender)."""
    blocks = [b.strip("\n") for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip()) if b.strip()]
    shown, hidden = [], 0
    for block in blocks:
        header = _THREAD_ID.match(block)
        if header is None:
            continue
        frames = [line for line in block[header.end():].splitlines() if line.strip()]
        is_main = int(header.group(2), 16) == main
        if not everything:
            while frames and _MACHINERY.search(frames[-1]):  # outermost first to go: the engine's loop
                frames.pop()
            if not frames and not is_main:
                hidden += 1
                continue
        what = "main thread" if is_main else "thread"
        body = "\n".join(frames) if frames else "  idle: waiting for a cell"
        shown.append((not is_main, f"{what} (most recent call first):\n{body}"))
    text = "\n".join(t for _, t in sorted(shown, key=lambda item: item[0]))
    if hidden:
        text += f"\n(+{hidden} threads of the engine itself: ipykernel, zmq, workbench; --all shows them)"
    return text


def _py_spy(pid: int) -> str:
    done = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=30)
    text = done.stdout if done.returncode == 0 else f"(py-spy failed: {done.stderr.strip().splitlines()[-1:]})"
    lines = [line for line in text.splitlines() if not line.startswith(("Process ", "Python v"))]
    return re.sub(r"Thread (0x[0-9A-Fa-f]+|\d+) ", "Thread ", "\n".join(lines))  # ids differ per rank
