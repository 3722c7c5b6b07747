"""Run one cell (or function) on a set of ranks and bring the outcome back.

While the ranks run, their output streams live (:mod:`workbench.kernel.output`). If a
rank fails, the others are stopped: peers blocked in a gloo collective are
released by destroying the process group on the ranks that are already idle,
running ranks get SIGINT, and a rank that still does not stop is killed and
replaced. An interrupt (Ctrl-C, Jupyter's stop button) or ``--timeout`` walks
the same ladder starting with SIGINT; so does a hung rank (no heartbeat, or no
progress, for the fleet's ``hang_timeout``: :mod:`workbench.kernel.watchdog`), which
is killed and replaced if SIGINT does not stop it. Ranks left waiting in a
collective after a peer finished the cell are stopped within seconds the same way
(a mismatched collective, also :mod:`workbench.kernel.watchdog`). Afterwards the process group is checked
and rebuilt if it may be inconsistent, so the next cell works.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench import links
from workbench.errors import FleetError, WorkbenchError
from workbench.kernel.notices import debug, notice
from workbench.kernel.output import RankOutput, last_line
from workbench.kernel.pool import PROBE_TIMEOUT_S, QUIET_S
from workbench.kernel.watchdog import HangWatch
from workbench.messages import CellReply
from workbench.rank import rendezvous

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet

POLL_S = 0.1  # streaming refresh and timeout granularity; results wake us at once
FAILURE_GRACE_S = 0.2  # let ranks failing with the same error report together
OUTPUT_WAIT_S = 2.0  # a reply can arrive before the rank's last output (separate zmq streams)
PID_CHECK_S = 0.5  # how often running ranks' processes are checked (local engines)


@dataclass
class RankFailure:
    rank: int
    ename: str
    evalue: str
    traceback: str
    stopped: bool = False  # the rank was stopped by workbench, not the first to fail


@dataclass
class CellResult:
    ranks: list[int]
    replies: dict[int, dict] = field(default_factory=dict)

    def values(self) -> list:
        return [self.replies[r].get("value") for r in self.ranks]

    def display(self, rank: int) -> dict | None:
        reply = self.replies.get(rank)
        return reply.get("display") if reply else None


class CellInterrupted(KeyboardInterrupt):
    """The kernel was interrupted during a cell. IPython shows only the ranks' report (one line a
    group of ranks, and the tracebacks of ranks that failed), not workbench's own frames."""

    def _render_traceback_(self) -> list[str]:
        return [*str(self).splitlines(), "KeyboardInterrupt"]


CellInterrupted.__name__ = CellInterrupted.__qualname__ = "KeyboardInterrupt"  # what notebook tools and users see

