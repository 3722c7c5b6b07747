"""The engine template: new local engines fork from a process that has torch imported.

A cold engine spends most of its start importing torch and accelerate (about 6 s
on a 2-core machine). The fleet starts this template once, in the background,
as ``python -m workbench.rank.template RUNTIME_DIR``; it imports what a rank needs
(:func:`workbench.rank.engine.warm`) and the ipyparallel engine, then waits on a
Unix socket in the fleet's owner-only runtime folder. Each request forks a
child that becomes an ipyparallel engine (its own session, environment,
working folder and log file), so a new engine registers in well under a
second. The template never touches CUDA: a child picks its GPU
(``CUDA_VISIBLE_DEVICES``) before anything initialises it.

The template reaps its children and writes each one's exit status to
``RUNTIME_DIR/exits/PID`` (a negative number is the signal that ended it), so
death reports can still name the signal. It exits when its socket file is
removed or its parent (the kernel) is gone; in that case, if the runtime folder is still
there (the reaper was killed too), it kills the fleet's processes itself.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import pickle
import select
import socket
import sys
import traceback

SOCKET_NAME = "template.sock"
EXITS_DIR = "exits"
POLL_S = 0.05


def socket_path(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, SOCKET_NAME)


def exit_status(runtime_dir: str, pid: int) -> int | None:
    """The exit status of the template's child ``pid`` once it has been reaped (-N: signal N)."""
    try:
        with open(os.path.join(runtime_dir, EXITS_DIR, str(pid))) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _preload() -> None:
    import ipyparallel.engine.app  # noqa: F401
    import torch

    from workbench.rank import engine

    engine.warm()
    if torch.cuda.is_initialized():  # a fork would inherit a CUDA context it cannot use
        raise RuntimeError("CUDA was initialised while importing; engines cannot fork from this process")
    # what was imported stays out of the children's garbage collections: a collection would
    # touch every inherited object and so copy the whole shared heap into each new engine
    gc.collect()
    gc.freeze()


def _run_engine(request: dict) -> int:
    """In the forked child: become the engine the launcher asked for; returns its exit code."""
    os.setsid()  # as the launcher's Popen(start_new_session=True): the kernel's signals are not ours
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if threads := os.environ.get("OMP_NUM_THREADS"):  # OpenMP read the template's environment at import
        import torch

        torch.set_num_threads(int(threads))
    argv = request["argv"]
    sys.argv = [argv[0], *argv[3:]] if argv[1:3] == ["-m", "ipyparallel.engine"] else argv
    from ipyparallel.engine import app

    app.start_nanny = _prefork_nanny()
    try:
        app.main(sys.argv[1:])
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def _prefork_nanny():
    """Fork the engine's nanny now, while this process has one thread, and return a replacement
    for ipyparallel's ``start_nanny`` that hands it its arguments at registration (ipyparallel
    starts it as a new interpreter then, which costs about a second of imports). Like there,
    the nanny is the engine's child and watches the pipe that carries its address back."""
    args_read, args_write = os.pipe()
    url_read, url_write = os.pipe()
    if os.fork() == 0:  # the nanny
        os.setsid()  # as ipyparallel starts it: signals to the engine's session are not the nanny's
        os.close(args_write)
        os.close(url_read)
        code = 0
        try:
            with os.fdopen(args_read, "rb") as f:
                data = f.read()
            if data:  # empty: the engine ended before it registered
                from ipyparallel.engine.nanny import KernelNanny

                # the arguments come from our own parent over a private pipe, as in ipyparallel's start_nanny
                kwargs = pickle.loads(data)
                KernelNanny.main(**kwargs, pipe=os.fdopen(url_write, "w", buffering=1))
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(args_read)
    os.close(url_write)

    def start_nanny(**kwargs):
        kwargs["pid"] = os.getpid()
        with os.fdopen(args_write, "wb") as f:
            f.write(pickle.dumps(kwargs))
        pipe = os.fdopen(url_read, "r")
        url = pipe.readline().strip()
        if not url:
            raise RuntimeError("nanny failed")
        return url, pipe  # the engine keeps the pipe open for as long as it lives

    return start_nanny


def _fork(request: dict, listener: socket.socket, conn: socket.socket) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        listener.close()
        conn.close()
        code = _run_engine(request)
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(exits_dir: str) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        path = os.path.join(exits_dir, str(pid))
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)


def _serve(listener: socket.socket, path: str, exits_dir: str, parent: int) -> None:
    while os.path.exists(path) and os.getppid() == parent:
        _reap(exits_dir)
        readable, _, _ = select.select([listener], [], [], POLL_S)
        if not readable:
            continue
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            try:
                request = json.loads(conn.makefile("r").readline())
                reply = {"pid": _fork(request, listener, conn)}
            except Exception as exc:  # a bad request is answered, the template stays
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            conn.sendall((json.dumps(reply) + "\n").encode())


def main(runtime_dir: str) -> None:
    parent = os.getppid()
    _preload()
    exits_dir = os.path.join(runtime_dir, EXITS_DIR)
    os.makedirs(exits_dir, mode=0o700, exist_ok=True)
    path = socket_path(runtime_dir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket file: owner only
    try:
        listener.bind(path + ".tmp")
    finally:
        os.umask(old_umask)
    listener.listen(16)
    os.replace(path + ".tmp", path)  # appears only once the template can fork
    try:
        _serve(listener, path, exits_dir, parent)
    finally:
        listener.close()
    if os.getppid() != parent and os.path.isdir(runtime_dir):
        # the kernel died and the reaper did not clean up (it was killed too): the second line
        from workbench.reaper import kill_all

        kill_all(runtime_dir)


if __name__ == "__main__":
    main(sys.argv[1])
