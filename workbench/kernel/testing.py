"""Fault injection for tests and soak benchmarks: hold checkpoint writes, kill a rank mid-save."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from workbench.checkpoint import layout

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet

_GATE_WRITES = """
import os, time
import torch.distributed.checkpoint.filesystem as _fs
import workbench.checkpoint.writer as _helper
for _cls in (_fs.FileSystemWriter, _helper.HelperWrites):  # sync saves, async saves
    if "_workbench_gate" not in vars(_cls):
        def _gated(self, plan, planner, _gate={gate!r}, _original=_cls.write_data):
            while not os.path.exists(_gate):
                time.sleep(0.01)
            return _original(self, plan, planner)
        _cls._workbench_gate = _cls.write_data
        _cls.write_data = _gated
"""
_UNGATE_WRITES = """
import torch.distributed.checkpoint.filesystem as _fs
import workbench.checkpoint.writer as _helper
for _cls in (_fs.FileSystemWriter, _helper.HelperWrites):
    if "_workbench_gate" in vars(_cls):
        _cls.write_data = _cls._workbench_gate
        del _cls._workbench_gate
"""


def gate_checkpoint_writes(fleet: Fleet, gate: str) -> None:
    """Make DCP's write step wait on every rank until the file ``gate`` exists."""
    fleet.run(_GATE_WRITES.format(gate=str(gate)), show_output=False)


def ungate_checkpoint_writes(fleet: Fleet) -> None:
    """Undo :func:`gate_checkpoint_writes` on every rank that has it (a replaced rank never did)."""
    survivors = [r for r in range(fleet.world_size) if r not in fleet.session.fresh_ranks]
    fleet.client[fleet.engine_ids(survivors)].execute(_UNGATE_WRITES, block=True)


def kill_rank_during_save(fleet: Fleet, victim: int, gate: str, tag: str | None = None) -> BaseException | None:
    """SIGKILL rank ``victim`` while every rank is inside DCP's write step of a save.

    Returns the error the save raised (None if it did not fail). The writes are
    ungated again on the ranks that survive.
    """
    gate_checkpoint_writes(fleet, gate)
    folder = fleet.checkpoints.folder
    outcome: dict = {}

    def save():
        try:
            fleet.checkpoints.save(tag=tag or f"killed-{time.monotonic_ns()}")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    worker = threading.Thread(target=save)
    worker.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(n.startswith(layout.TMP_PREFIX) for n in os.listdir(folder)):
        time.sleep(0.005)
    time.sleep(0.5)  # every rank is now waiting at the gate, inside write_data
    os.kill(fleet.member(victim).pid, signal.SIGKILL)
    open(gate, "w").close()
    worker.join(60)
    os.remove(gate)
    if worker.is_alive():
        raise RuntimeError("the save hung after a rank was killed")
    ungate_checkpoint_writes(fleet)
    return outcome.get("error")


def interrupted_after(command, delay: float) -> bool:
    """Run ``command`` with a SIGINT to this process (the kernel's main thread: Jupyter's stop
    button) after ``delay`` seconds; True if the interrupt reached it."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        try:
            command()
        finally:
            timer.cancel()
            timer.join()
            time.sleep(0.05)  # a signal sent just before the join is raised here
        return False
    except KeyboardInterrupt:
        return True


class BusyMachine:
    """``n`` processes spinning on the CPU, as on a shared CI runner or a laptop compiling in the
    background; they are killed when the block ends (``with BusyMachine(12): ...``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list = []

    def __enter__(self) -> "BusyMachine":
        import subprocess
        import sys

        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


class LocalS3:
    """An S3-compatible server on 127.0.0.1 (moto's, from PyPI) for tests and benchmarks, with
    the AWS environment pointing at it (inherited by engines started inside the block) and one
    bucket; ``with LocalS3("ckpt") as s3: s3.url("run1")`` is ``s3://ckpt/run1``."""

    ENVIRONMENT = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.process = None
        self._saved_environment: dict = {}

    def url(self, *names: str) -> str:
        return "/".join([f"s3://{self.bucket}", *names])

    def __enter__(self) -> "LocalS3":
        import functools
        import socket
        import subprocess
        import sys

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        from workbench.rank_state import die_with_parent

        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=functools.partial(die_with_parent, os.getpid()))
        self._saved_environment = {key: os.environ.get(key) for key in self.ENVIRONMENT}
        os.environ.update(AWS_ACCESS_KEY_ID="workbench-test", AWS_SECRET_ACCESS_KEY="workbench-test-secret",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        import boto3

        deadline = time.monotonic() + 60
        while True:
            try:
                boto3.client("s3").create_bucket(Bucket=self.bucket)
                return self
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("the local S3 server (moto) did not start") from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        for key, value in self._saved_environment.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        import sys

        from workbench.checkpoint.storage import _filesystem

        _filesystem.cache_clear()  # their clients point at this server
        if "s3fs" in sys.modules:
            sys.modules["s3fs"].S3FileSystem.clear_instance_cache()