class DistributedCellError(WorkbenchError):
    """One or more ranks raised. Each distinct traceback is shown once."""

    def __init__(
        self, failures: list[RankFailure], world: int, notes: list[str], interrupted: bool = False,
        timed_out: float | None = None, dead: list[int] | None = None, hung: list[int] | None = None,
        lost: dict[int, str] | None = None,
    ):
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.dead = dead or []  # ranks whose engine died (and was replaced) during the cell
        self.lost = lost or {}  # rank -> "rank 1 died (engine 3, pid 123, SIGKILL)": the root cause
        self.hung = hung or []  # ranks that hung (stopped, or killed and replaced)
        self.failed_at: float | None = None  # time.time() when the kernel saw the first rank fail
        self.world = world
        self.notes = notes
        self.interrupted = interrupted
        primary = [f for f in self.failures if not f.stopped]
        first = primary or self.failures
        lead = first[0]
        ranks = _ranks([f.rank for f in first if f.traceback == lead.traceback])
        what = f"{lead.ename}: {lead.evalue}"
        if lead.ename == "SystemExit" and not interrupted:  # exit(n) in the cell or its script, as torchrun says it
            super().__init__(f"rank {ranks} of {world} exited with code {lead.evalue}")
            return
        if interrupted:
            what = "interrupted"
        elif timed_out is not None and not primary:
            what = f"timed out after --timeout {timed_out:g} s"
        if self.lost and not interrupted:  # the root cause leads, not a survivor's "Connection closed"
            causes = "; ".join(dict.fromkeys(self.lost.values()))  # a lost host's ranks share one headline
            super().__init__(f"{causes}; the other ranks failed because of it")
            return
        super().__init__(f"{what} (rank {ranks} of {world})")

    def what_was_lost(self) -> str:
        """``rank 1 died (…, SIGKILL)``, ``host hostB lost (…)``, ``rank 2 hung``: the ranks the cell lost."""
        if self.lost:
            return "; ".join(dict.fromkeys(self.lost.values()))
        return f"rank {_ranks(self.dead)} died" if self.dead else f"rank {_ranks(self.hung)} hung"

    def groups(self) -> list[tuple[list[int], RankFailure]]:
        """Distinct tracebacks of the ranks that failed, each with its ranks."""
        grouped: dict[str, list[RankFailure]] = {}
        for failure in self.failures:
            if not failure.stopped:
                grouped.setdefault(failure.traceback, []).append(failure)
        return [([f.rank for f in fs], fs[0]) for fs in grouped.values()]

    def report(self) -> str:
        if self.lost and not self.interrupted:
            return self._lost_report()
        lines = []
        for ranks, failure in self.groups():
            if failure.ename == "SystemExit":
                lines.append(f"── rank {_ranks(ranks)} of {self.world} exited with code {failure.evalue} ──")
            else:
                lines.append(f"── {failure.ename} on rank {_ranks(ranks)} of {self.world} ──")
            lines.append(failure.traceback.rstrip() or f"{failure.ename}: {failure.evalue}")
        stopped = [f for f in self.failures if f.stopped]
        if stopped:
            why = "the interrupt" if self.interrupted else "the failure above" if self.groups() else "the timeout"
            lines.append(f"rank {_ranks([f.rank for f in stopped])} stopped because of {why} "
                         f"({stopped[0].ename}: {last_line(stopped[0].evalue)})")
        lines.extend(self.notes)
        return "\n".join(lines)

    def _lost_report(self) -> str:
        """A rank died: its loss first, each peer's consequent error in one line, then what to do;
        the peers' full tracebacks stay at the end."""
        lines = [f"── {'; '.join(self.lost.values())} ──"]
        followers = [f for f in self.failures if f.rank not in self.lost]
        lines += [f"rank {f.rank}: {f.ename}: {last_line(f.evalue, 160)} (because of it)" for f in followers]
        lines.extend(self.notes)
        traced = [(ranks, f) for ranks, f in self.groups() if f.traceback and not set(ranks) & set(self.lost)]
        if traced:
            lines.append("── full tracebacks of the other ranks ──")
            for ranks, failure in traced:
                lines.append(f"rank {_ranks(ranks)}:")
                lines.append(failure.traceback.rstrip())
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        return self.report().splitlines()


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


class _Stopper:
    """The ladder that ends a cell on every rank: SIGINT, release, kill."""

    def __init__(self, reason: str, now: float) -> None:
        self.reason = reason
        self.at = now
        if reason == "failure":
            self.steps = [(FAILURE_GRACE_S, "release"), (FAILURE_GRACE_S, "sigint"), (3.5, "kill")]
        elif reason == "hang":  # a frozen rank ignores SIGINT: killing it releases its peers
            self.steps = [(0.0, "sigint"), (1.0, "release"), (2.0, "kill-hung"), (6.0, "kill")]
        else:  # interrupt or timeout
            self.steps = [(0.0, "sigint"), (1.0, "release"), (5.0, "kill")]
        self.done: list[str] = []

    def due(self, now: float) -> list[str]:
        ready = [action for delay, action in self.steps if now - self.at >= delay and action not in self.done]
        self.done.extend(ready)
        return ready

    def postpone(self, action: str, delay: float) -> None:
        """Take ``action`` again ``delay`` seconds after the start (it was due, and waits for news)."""
        self.steps = [(delay if a == action else d, a) for d, a in self.steps]
        self.done.remove(action)

    def hurry(self) -> None:
        """A second interrupt: go straight to the last step."""
        self.steps = [(0.0, action) for _, action in self.steps]


