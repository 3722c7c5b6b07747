"""Engine side: the process that writes a rank's async checkpoints to disk.

An async save is planned by DCP in a background thread of the rank (its collectives use the
rank's process group), but the bytes are written by a helper process of the rank: started at
the first async save, at the lowest CPU priority (nice 19 and, on Linux, SCHED_IDLE), it
reads the staged copy from shared memory and returns DCP's write results. So the write never
holds the rank's GIL (a writer thread serialises under it, and at low priority it may not be
scheduled to hand it back), and an OS priority applies to it as a whole. Unlike DCP's own
process executor, the helper joins no process group (nothing listens on a TCP port), so a
rescale or a recovery needs nothing from it.

Measured on the 2-core CI box, where the ranks keep both cores busy: training still runs at
about 0.6-0.65 of its normal steps/s while a 192 MB write runs, as with a thread. The loss
comes from the writing itself (a helper that receives the data and writes nothing costs
nothing; one that serialises to /dev/null costs most of it), whatever its priority: on this
machine one core's work slows the other. On a GPU node the CPU cores are mostly idle while
the GPUs train, which is what the helper's priority is for.

The helper ends with the rank: killed by the kernel when the thread that started it (the
rank's main thread) ends, and it exits when its socket closes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter  # DCP's own fsspec writer
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.futures import Future

from workbench.rank_state import STATE, die_with_parent


def start() -> None:
    """Start this rank's helper process unless it runs (from the rank's main thread: the
    helper is killed when the thread that started it ends)."""
    if STATE.writer is None or not STATE.writer.alive():
        STATE.writer = WriterProcess()


class _NoFolders(FileSystem):
    """fsspec without folders: an object store has none (and s3fs makes a missing bucket for one)."""

    def mkdir(self, path) -> None:
        pass


class ObjectStoreWriter(FsspecWriter):
    """DCP's fsspec writer for an object store (S3 and the like): it makes no folders."""

    def __init__(self, path, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _NoFolders()
        self.path = self.fs.init_path(path)


class HelperWrites:
    """A DCP storage writer whose ``write_data`` runs in this rank's helper process."""

    def write_data(self, plan, planner) -> Future:
        future: Future = Future()  # torch's, as DCP waits on it
        try:
            if STATE.writer is None:
                raise RuntimeError("the checkpoint writer process was not started")
            future.set_result(STATE.writer.write(self, plan, planner))
        except BaseException as exc:  # noqa: BLE001 - DCP reports it as this rank's failure
            future.set_exception(exc)
        return future


class HelperWriter(HelperWrites, FileSystemWriter):
    """Async saves to a local folder."""


class HelperObjectStoreWriter(HelperWrites, ObjectStoreWriter):
    """Async saves to an object store."""


class WriterProcess:
    """One helper process per rank; :meth:`write` runs one DCP ``write_data`` in it.

    Started as a new interpreter, not with ``multiprocessing``'s spawn, which would run the
    rank's ``__main__`` again (a whole training script, under torchrun)."""

    def __init__(self) -> None:
        import multiprocessing
        import multiprocessing.connection

        import torch.multiprocessing  # noqa: F401 - registers the reductions that pass tensors as shared memory

        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import main; main()", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        try:  # at once, before it imports torch (it lowers itself too, for other systems)
            os.setpriority(os.PRIO_PROCESS, self.process.pid, 19)
        except OSError:
            pass
        self._conn = multiprocessing.connection.Connection(ours.detach())
        # shared-memory tensors are handed over by multiprocessing's fd sharer, which asks for this key
        self._conn.send_bytes(bytes(multiprocessing.current_process().authkey))
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self.process.poll() is None

    def write(self, storage_writer, plan, planner) -> list:
        """``FileSystemWriter.write_data(plan, planner)`` done by the helper; the data of each
        write item is resolved here (tensors of the staged copy travel as shared memory)."""
        data = {item.index: planner.resolve_data(item) for item in plan.items}
        with self._lock:
            try:
                self._conn.send((storage_writer, plan, data))
                reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise RuntimeError(f"the checkpoint writer process ended (exit code {self.process.poll()}): "
                                   f"{exc}") from None
        if isinstance(reply, BaseException):
            raise reply
        return reply


class _Resolved:
    """The part of a save planner that ``FileSystemWriter.write_data`` uses."""

    def __init__(self, data: dict) -> None:
        self._data = data

    def resolve_data(self, item):
        return self._data[item.index]


def main() -> None:
    """The helper process: ``python -c '...main()' FD PARENT_PID``."""
    import multiprocessing
    import multiprocessing.connection

    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    die_with_parent(parent_pid)
    conn = multiprocessing.connection.Connection(fd)
    multiprocessing.current_process().authkey = conn.recv_bytes()
    _serve(conn)


def _serve(conn) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # Linux: runs only on idle cores
    except (OSError, AttributeError):
        pass
    import torch.multiprocessing  # noqa: F401 - so that shared-memory tensors unpickle

    while True:
        try:
            storage_writer, plan, data = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = _FileSystemWriter.write_data(storage_writer, plan, _Resolved(data)).wait()
        except BaseException as exc:  # noqa: BLE001 - sent back to the rank, which reports it
            reply = OSError(exc.errno, exc.strerror) if isinstance(exc, OSError) and exc.errno else \
                RuntimeError(f"{type(exc).__name__}: {exc}")
        del data
        try:
            conn.send(reply)
        except OSError:
            return

