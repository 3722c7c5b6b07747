"""The processes behind a fleet's engines: the ipyparallel controller, the engine template
local engines fork from, the reaper that kills everything if the kernel dies, and how an
engine's process ended. Kernel side; :class:`workbench.kernel.pool.EnginePool` launches engines
through it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from workbench.errors import OptionsError
from workbench.kernel.launchers import LauncherSpec
from workbench.kernel.notices import notice
from workbench.kernel.output import ProgressLine, last_line
from workbench.launcher_kinds import LOCAL, launcher_names
from workbench.rank import template
from workbench.reaper import kill_all, write_pids

# The hub pings engines every HUB_HEARTBEAT_PERIOD_MS; a new engine counts as registered at the first
# ping it answers, one or two periods after it started (ipyparallel's 3 s period made every new engine wait
# up to 6 s for that; 500 ms cost 0.5-1 s of every rescale; a ping is a few bytes, answered in C). The hub
# unregisters an engine silent for HUB_HEARTBEAT_MISSES periods, 120 s (ipyparallel's 30 s
# unregistered live engines of a 2-core machine at load 18); a local engine counts as dead only
# once its process is gone, so this bounds how long a silent engine on another host takes
HUB_HEARTBEAT_PERIOD_MS = 100
HUB_SILENT_S = 120
HUB_HEARTBEAT_MISSES = HUB_SILENT_S * 1000 // HUB_HEARTBEAT_PERIOD_MS
CONTROLLER_TIMEOUT_S = 5.0  # a status query the controller does not answer in this long fails
EXIT_STATUS_WAIT_S = 0.5  # how long a death report waits for the launcher to say how the engine ended


class Processes:
    """The controller (``cluster``), engine template and reaper of one fleet, and its private
    runtime folder (mode 0700: the reaper's pid list, the template's socket, file stores).
    With ``attached`` the controller and engines are a running ipcluster's: never ours to kill."""

    def __init__(self, launcher: LauncherSpec, engine_timeout: float, attached: bool) -> None:
        self.launcher = launcher
        self._theirs: set[str] = set()  # attached: the engine sets the cluster had before this fleet
        self.engine_timeout = engine_timeout
        self.attached = attached
        self.runtime_dir: str | None = None
        self.cluster = None
        self.rank_logs = None  # RankLogs of the run: an engine set's own output is kept there when it stops
        self._template: subprocess.Popen | None = None
        self._reaper: subprocess.Popen | None = None

    @property
    def template_pid(self) -> int | None:
        return self._template.pid if self._template is not None else None

    def make_runtime_dir(self) -> str:
        self.runtime_dir = tempfile.mkdtemp(prefix="workbench-", dir=_socket_friendly_tmp())  # mode 0700
        return self.runtime_dir

    def start_controller(self, progress: ProgressLine, started: float) -> None:
        """Start the controller, the reaper and (local engines) the engine template."""
        import ipyparallel as ipp

        kwargs = self.launcher.cluster_kwargs()
        kwargs["controller_args"] = [*kwargs.get("controller_args", ()),
                                     f"--HeartMonitor.period={HUB_HEARTBEAT_PERIOD_MS}",
                                     f"--HeartMonitor.max_heartmonitor_misses={HUB_HEARTBEAT_MISSES}"]
        self.cluster = ipp.Cluster(
            profile_dir=os.path.join(self.runtime_dir, "profile"),
            log_level=logging.ERROR,  # start-up failures are reported by us
            engine_timeout=self.engine_timeout,
            **kwargs,
        )
        self.launcher.configure(self.cluster)
        self.cluster.start_controller_sync()
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "workbench.reaper", str(os.getpid()), self.runtime_dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if self.launcher.local:
            self._template = subprocess.Popen(
                [sys.executable, "-m", "workbench.rank.template", self.runtime_dir],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True,  # a kernel interrupt (SIGINT to the kernel's group) must not reach it
            )
        self.record_pids([])
        if self._template is not None:
            self._wait_for_template(progress, started)

    def _wait_for_template(self, progress: ProgressLine, started: float) -> None:
        """Wait until the template can fork engines; if it failed, say why (engines start cold)."""
        path = template.socket_path(self.runtime_dir)
        deadline = time.monotonic() + self.engine_timeout
        while not os.path.exists(path) and self._template.poll() is None and time.monotonic() < deadline:
            progress.show(f"fleet: importing torch ({time.monotonic() - started:.0f} s)…",
                          key=int(time.monotonic() - started))
            time.sleep(0.05)
        if not os.path.exists(path):
            error = self._template.stderr.read().decode(errors="replace").strip().splitlines() \
                if self._template.poll() is not None else ["it did not start in time"]
            notice(f"engines start without the engine template ({error[-1] if error else 'no output'})")

    def connect(self, profile: str | None, cluster_id: str | None) -> None:
        """Use the controller of an ipcluster that is already running."""
        import ipyparallel as ipp

        from workbench.errors import FleetError

        try:
            self.cluster = ipp.Cluster.from_file(profile=profile or "default", cluster_id=cluster_id or "")
            self._theirs = set(self.cluster.engines)  # the cluster's own engine sets: never stopped by us
        except Exception as exc:
            raise FleetError(f"no running cluster for profile {profile or 'default'!r} and cluster id "
                             f"{cluster_id or ''!r} ({one_line(exc)}); start one with ipcluster start") from None
        attached = attached_launcher(self.cluster)
        if attached.name == self.launcher.name:  # --launcher NAME and its options: for the engines we add
            self.launcher.configure(self.cluster)
        else:
            self.launcher = attached

    def record_pids(self, engine_pids: list[int]) -> None:
        """Tell the reaper every process of this fleet, also those not registered yet (a start or
        scale half done) and the controller's scheduler children (orphaned if it is killed)."""
        if self.attached or self.runtime_dir is None:
            return  # not ours to kill
        pids = list(engine_pids)
        if self._template is not None:
            pids.append(self._template.pid)
        # the processes the launchers started here, registered or not (ssh's are pids on other hosts)
        engine_sets = self.cluster.engines.values() if self.cluster is not None and not self.launcher.remote else ()
        for engine_set in engine_sets:
            pids += [p for p in (getattr(lc, "pid", None) for lc in getattr(engine_set, "launchers", {}).values())
                     if isinstance(p, int) and p > 0]
        controller = getattr(self.cluster, "controller", None)
        if controller is not None and getattr(controller, "pid", -1) > 0:
            pids.append(controller.pid)
            try:
                pids += [c.pid for c in psutil.Process(controller.pid).children(recursive=True)]
            except psutil.Error:
                pass
        write_pids(self.runtime_dir, pids)

    def engine_log(self, set_id: str, cluster=None) -> str:
        """An engine set's process output (``cluster``: this fleet's, also while it stops)."""
        cluster = cluster if cluster is not None else self.cluster
        engine_set = cluster.engines.get(set_id) if cluster is not None else None
        try:
            return engine_set.get_output() if engine_set else ""
        except Exception:
            return ""

    def forget_engine_set(self, set_id: str, host: str) -> None:
        """An engine set on a lost host: nothing there can be stopped or waited for (ipyparallel's ssh
        launcher would poll it, and fail, at every step); it is dropped from the cluster, and the ssh
        clients this process still has open to ``host`` (cut off, they would hang for hours) end."""
        engine_set = self.cluster.engines.pop(set_id, None) if self.cluster is not None else None
        for launcher in [engine_set, *getattr(engine_set, "launchers", {}).values()] if engine_set else []:
            stop_waiting = getattr(launcher, "_stop_waiting", None)
            if stop_waiting is not None:
                stop_waiting.set()
        for child in psutil.Process().children(recursive=True):
            try:
                argv = child.cmdline()
                if argv and os.path.basename(argv[0]) in ("ssh", "scp") and host in argv:
                    child.kill()
            except psutil.Error:
                pass

    def stop_engine_set(self, set_id: str) -> None:
        """Stop one engine set, keeping its process's own output in the run's logs/."""
        if self.rank_logs is not None:
            self.rank_logs.engine(set_id, self.engine_log(set_id))
        try:
            self.cluster.stop_engines_sync(set_id)
        except Exception:
            pass

    def stop(self, client, engine_pids: list[int]) -> None:
        """Stop the engines ``engine_pids`` (through ``client`` first: they exit cleanly), the
        controller, template and reaper; nothing is left running. Attached: only let go."""
        cluster, self.cluster = self.cluster, None
        if self.attached:  # the cluster is the user's; only engines this fleet added (scale, recover) go
            for set_id in [s for s in list(cluster.engines) if s not in self._theirs] if cluster else []:
                try:
                    cluster.stop_engines_sync(set_id)
                except Exception:
                    pass
            return
        processes = process_trees(engine_pids)
        if client is not None:
            if not self.launcher.stops_engines:
                try:  # engines that exit by themselves exit cleanly (and quietly); no wait on the controller,
                    client.shutdown(targets="all", hub=False, block=False)  # which may be dead or frozen
                except Exception:
                    pass
                psutil.wait_procs([p for p in processes if p.pid in set(engine_pids)], timeout=5)
            try:
                client.close()
            except Exception:
                pass
        if cluster is not None:
            if self.rank_logs is not None:
                for set_id in list(cluster.engines):
                    self.rank_logs.engine(set_id, self.engine_log(set_id, cluster))
            try:
                cluster.stop_cluster_sync()
            except Exception:
                pass
        if self.runtime_dir:
            kill_all(self.runtime_dir)  # anything that ignored SIGTERM; removes the folder
            self.runtime_dir = None
        _, left = psutil.wait_procs(processes, timeout=5)  # engines' nannies exit after them
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        if self._template is not None:
            self._template.kill()
            self._template.wait()
            self._template = None
        if self._reaper is not None:
            try:
                self._reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None