def _metadata(ar, attr: str):
    """``ar.<attr>`` of a one-engine request, read from its metadata dict: the attribute
    re-parses every date in it (dateutil), which cost more than the empty cell itself."""
    metadata = getattr(ar, "_metadata", None)
    return metadata[0].get(attr) if isinstance(metadata, list) and len(metadata) == 1 else getattr(ar, attr)


def _stream_text(ar, attr: str) -> str:
    value = _metadata(ar, attr)
    if isinstance(value, list):
        value = "".join(value)
    return value or ""


def run_on_ranks(fleet: Fleet, ranks: list[int], function, args: tuple, *, timeout=None, show_output=True,
                 title: str | None = None, all_progress: bool = False) -> CellResult:
    """Apply ``function(*args)`` on every rank in ``ranks`` and collect the replies.

    ``title``: keep each rank's output in the run's ``logs/rank-<N>.log`` under this header.
    ``all_progress``: show every rank's progress bars (else the first rank's only).

    Raises :class:`DistributedCellError` if any rank failed, and
    ``KeyboardInterrupt`` after an interrupt (once every rank has stopped). ``Fleet.stop()``
    from another thread stops the ranks the same way, then this raises a one-line FleetError.
    """
    with fleet.cell_running():
        return _CellRun(fleet, ranks, timeout, show_output, all_progress).run(function, args, title)


