"""Shared fixtures: one real 2-rank fleet for the Python-API tests, one real
Jupyter kernel (with its own fleet) for the magic tests."""

from __future__ import annotations

import os
import queue
import socket
import tempfile
import time
import urllib.error
import urllib.request

import psutil
import pytest

from workbench import Fleet

# run folders (metrics, checkpoints, wandb) of every fleet the tests start, kernels' included
os.environ.setdefault("WORKBENCH_RUNS_DIR", tempfile.mkdtemp(prefix="workbench-test-runs-"))
# every process this test session starts inherits it (kernels, servers, launchers, their engines): the
# leftover checks count those only, not another session's fleet on the same machine
SESSION = os.environ.setdefault("WORKBENCH_TEST_SESSION", f"{os.getpid()}-{time.time_ns()}")
# fixtures that start engines, a kernel, a server, a browser or simulated hosts: a test using one is in
# the slow tier (marked ``fleet``); a test that starts one itself carries @pytest.mark.fleet
SLOW_FIXTURES = {"fleet", "kernel", "elastic", "three_ranks", "four", "hosts", "slurm_conf", "lab", "page",
                 "trained_run", "server", "ipcluster", "slurm", "s3", "s3_fleet", "panel", "torchrun_reference",
                 "tuned_fleet", "shared_fleet"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.fleet)


@pytest.fixture(autouse=True)
def _the_fast_tier_starts_no_fleet(request, monkeypatch):
    """A test not marked ``fleet`` that starts a fleet's processes fails, naming the marker it lacks
    (one refused before anything starts is fast, and stays in the fast tier)."""
    if request.node.get_closest_marker("fleet") is None:
        from workbench.kernel.processes import Processes

        def refuse(self, *args, **kwargs):
            raise AssertionError("this test starts a fleet: mark it @pytest.mark.fleet (the slow tier)")

        monkeypatch.setattr(Processes, "start_controller", refuse)
        monkeypatch.setattr(Processes, "connect", refuse)

IPP_MARKERS = ("ipyparallel", "ipengine", "ipcontroller", "workbench.reaper", "workbench.rank.template",
               "workbench.checkpoint.writer")


def fleet_processes() -> list[psutil.Process]:
    """Every engine, nanny, controller or reaper process this test session started."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if any(m in cmd for m in IPP_MARKERS) and proc.pid != os.getpid() and started_here(proc):
            found.append(proc)
    return found


def started_here(proc: psutil.Process) -> bool:
    """``proc`` was started by this test session (it carries its WORKBENCH_TEST_SESSION)."""
    try:
        return proc.environ().get("WORKBENCH_TEST_SESSION") == SESSION
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_jupyter(url: str, token: str, proc, log_text, timeout: float = 90) -> None:
    """Until the Jupyter server ``proc`` at ``url`` answers; fail with its log if it exits or hangs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None and time.monotonic() < deadline, log_text()[-3000:]
            time.sleep(0.3)


def wait_until_gone(pids, timeout=15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


@pytest.fixture(scope="session")
def fleet():
    f = Fleet(n=2, progress=False).start()
    yield f
    f.stop()


class Kernel:
    """A real IPython kernel driven over its messaging protocol."""

    def __init__(self):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=os.getcwd())
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def execute(self, code: str, timeout: float = 120, interrupt_after: float | None = None):
        """Run ``code``; return (reply content, iopub messages with arrival times)."""
        msg_id = self.kc.execute(code)
        started = time.monotonic()
        messages, reply, interrupted = [], None, False
        while True:
            if interrupt_after is not None and not interrupted and time.monotonic() - started > interrupt_after:
                self.km.interrupt_kernel()
                interrupted = True
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                if time.monotonic() - started > timeout:
                    raise TimeoutError(code) from None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append((time.monotonic() - started, msg))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=timeout)
        return reply["content"], messages

    def text(self, messages) -> str:
        """All text the cell showed: streams, displays (latest state), results, errors."""
        parts = []
        for _, msg in messages:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                parts.append(content["text"])
            elif msg["msg_type"] in ("display_data", "update_display_data", "execute_result"):
                parts.append(content["data"].get("text/plain", ""))
            elif msg["msg_type"] == "error":
                parts.append("\n".join(content["traceback"]))
        return "\n".join(parts)

    def shutdown(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    reply, _ = k.execute("%load_ext workbench")
    assert reply["status"] == "ok"
    yield k
    k.shutdown()
