"""No engine, nanny or controller outlives its fleet: stop, kernel exit, kernel crash."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from conftest import Kernel, wait_until_gone

from workbench import Fleet

pytestmark = pytest.mark.fleet  # engines, kernels or installs: the slow tier


def _tree(pid: int) -> list[int]:
    proc = psutil.Process(pid)
    return [pid] + [c.pid for c in proc.children(recursive=True)]


def test_stop_leaves_no_process_and_no_runtime_files():
    fleet = Fleet(n=2, progress=False).start()
    runtime = fleet.runtime_dir
    assert oct(os.stat(runtime).st_mode & 0o777) == "0o700"
    pids = [p for m in fleet.members for p in _tree(m.pid)] + [fleet.processes.cluster.controller.pid]
    assert len(pids) >= 5  # 2 engines, 2 nannies, 1 controller
    template = fleet.processes.template_pid  # the engines fork from the engine template, their nannies from them
    assert all(psutil.Process(m.pid).ppid() == template for m in fleet.members)
    assert oct(os.stat(os.path.join(runtime, "template.sock")).st_mode & 0o777) == "0o600"
    pids.append(template)
    fleet.stop()
    assert wait_until_gone(pids, timeout=10) == []
    assert not os.path.exists(runtime)


def _kernel_with_fleet():
    kernel = Kernel()
    reply, _ = kernel.execute("%load_ext workbench\n%fleet start -n 2")
    assert reply["status"] == "ok"
    reply, messages = kernel.execute(
        "from workbench import current_fleet\n"
        "f = current_fleet()\n"
        "import psutil\n"
        "pids = [m.pid for m in f.members] + [c.pid for m in f.members for c in psutil.Process(m.pid).children()]\n"
        "pids.append(f.processes.cluster.controller.pid)\n"
        "print('PIDS', *pids)"
    )
    text = kernel.text(messages)
    pids = [int(p) for p in text.split("PIDS", 1)[1].split()]
    return kernel, pids


def test_kernel_shutdown_stops_the_fleet():
    kernel, pids = _kernel_with_fleet()
    assert all(psutil.pid_exists(p) for p in pids)
    kernel.shutdown()
    assert wait_until_gone(pids, timeout=20) == []


def test_killed_kernel_leaves_nothing_behind():
    kernel, pids = _kernel_with_fleet()
    os.kill(kernel.pid, signal.SIGKILL)
    assert wait_until_gone(pids, timeout=20) == []
    kernel.kc.stop_channels()
    kernel.km.cleanup_resources()


def test_script_that_exits_without_stopping_leaves_nothing_behind(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "forgot_to_stop.py"
    script.write_text(
        "from workbench import Fleet\n"
        "import psutil\n"
        "f = Fleet(n=2, progress=False).start()\n"
        "pids = [m.pid for m in f.members] + [c.pid for m in f.members for c in psutil.Process(m.pid).children()]\n"
        "print(*pids, f.processes.cluster.controller.pid, flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 5, out.stderr
    assert wait_until_gone(pids, timeout=20) == []


def _new_fleet_processes(before: set[int]) -> list[psutil.Process]:
    from conftest import fleet_processes

    return [p for p in fleet_processes() if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and "workbench.reaper" not in " ".join(p.cmdline())]


def test_owner_killed_while_engines_start_leaves_nothing_behind(tmp_path):
    """SIGKILL of the owner 3.5 s into start(): engines not registered yet are still cleaned up."""
    import subprocess
    import sys
    import time

    from conftest import fleet_processes

    before = {p.pid for p in fleet_processes()}
    script = tmp_path / "slow_start.py"
    script.write_text("from workbench import Fleet\nFleet(n=2, progress=False, wandb=False).start()\n"
                      "import time\ntime.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, str(script)])
    time.sleep(3.5)
    started = _new_fleet_processes(before)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 30
    while _new_fleet_processes(before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _new_fleet_processes(before), [p.cmdline() for p in _new_fleet_processes(before)]
    assert started, "the kill landed while the fleet's processes were starting"


def test_killing_the_reaper_and_then_the_owner_leaves_nothing_behind(tmp_path):
    """Was: 13 processes and the runtime folder left (no second line of defence). Now the engine
    template, whose parent is the owner, cleans up when the owner is gone and the reaper is too."""
    import subprocess
    import sys
    import time

    from conftest import fleet_processes

    before = {p.pid for p in fleet_processes()}
    script = tmp_path / "owner.py"
    script.write_text("from workbench import Fleet\nf = Fleet(n=2, progress=False, wandb=False).start()\n"
                      "print(f.processes.runtime_dir, flush=True)\nimport time\ntime.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    runtime_dir = owner.stdout.readline().strip()
    assert os.path.isdir(runtime_dir)
    started = [p for p in fleet_processes() if p.pid not in before]
    reapers = [p for p in started if "workbench.reaper" in " ".join(p.cmdline())]
    assert len(reapers) == 1 and len(started) >= 5, [" ".join(p.cmdline())[:80] for p in started]
    reapers[0].kill()
    assert wait_until_gone([reapers[0].pid], timeout=5) == []
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [" ".join(p.cmdline())[:80] for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], left
    assert not os.path.exists(runtime_dir)


def test_killed_controller_leaves_no_scheduler_behind():
    fleet = Fleet(n=2, progress=False, wandb=False).start()
    controller = psutil.Process(fleet.processes.cluster.controller.pid)
    schedulers = [c.pid for c in controller.children(recursive=True)]
    controller.kill()
    fleet.stop()
    assert wait_until_gone(schedulers + [m.pid for m in fleet.members], timeout=15) == []