def exit_status(processes: Processes, engine_set: str, pid: int) -> str | None:
    """How the engine ``pid`` of ``engine_set`` ended, as its launcher saw it (``SIGKILL``, ``exit code 1``)."""
    cluster = processes.cluster
    launcher = cluster.engines.get(engine_set) if cluster is not None else None
    launchers = [launcher, *getattr(launcher, "launchers", {}).values()] if launcher is not None else []

    def exit_code():
        codes = [(getattr(lc, "stop_data", None) or {}).get("exit_code") for lc in launchers]
        codes += [_own_child_exit(getattr(lc, "process", None), pid) for lc in launchers]
        if processes.runtime_dir:  # an engine forked from the engine template: the template reaped it
            codes.append(template.exit_status(processes.runtime_dir, pid))
        return next((c for c in codes if isinstance(c, int)), None)

    deadline = time.monotonic() + EXIT_STATUS_WAIT_S  # its launcher's thread notices the exit by itself
    while launchers and exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    code = exit_code()
    if not isinstance(code, int):
        return None
    try:
        return signal.Signals(-code).name if code < 0 else f"exit code {code}"
    except ValueError:
        return f"exit code {code}"


def _own_child_exit(process, pid: int) -> int | None:
    """The exit code of the launcher's process ``process`` (a ``psutil.Popen``) if it is the
    engine ``pid`` and has ended: read at once, where the launcher notices the exit only once
    the engine's nanny has closed its output too. psutil keeps the code for the launcher."""
    if process is None or getattr(process, "pid", None) != pid:
        return None
    try:
        return None if process.is_running() else process.wait(0)
    except Exception:  # psutil.TimeoutExpired, or reaped elsewhere
        return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_trees(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their children."""
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            pass
    return procs


def resident_memory(local: bool, pid: int) -> str:
    """Resident memory of an engine on this host (``local``), read from outside (another host: unknown)."""
    if not local:
        return "?"
    try:
        rss = psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return "-"
    return f"{rss / 2**20:.0f} MiB"


def one_line(exc: BaseException) -> str:
    """``Name: last line of the message`` of an exception (also of ipyparallel's RemoteError)."""
    text = getattr(exc, "evalue", None) or str(exc)
    name = getattr(exc, "ename", None) or type(exc).__name__
    return f"{name}: {last_line(text, limit=None)}"


UNIX_SOCKET_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less its terminating NUL
LONGEST_SOCKET_NAME = 40  # "/workbench-xxxxxxxx/" + the longest socket file name inside, with room


def _socket_friendly_tmp() -> str:
    """The temporary folder for the runtime folder, whose Unix sockets need short paths: the usual
    one (TMPDIR), else /tmp when TMPDIR is too long (per-job scratch folders on clusters often are)."""
    usual = tempfile.gettempdir()
    if len(usual.encode()) + LONGEST_SOCKET_NAME <= UNIX_SOCKET_PATH_MAX:
        return usual
    for short in ("/tmp", "/dev/shm"):
        if os.path.isdir(short) and os.access(short, os.W_OK | os.X_OK):
            return short
    raise OptionsError(f"the temporary folder {usual} is too long for the fleet's Unix sockets "
                       f"({UNIX_SOCKET_PATH_MAX} bytes at most) and /tmp cannot be written: set TMPDIR to a shorter folder")


def attached_launcher(cluster) -> LauncherSpec:
    """The launcher of a running ipcluster's engines (ssh, slurm, ...): engines this fleet adds to it
    are placed the same way (on a host, in a node's job) as with ``--launcher NAME``."""
    from ipyparallel.cluster.launcher import abbreviate_launcher_class

    name = abbreviate_launcher_class(cluster.engine_launcher_class)
    return LauncherSpec(name if name in launcher_names() else LOCAL)
