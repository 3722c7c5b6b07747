"""Rescaling a running fleet: ``fleet.scale(N)`` / ``%fleet scale N``.

The phases (shown with their timings while they run): checkpoint the prepared
state, tear the process group down, add or remove engines (one GPU each on a
GPU box), rendezvous at the new size on a fresh port, replay the recorded
``%%distributed --setup`` cells on every rank, and restore the checkpoint,
resharded. Re-running the training cell then goes on from ``workbench.step``.

Recovery after a death takes the state from a surviving replica where every
survivor holds the whole state (DDP, no wrapping: :mod:`workbench.checkpoint.replica`),
else from the latest checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.checkpoint import api as checkpoint_api
from workbench.checkpoint import replica
from workbench.checkpoint.api import abandon as abandon_saves
from workbench.errors import FleetError, OptionsError
from workbench.kernel.devices import check_machine_fits
from workbench.kernel.notices import notice
from workbench.kernel.output import ProgressLine
from workbench.rank import engine, rendezvous

if TYPE_CHECKING:
    from workbench.kernel.cells import Cells
    from workbench.kernel.fleet import Fleet

MAX_RANKS = 4096  # past this a typo, not a fleet: nothing is built for it
BUSY_WAIT_S = 3.0  # how long an engine may take to answer before an unfinished command's recover replaces it


class Phases:
    """Shows ``what: phase…  done-phase 1.2s …`` while phases run, and keeps their seconds."""

    def __init__(self, progress: bool, what: str) -> None:
        self.progress = ProgressLine(progress)
        self.what = what
        self.timings: dict[str, float] = {}
        self.current: str | None = None  # the phase running (where an interrupt stopped it)

    def run(self, name: str, text: str, fn, *args, **kwargs):
        done = "  ".join(f"{k} {v:.1f}s" for k, v in self.timings.items())
        self.progress.show(f"{self.what}: {text}…  {done}")
        started = time.monotonic()
        self.current = name
        value = fn(*args, **kwargs)
        self.current = None
        self.timings[name] = time.monotonic() - started
        return value

    def done(self, tail: str) -> None:
        total = sum(self.timings.values())
        steps = ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items())
        self.progress.show(f"{self.what}: done in {total:.1f} s ({steps}); {tail}")


@dataclass
class Unfinished:
    """A scale or recover stopped half-way (an interrupt, an error) after it began changing the
    fleet: cells and scales are refused until ``%fleet recover`` finishes it."""

    what: str  # "scale 2→4", "recover"
    world: int  # the world size it was making
    tag: str | None  # the checkpoint holding the state to restore (a scale's, a healthy recover's)
    phases: Phases

    def describe(self) -> str:
        at = f" during its {self.phases.current} phase" if self.phases.current else ""
        source = f" from checkpoint {self.tag!r}" if self.tag else ""
        return (f"%fleet {self.what} was interrupted{at}; run %fleet recover to finish it{source} "
                f"({self.world} ranks)")


def check_scale_size(n) -> None:
    """A one-line error for a size that is not a whole number of ranks >= 1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise OptionsError(f"scale needs a whole number of ranks >= 1 (got {n!r}); e.g. %fleet scale 3")