class _CellRun:
    """One cell on a set of ranks: submitted, watched until every rank answered (stopping them
    all when one fails, hangs, is lost, or the user interrupts), then its outcome reported."""

    def __init__(self, fleet: Fleet, ranks: list[int], timeout: float | None, show_output: bool,
                 all_progress: bool) -> None:
        self.fleet, self.ranks, self.timeout = fleet, ranks, timeout
        self.output = RankOutput(ranks, all_progress=all_progress) if show_output else None
        self.show_output = show_output
        self.hang_watch = HangWatch(fleet, ranks, fleet.options.hang_timeout or None)
        self.hangs: list = []
        self.result = CellResult(ranks)
        self.failures: list[RankFailure] = []
        self.stopper: _Stopper | None = None
        self.failed_at: float | None = None  # wall time of the first failure (the report's timeline)
        self.released = self.killed = self.interrupted = self.timed_out = False
        self.shown_outputs = 0  # rich outputs of the first rank displayed so far
        self.pending: dict = {}  # rank -> its request, until it answered
        self.submitted: dict = {}  # rank -> its request (their output stays)

    def run(self, function, args: tuple, title: str | None) -> CellResult:
        fleet = self.fleet
        self.started = self.last_health_check = time.monotonic()
        self.watch = fleet.metrics.watch(self.show_output)  # before submitting: records can arrive at once
        self.pending = {r: fleet.pool.view(fleet.member(r).engine_id).apply_async(function, *args)
                        for r in self.ranks}
        self.submitted = dict(self.pending)
        while self.pending:
            try:
                self._wait_a_moment()
            except KeyboardInterrupt:
                self.interrupted = True
                if self.stopper is None or self.stopper.reason == "failure":
                    self.stopper = _Stopper("interrupt", time.monotonic())
                else:
                    self.stopper.hurry()
        if fleet.stop_requested.is_set():
            raise FleetError("the fleet was stopped from another thread while this cell ran (Fleet.stop()); "
                             "every rank was stopped")
        self._keep_output(title)
        return self._outcome()

    # ------------------------------------------------------------------ while the ranks run
    def _wait_a_moment(self) -> None:
        concurrent.futures.wait(list(self.pending.values()), timeout=POLL_S,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        self._take_replies(now)
        if now - self.last_health_check >= PID_CHECK_S:  # ranks that can never answer
            self.last_health_check = now
            self._take_gone_ranks(now)
            if self._take_lost_hosts():
                return
        self._check_for_a_stop(now)
        self._refresh()
        if self.stopper is not None and self.pending:
            self._climb_the_ladder(now)

    def _fail(self, now: float) -> None:
        """A rank failed: the others are stopped (the first failure starts the ladder)."""
        if self.stopper is None:
            self.stopper, self.failed_at = _Stopper("failure", now), time.time()

    def _answer(self, rank: int, reply: CellReply) -> None:
        self.result.replies[rank] = reply
        self.pending.pop(rank, None)

    def _never_answers(self, failure: RankFailure) -> None:
        """A rank that will not answer (gone, on a lost host, killed): ``failure`` is its error,
        and its reply says the same."""
        self.failures.append(failure)
        self._answer(failure.rank, CellReply(ok=False, ename=failure.ename, evalue=failure.evalue, traceback=""))

    def _take_replies(self, now: float) -> None:
        for rank, ar in list(self.pending.items()):
            if not ar.ready():
                continue
            reply = _reply(ar)
            self._answer(rank, reply)
            if not reply["ok"]:
                late = self.stopper is not None and any(a in self.stopper.done for a in ("release", "sigint"))
                self.failures.append(RankFailure(rank, reply["ename"], reply["evalue"], reply["traceback"], late))
                self._fail(now)

    def _take_gone_ranks(self, now: float) -> None:
        """A dead engine whose nanny died too never answers."""
        for rank in self.fleet.pool.gone_ranks(sorted(self.pending)):
            self._never_answers(RankFailure(rank, "EngineError", "the engine's process is gone", ""))
            self._fail(now)

    def _take_lost_hosts(self) -> bool:
        """A host that died or is cut off: the cell ends now on every rank (True)."""
        fleet = self.fleet
        if fleet.metrics is None or not (lost_now := fleet.pool.lost_hosts_now(fleet.metrics.store, time.time())):
            return False
        for host in lost_now:  # the others' collectives with it end now, their state kept
            links.order_cut(fleet.run_dir, host, links.addresses_of(host))
        for rank in sorted(self.pending):
            if (headline := lost_now.get(fleet.member(rank).host)) is not None:
                failure = RankFailure(rank, "HostLost", headline, "")
            else:  # in a collective with the lost ranks: it ends the cell by itself, state kept
                failure = RankFailure(rank, "Abandoned", "left waiting for the lost host", "", stopped=True)
            self._never_answers(failure)
        self.failed_at = self.failed_at or time.time()
        return True

    def _check_for_a_stop(self, now: float) -> None:
        """Fleet.stop() from another thread, --timeout, a mismatched collective, a hung rank."""
        if self.stopper is not None:
            return
        if self.fleet.stop_requested.is_set():
            self.interrupted, self.stopper = True, _Stopper("interrupt", now)
        elif self.timeout is not None and now - self.started > self.timeout:
            self.timed_out, self.stopper = True, _Stopper("timeout", now)
        elif self.pending:
            finished = sorted(r for r, reply in self.result.replies.items() if reply["ok"])
            if hangs := self.hang_watch.mismatched(self.pending, finished):
                self.hangs = hangs
                self._fail(now)  # releasing the finished ranks ends the collective
            elif hangs := self.hang_watch.check(self.pending):
                self.hangs, self.stopper, self.failed_at = hangs, _Stopper("hang", now), time.time()

    def _climb_the_ladder(self, now: float) -> None:
        fleet, pending = self.fleet, self.pending
        for action in self.stopper.due(now):
            self.released |= self._act(action, pending) == "released"
            if action == "kill-hung" and (stuck := _worst([h for h in self.hangs if h.rank in pending])):
                self._kill(stuck)
            if action == "kill" and pending:
                quiet = [r for r in pending if fleet.pool.quiet(r, fleet.metrics.store, time.time())
                         and now - self.stopper.at < 3 * QUIET_S + PROBE_TIMEOUT_S]
                if quiet:
                    self.stopper.postpone("kill", now - self.stopper.at + 0.5)  # its host may be lost: wait to know
                if doomed := sorted(r for r in pending if r not in quiet):
                    self._kill(doomed)

    def _kill(self, stuck: list[int]) -> None:
        self.killed = True
        for rank in stuck:
            self._never_answers(RankFailure(rank, "Killed", "did not stop within a few seconds; engine replaced",
                                            "", stopped=True))
        self.fleet.replace(stuck)

    def _refresh(self, force: bool = False) -> None:
        self.watch.poll()
        if self.output is None:
            return
        self.output.update({r: (_stream_text(ar, "stdout"), _stream_text(ar, "stderr"))
                            for r, ar in self.submitted.items()}, force=force)
        outs = _metadata(self.submitted[self.ranks[0]], "outputs") or []
        if self.output.live_blocks and len(outs) > self.shown_outputs:
            from IPython.display import display

            for item in outs[self.shown_outputs:]:
                display(item.get("data", {}), raw=True, metadata=item.get("metadata", {}))
            self.shown_outputs = len(outs)

    # ------------------------------------------------------------------ once every rank answered
    def _keep_output(self, title: str | None) -> None:
        """The last output on screen and in the rank logs, the metrics' cell ended, the ranks' notices."""
        fleet, submitted = self.fleet, self.submitted
        logged = title is not None and fleet.rank_logs is not None
        if self.output is not None or logged:  # the rank logs keep the output even when it is not shown
            _wait_for_output(submitted, self.result.replies)
        self._refresh(force=True)
        if logged:
            fleet.rank_logs.cell(title, {r: (_stream_text(ar, "stdout"), _stream_text(ar, "stderr"))
                                         for r, ar in submitted.items()})
        self.watch.finish(self.result.replies)
        for text in sorted({n for reply in self.result.replies.values() for n in reply.get("notices", ())}):
            notice(text)

    def _outcome(self) -> CellResult:
        """The result, or the error that names what went wrong (after the group was repaired)."""
        fleet, failures, hangs = self.fleet, self.failures, self.hangs
        frozen = any(h.frozen for h in hangs)
        for hang in hangs:  # the hang is the rank's error, whatever stopping it raised there
            failures = [f for f in failures if f.rank != hang.rank]
            # with a frozen rank, the others only waited for it
            failures.append(RankFailure(hang.rank, hang.ename, hang.why, hang.text(),
                                        stopped=frozen and not hang.frozen))
        replies = self.result.replies
        torn_down = sorted(r for r, reply in replies.items() if reply.get("group_intact") is False)
        lost: dict[int, str] = {}
        notes, dead = self._repair(bool(failures) or self.interrupted or self.timed_out or bool(torn_down),
                              self.released or self.killed or bool(torn_down), self.killed, lost)
        if torn_down and not failures:
            notice(f"the cell tore down the default process group on rank {_ranks(torn_down)} "
                   "(destroy_process_group or its own init_process_group); it was rebuilt for the next cell — "
                   "objects prepared before are bound to the old group: prepare them again")
        if self.timed_out:
            notes.insert(0, f"the cell ran past --timeout {self.timeout:g} s and was stopped on every rank")
        if self.interrupted:
            if not failures:  # every rank handled the interrupt (a loop that catches KeyboardInterrupt)
                notice("interrupted; every rank ended the cell cleanly")
                return self.result
            debug("the cell was interrupted; workbench's own frames (not shown with the report):\n"
                  + "".join(traceback.format_stack()))
            raise CellInterrupted(DistributedCellError(failures, fleet.world_size, notes, interrupted=True).report())
        if failures:
            error = DistributedCellError(failures, fleet.world_size, notes,
                                         timed_out=self.timeout if self.timed_out else None,
                                         dead=dead, hung=[h.rank for h in hangs], lost=lost)
            error.failed_at = self.failed_at
            raise error
        return self.result

    def _act(self, action: str, pending: dict) -> str:
        fleet = self.fleet
        running = sorted(pending)
        if action == "sigint":
            fleet.pool.signal(running, signal.SIGINT)
        elif action == "release":
            idle = [r for r in range(fleet.world_size) if r not in pending and not fleet.pool.on_lost_host(r)]
            if idle:
                # closing the group's sockets on idle ranks releases peers blocked in a collective
                peers = [fleet.member(r).pid for r in running]
                try:  # not waited for: the cell's loop goes on watching (a lost host, the kill step)
                    fleet.client[fleet.engine_ids(idle)].apply_async(rendezvous.leave, peers)
                except Exception:
                    pass  # an idle rank that cannot answer is handled by the kill step
                return "released"
        return action

    def _repair(self, abnormal: bool, torn: bool, killed: bool, lost: dict) -> tuple[list[str], list[int]]:
        """Rebuild the process group if the cell may have left it inconsistent.

        Returns notes for the user and the ranks whose engine had died (now replaced); ``lost``
        gets a headline for each of those.
        """
        if not abnormal:
            return [], []
        fleet = self.fleet
        dead = fleet.pool.dead_ranks()
        losses = {r: fleet.pool.loss(r) for r in dead}  # (headline, explanation), before the engines are replaced
        causes = {r: explanation for r, (_, explanation) in losses.items()}
        lost.update({r: headline for r, (headline, _) in losses.items()})
        if any(fleet.pool.on_lost_host(r) for r in dead):  # the survivors keep their state for %fleet recover
            hosts = sorted({fleet.member(r).host for r in dead if fleet.pool.on_lost_host(r)})
            return [f"{'; '.join(fleet.pool.lost_hosts[h] for h in hosts)}. The other ranks keep their state: "
                    "%fleet recover --shrink goes on without the lost ranks, %fleet recover puts them on a host with a "
                    "free --hosts slot; other cells are refused until then"], dead
        if dead:
            fleet.replace(dead)
            torn = True
        if not torn:
            checks = fleet.client[fleet.engine_ids()].apply_async(rendezvous.healthy, 3.0)
            try:
                if all(checks.get(timeout=10)):
                    return [], []
            except Exception:
                pass
        try:
            fleet.rendezvous()
        except WorkbenchError as exc:
            return [f"the process group could not be rebuilt ({exc}); restart the fleet: %fleet stop, then %fleet start"], dead
        if fleet.session.fresh_ranks:
            what = ("; ".join(causes.values()) if dead else "a rank that did not stop was killed" if killed
                    else "a rank died while the process group was rebuilt")
            return [f"{what}. It was replaced by a fresh engine with an empty namespace: run %fleet recover next "
                    "(rebuilds the group, replays the --setup cells and gives every rank a survivor's state or the "
                    "latest checkpoint, so all ranks agree); other cells are refused until then"], dead
        notes = ["the process group was rebuilt; models and optimizers prepared before are bound to the old "
                 "group: run the cell that calls accelerator.prepare again"]
        if dead or killed:  # every rank was replaced: they all start from empty namespaces
            notes = ["every rank was replaced by a fresh engine (empty namespaces; "
                     + "; ".join(causes.values() or ["ranks that did not stop were killed"])
                     + "): run your setup cells again, or %fleet recover to replay them and restore the latest checkpoint"]
        return notes, dead


def _wait_for_output(submitted: dict, replies: dict) -> None:
    """Wait (briefly) for the output of every rank that answered; a killed or dead one sends none."""
    deadline = time.monotonic() + OUTPUT_WAIT_S
    for rank, ar in submitted.items():
        if ar.ready() and replies.get(rank, {}).get("ename") not in ("EngineError", "Killed"):
            ar.wait_for_output(max(0.0, deadline - time.monotonic()))


def _reply(ar) -> CellReply:
    try:
        return ar.get()
    except Exception as exc:  # the engine died or could not run the request at all
        ename = getattr(exc, "ename", type(exc).__name__)
        evalue = getattr(exc, "evalue", str(exc))
        return CellReply(ok=False, ename=ename, evalue=evalue, traceback=f"{ename}: {evalue}")


def _worst(hangs) -> list[int]:
    """The hung ranks to kill first: the frozen ones if any (their peers wait on them)."""
    frozen = [h.rank for h in hangs if h.frozen]
    return frozen or [h.rank for h in hangs]
