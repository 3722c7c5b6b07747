"""Kernel side: park an idle fleet (its engines stopped, their GPUs free) and bring it back.

``%fleet park`` saves what a rescale keeps (prepared and registered objects, the data position,
``workbench.step``) as a checkpoint, stops every engine (the controller and the engine template
stay: no GPU) and remembers the world size. The next cell, ``%fleet unpark`` or a scale starts
that many engines, replays the ``--setup`` cells and restores, with one line saying so.
Names on the ranks that neither a setup cell nor a checkpoint brings back are listed before
parking; ``--park-after`` parks after that long without a command, unless such names exist
(``--park-anyway``). The fleet's device time and idle share: :class:`Usage`.
"""

from __future__ import annotations

import ast
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench.errors import FleetError
from workbench.kernel.notices import notice
from workbench.rank import rendezvous

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet

# names every rank has without a cell making them (IPython's, and the names workbench gives cells)
_GIVEN = {"In", "Out", "exit", "quit", "get_ipython", "accelerator", "rank", "world_size", "local_rank", "device",
          "mesh", "workbench"}


@dataclass
class Parked:
    """A parked fleet: how many ranks it had, the checkpoint that holds its state, since when."""

    world: int
    tag: str
    since: float
    lost_names: list[str]


@dataclass
class Usage:
    """Device time of a run: engine-seconds while ranks were up, and the seconds cells ran."""

    started: float = field(default_factory=time.monotonic)
    engine_seconds: float = 0.0
    busy_seconds: float = 0.0
    _counted_at: float = field(default_factory=time.monotonic)

    def count(self, ranks: int) -> None:
        """Add ``ranks`` engines' time since the last count (call before the number changes)."""
        now = time.monotonic()
        self.engine_seconds += ranks * (now - self._counted_at)
        self._counted_at = now

    def line(self, ranks: int, device: str) -> str:
        self.count(ranks)
        up = time.monotonic() - self.started
        idle = 1.0 - min(1.0, self.busy_seconds / up) if up > 0 else 0.0
        return (f"{device} device-hours so far: {self.engine_seconds / 3600:.3f} "
                f"({self.engine_seconds / 60:.1f} engine-minutes); idle {idle:.0%} of this run's {up / 60:.1f} min")


def names_lost_by_parking(fleet: Fleet) -> list[str]:
    """Names in rank 0's namespace that parking would lose: not made by a ``--setup`` cell, not
    given by workbench or IPython (prepared and registered objects come back from the checkpoint
    only through the setup cells that made them)."""
    from workbench.rank import engine

    setup_cells = fleet.session.setup_cells
    made = set().union(*(_assigned(code) for code, _ in setup_cells)) if setup_cells else set()
    names = fleet.client[fleet.engine_ids([0])].apply_async(engine.user_names).get()[0]
    return sorted(n for n in names if n not in made and n not in _GIVEN and not n.startswith("_"))


def _assigned(code: str) -> set[str]:
    """Top-level names a cell binds (assignments, imports, defs, classes, for targets)."""
    try:
        tree = ast.parse(_without_magics(code))
    except SyntaxError:
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
    return found


def _without_magics(code: str) -> str:
    return "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())


def park(fleet: Fleet, anyway: bool = True) -> Parked:
    """Checkpoint, stop every engine, remember the size (see the module docstring)."""
    if fleet.parked is not None:
        raise FleetError("the fleet is parked already; %fleet unpark (or any cell) brings it back")
    fleet.targets(None)
    fleet.session.refuse_if_unfinished()
    if fleet.session.fresh_ranks:
        raise FleetError("a rank was replaced and has no state yet; run %fleet recover before parking")
    if not fleet.session.setup_cells:
        raise FleetError("parking needs the --setup cells that build the model, optimizer and data (they are "
                         "replayed when it comes back); run them with %%distributed --setup first")
    lost = names_lost_by_parking(fleet)
    if lost and not anyway:
        raise FleetError(f"not parked: rank 0 holds names no setup cell makes ({', '.join(lost[:8])}"
                         f"{', ...' if len(lost) > 8 else ''}); park with --park-anyway to drop them")
    started, world = time.monotonic(), fleet.world_size
    tag = fleet.checkpoints.save(tag=f"park-{fleet.generation}")
    fleet.usage.count(world)
    fleet.client[fleet.engine_ids()].apply_async(rendezvous.leave).get()
    fleet.pool.remove_ranks(list(range(world)))
    fleet.parked = Parked(world, tag, time.time(), lost)
    notice(f"parked {world} ranks in {time.monotonic() - started:.1f} s (state in checkpoint {tag!r}"
           + (f"; not kept: {', '.join(lost)}" if lost else "") + "); the next cell or %fleet unpark brings it back")
    return fleet.parked


def unpark(fleet: Fleet) -> dict:
    """Start the parked fleet's engines, replay the setup cells, restore its checkpoint."""
    from workbench.kernel.elastic import Phases

    parked = fleet.parked
    if parked is None:
        raise FleetError("the fleet is not parked")
    phases = Phases(fleet.options.progress, f"unpark {parked.world} ranks")
    phases.run("engines", "starting engines", fleet.pool.add_engines, fleet.pool.new_slots(parked.world))
    fleet.usage.count(0)
    phases.run("rendezvous", "rendezvous", fleet.rendezvous)
    fleet.parked = None
    report = fleet.elastic.replay_and_restore(phases, parked.tag)
    phases.done(f"restored {', '.join(report['restored']) or 'nothing'} at step {report['step']}")
    notice(f"unparked: {fleet.world_size} ranks back in {sum(phases.timings.values()):.1f} s "
           f"(parked {(time.time() - parked.since) / 60:.1f} min), at step {report['step']}")
    return {"timings": phases.timings, "step": report["step"], "restored": report["restored"]}


class AutoPark:
    """``--park-after S``: a thread that parks the fleet once no command ran for S seconds
    (unless rank 0 holds names parking would lose; ``--park-anyway`` parks regardless)."""

    def __init__(self, fleet: Fleet, after_s: float, anyway: bool) -> None:
        self.fleet, self.after_s, self.anyway = fleet, after_s, anyway
        self.skipped: str | None = None  # why the last idle stretch did not park
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="workbench-autopark", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.after_s / 4)):
            fleet = self.fleet
            idle = time.monotonic() - fleet.last_command_at
            if fleet.parked is not None or not fleet.running or idle < self.after_s or self.skipped:
                continue
            with fleet.command_lock:  # waits out a running command; the fleet may be stopping meanwhile
                if (self._stop.is_set() or not fleet.running or fleet.parked is not None
                        or time.monotonic() - fleet.last_command_at < self.after_s):
                    continue
                try:
                    park(fleet, anyway=self.anyway)
                except Exception as exc:  # noqa: BLE001 - auto-park never breaks the fleet; it says why once
                    self.skipped = str(exc)
                    notice(f"auto-park skipped: {exc}")

    def active(self) -> None:
        """A command ran: the idle time starts again (and a skipped park may be tried again)."""
        self.skipped = None

    def close(self) -> None:
        self._stop.set()