class Elastic:
    """A fleet's rescale and recovery: the phases above, run on the engine pool, the session
    state and the checkpoints; the setup replay runs its cells through :class:`~workbench.kernel.cells.Cells`."""

    def __init__(self, fleet: Fleet, cells: Cells) -> None:
        self.fleet, self.cells = fleet, cells
        self.pool, self.session, self.checkpoints = fleet.pool, fleet.session, fleet.checkpoints

    def _release_busy(self, phases: Phases) -> list[int]:
        """Ranks still inside a call of the interrupted command (a rendezvous, a save, ...) cannot take
        new work: replace them. Their state is in the command's checkpoint, if it took one."""
        registered = set(self.pool.client.ids)  # an engine whose start was interrupted may not have registered
        waits = {rank: self.pool.client[engine].apply_async(os.getpid)
                 for rank, engine in enumerate(self.pool.engine_ids()) if engine in registered}
        deadline = time.monotonic() + BUSY_WAIT_S
        busy = [rank for rank in range(self.pool.world_size)
                if rank not in waits or not waits[rank].wait(max(0.0, deadline - time.monotonic()))]
        if busy:
            phases.run("engines", f"replacing busy rank {','.join(map(str, busy))}", self.fleet.replace, busy)
        return busy

    def _resize_to(self, world: int) -> None:
        """Add fresh engines or remove the last ranks until the fleet has ``world`` ranks."""
        if world > self.pool.world_size:
            self.pool.add_engines(self.pool.new_slots(world - self.pool.world_size))
        elif world < self.pool.world_size:
            self.pool.remove_ranks(list(range(world, self.pool.world_size)))

    def _keep_live_state(self, lost: set[int]) -> list | None:
        """Survivors set their state aside before the setup replay; returns ``[holds, engine id]``
        pairs: for each state a survivor holds (the whole state, or one shard of hsdp's), the one to
        take it from. None when the survivors cannot give it (sharded without replicas, or none left)."""
        survivors = [r for r in range(self.pool.world_size) if r not in lost]
        if not survivors:
            return None
        ids = self.pool.engine_ids(survivors)
        try:  # a recover that was interrupted after the survivors set their state aside takes that again
            kept = self.pool.client[ids].apply_async(replica.keep, self.session.unfinished is not None).get(timeout=60)
        except Exception:  # a survivor that cannot answer: the checkpoint it is
            kept = [None]
        if all(k and k["replicated"] for k in kept) and len({tuple(k["keys"]) for k in kept}) == 1:
            # a survivor stopped between its all-reduce and its optimizer step is one step behind: of
            # those that hold the same state, the one with the most completed steps holds a whole step
            best: dict[str, tuple[int, int]] = {}
            for engine_id, k in zip(ids, kept, strict=True):
                holds = repr(k["holds"])
                if holds not in best or k["step"] > best[holds][0]:
                    best[holds] = (k["step"], engine_id)
            # every shard has a survivor, all at the same step
            if len(best) == max(k["shards"] for k in kept) and len({step for step, _ in best.values()}) == 1:
                holds_of = {repr(k["holds"]): k["holds"] for k in kept}
                return [[holds_of[h], engine_id] for h, (_, engine_id) in sorted(best.items())]
        self._drop_kept(ids)
        return None

    def _refuse_resize(self, world: int, what: str, ranks: list[int] | None = None) -> None:
        """Refuse, before anything changes, a resize that would lose the data's exact position or
        per-rank state (asks the first of ``ranks``, rank 0 by default: ranks agree on it)."""
        survivor = self.pool.engine_ids(ranks or [0])[:1]
        refused = self.pool.client[survivor].apply_async(checkpoint_api.refusals_at, world).get()[0]
        if refused:
            raise OptionsError(f"{what} (nothing was changed): {refused[0]}")

    def _drop_kept(self, engine_ids: list[int]) -> None:
        try:
            self.pool.client[engine_ids].apply_async(replica.drop)
        except Exception:  # an engine that has died meanwhile kept nothing worth dropping
            pass

    def _live_sources(self, sources: list | None) -> list | None:
        """After the replay: ``sources`` as ``[holds, rank]`` pairs, if every rank now holds a state
        one of them has (hsdp: every shard survived somewhere); else None (the kept state is dropped)."""
        if sources is None:
            return None
        ranks = {m.engine_id: m.rank for m in self.pool.members}
        pairs = [[holds, ranks[engine_id]] for holds, engine_id in sources if engine_id in ranks]
        if len(pairs) != len(sources):
            notice("a rank whose live state was to be sent died during the recovery; restoring the latest checkpoint")
        else:
            needed = self.pool.client[self.pool.engine_ids()].apply_async(replica.holding).get(timeout=60)
            if all(holds in [h for h, _ in pairs] for holds in needed):
                return pairs
            notice("after the setup replay the ranks hold other shards than the survivors kept (the mesh changed); "
                   "restoring the latest checkpoint")
        self._drop_kept(self.pool.engine_ids())
        return None

    def replay_and_restore(self, phases: Phases, tag: str, sources: list | None = None) -> dict:
        def replay():
            with self.session.replay() as setup_cells:
                for code, options in setup_cells:
                    self.cells.execute(code, options, show_output=False)

        phases.run("setup", f"replaying {len(self.session.setup_cells)} setup cell(s)", replay)
        pairs = self._live_sources(sources)
        if pairs is not None:
            ranks = sorted(rank for _, rank in pairs)
            names = f"rank {ranks[0]}'s live state" if len(ranks) == 1 else \
                f"the live shards of ranks {','.join(map(str, ranks))}"
            report = phases.run("restore", f"sending {names} to every rank", self.checkpoints.from_replica, pairs)
            self.session.every_rank_has_state()
            return {"tag": None, "source": ranks[0], "sources": ranks, **report}
        if tag == "latest" and not [e for e in self.checkpoints.list() if e.state == "complete"]:
            # nothing saved yet: every rank starts again from the setup state, survivors included
            self.pool.client[self.pool.engine_ids()].apply_async(engine.set_step, 0).get()
            self.session.every_rank_has_state()
            return {"tag": None, "step": 0, "restored": []}
        report = phases.run("restore", "restoring (resharded)", self.checkpoints.restore, tag)
        self.session.every_rank_has_state()  # a rank replaced on the way (dead before joining) has it too
        return report

    def _teardown(self) -> None:
        """Every rank leaves the process group; background saves the old group broke are set aside."""
        broken = self.pool.client[self.pool.engine_ids()].apply_async(abandon_saves).get()
        for error in sorted({n for errors in broken for n in errors}):
            notice(f"{error} (not used: it was never committed)")
        self.pool.client[self.pool.engine_ids()].apply_async(rendezvous.leave).get()

    def auto_recovery(self, what: str, again: bool = False, replace: list[int] = ()) -> dict | None:
        """With ``--auto-recover`` (or ``replace``: --auto-replace-stragglers) and restarts left: say
        ``what`` happened and return the arguments of the recovery to run (``again``: the caller runs
        the interrupted cell again); else None."""
        max_restarts = self.fleet.options.max_restarts
        if not (self.fleet.options.auto_recover or replace) or (restart := self.session.take_restart(max_restarts)) is None:
            return None
        shrink = self._no_slot_for_lost_ranks()
        without = " without the lost host's ranks (no free slot elsewhere)" if shrink else ""
        notice(f"auto-recover {restart}/{max_restarts}: {what}; recovering{without} (a survivor's "
               f"state or the latest checkpoint){' and running the cell again' if again else ''}")
        return {"shrink": shrink, "replace": () if shrink else list(replace)}

    def _no_slot_for_lost_ranks(self) -> bool:
        """Ranks on a lost host have no free slot on another host: recovering goes on without them."""
        try:
            self.pool.replaceable(self.pool.dead_ranks(settle_s=0.0))
        except OptionsError:
            return True
        return False

    def loss_headlines(self, ranks: list[int]) -> str:
        """One line for the ranks just lost: ``rank 1 of 3 died (engine 4, pid 123, SIGKILL)``; a lost
        host's ranks share one headline. The same words whether the loss was seen between cells or in one."""
        return "; ".join(dict.fromkeys(self.pool.loss(r)[0] for r in ranks))

    def lost_between_cells(self) -> dict | None:
        """The recovery to run (--auto-recover) for engines that died since the last command; None
        when none did. Without --auto-recover, a one-line FleetError that says what to do."""
        dead = self.pool.dead_ranks(settle_s=0.0)
        if not dead:
            return None
        if (how := self.auto_recovery(self.loss_headlines(dead))) is not None:
            return how
        causes = "; ".join(self.pool.loss(r)[1] for r in dead)
        raise FleetError(f"{causes}. Run %fleet recover (replaces it, replays the --setup cells, gives every "
                         "rank a survivor's state or the latest checkpoint)")

    def recover(self, shrink: bool = False, replace: list[int] = ()) -> dict:
        """After an engine died: replace it (or, with ``shrink``, go on without it), rebuild
        the process group, replay the setup cells on every rank, then give every rank the
        survivors' state (DDP: a live replica) or the latest complete checkpoint (resharded).
        After an interrupted scale or recover (``self.session.unfinished``) it finishes that instead:
        busy engines replaced, the fleet brought to the size it was making, its checkpoint restored."""
        self.fleet.targets(None)
        phases = Phases(self.fleet.options.progress, "recover")
        unfinished = self.session.unfinished
        busy = self._release_busy(phases) if unfinished is not None else []
        died = self.pool.dead_ranks(settle_s=0.5)
        dead = sorted(set(died) | set(replace))
        if not shrink:
            self.pool.replaceable(dead)  # a lost host's ranks need a free slot elsewhere: refused first if none
        replaced_before = set(self.session.fresh_ranks) | set(busy)  # fresh engines already, with no state yet
        tag = unfinished.tag if unfinished is not None and unfinished.tag else "latest"
        sources = None if tag != "latest" else self._keep_live_state(set(dead) | replaced_before)
        if sources is None and tag == "latest" and not died and not replaced_before:
            # every rank is alive (a healthy fleet, or stragglers to replace) but the state is sharded:
            # saved first, as a scale does, so that no rank's live state is lost
            try:
                tag = phases.run("checkpoint", "checkpoint", self.checkpoints.save, tag=f"recover-{self.fleet.generation}")
            except Exception as exc:  # e.g. the process group is broken: only a saved state is left
                notice(f"the live sharded state could not be saved first ({exc}); recovering from the latest "
                       "checkpoint")
        lost = sorted(set(dead) | set(self.session.fresh_ranks)) if shrink else []
        if len(lost) >= self.pool.world_size:
            raise OptionsError("no rank would be left: recover without --shrink")
        if lost:
            survivors = [r for r in range(self.pool.world_size) if r not in lost]
            try:
                self._refuse_resize(self.pool.world_size - len(lost), "cannot shrink", survivors)
            except OptionsError:
                self._drop_kept(self.pool.engine_ids(survivors))
                raise
        world = self.pool.world_size - len(lost) if shrink else (unfinished.world if unfinished is not None else
                                                                self.pool.world_size)
        with self.session.changing(Unfinished("recover", world, None if tag == "latest" else tag, phases)):
            if lost:
                phases.run("engines", f"removing rank {','.join(map(str, lost))}", self.pool.remove_ranks, lost)
                dead = lost
            elif dead and not shrink:
                phases.run("engines", f"replacing rank {','.join(map(str, dead))}", self.fleet.replace, dead)
            if world != self.pool.world_size:
                phases.run("engines", f"{self.pool.world_size} → {world} ranks", self._resize_to, world)
            try:
                phases.run("teardown", "process group teardown", self._teardown, )
            except Exception:
                # an engine killed a moment before recover looked (still exiting then) fails the teardown
                late = [] if shrink else self.pool.dead_ranks(settle_s=2.0)
                if not late:
                    raise
                phases.run("engines", f"replacing rank {','.join(map(str, late))}", self.fleet.replace, late)
                dead = sorted(set(dead) | set(late))
                phases.run("teardown", "process group teardown", self._teardown, )
            phases.run("rendezvous", "rendezvous", self.fleet.rendezvous)
            report = self.replay_and_restore(phases, tag, sources)
        if report.get("source") is not None:
            whose = f"rank {report['source']}" if len(report["sources"]) == 1 else \
                f"ranks {','.join(map(str, report['sources']))} (one per shard)"
            tail = (f"restored {', '.join(report['restored'])} from the live state of {whose} "
                    f"at step {report['step']} (no checkpoint needed)")
        elif report["tag"]:
            tail = f"restored {', '.join(report['restored'])} from {report['tag']!r} at step {report['step']}"
        else:
            tail = "no checkpoint yet: every rank starts again from the setup cells, at step 0"
        if unfinished is not None:
            tail = f"finished the interrupted {unfinished.what}: {self.pool.world_size} ranks; {tail}"
        phases.done(tail)
        replaced = dead if shrink else sorted(set(dead) | replaced_before)
        return {"timings": phases.timings, "replaced": replaced, "checkpoint": report["tag"], "step": report["step"],
                "restored": report["restored"], "source": report.get("source"), "sources": report.get("sources")}

    def scale(self, n: int) -> dict:
        """Resize the fleet to ``n`` ranks, keeping training state; returns the phases' seconds
        (:meth:`workbench.kernel.fleet.Fleet.scale` checked ``n`` and recovered lost ranks first)."""
        if fresh := self.session.fresh_ranks:
            raise OptionsError(f"rank {','.join(map(str, fresh))} was replaced and has no state yet; "
                               "run %fleet recover before scaling")
        old = self.pool.world_size
        if n == old:
            raise OptionsError(f"the fleet already has {n} ranks")
        if n > MAX_RANKS:
            raise OptionsError(f"scale takes at most {MAX_RANKS} ranks (got {n})")
        if n > old and self.pool.device_type == "cpu" and self.fleet.options.launcher == "local" and not self.fleet.options.attached:
            check_machine_fits(n - old)  # the new engines' memory, before any is started
        self._refuse_resize(n, f"cannot scale to {n} ranks")
        phases = Phases(self.fleet.options.progress, f"scale {old}→{n}")
        slots = self.pool.new_slots(n - old) if n > old else []
        launched: dict = {}
        try:
            launched = self.pool.launch_cold(slots)  # new engines start while the state is saved
            tag = phases.run("checkpoint", "checkpoint", self.checkpoints.save,
                             tag=f"rescale-{self.fleet.generation}-{old}to{n}")
        except BaseException:
            for set_id in launched:
                self.fleet.processes.stop_engine_set(set_id)
            raise
        with self.session.changing(Unfinished(f"scale {old}→{n}", n, tag, phases)):
            phases.run("teardown", "process group teardown", self._teardown, )
            if n > old:
                phases.run("engines", "adding engines", self.pool.add_engines, slots, launched)
            else:
                phases.run("engines", "removing engines", self.pool.remove_ranks, list(range(n, old)))
            phases.run("rendezvous", "rendezvous", self.fleet.rendezvous)
            report = self.replay_and_restore(phases, tag)
        phases.done(f"restored {', '.join(report['restored']) or 'nothing'} at step {report['step']}")
        timings = phases.timings
        return {"timings": timings, "checkpoint": tag, "restored": report["restored"], "step": report["step"]}
