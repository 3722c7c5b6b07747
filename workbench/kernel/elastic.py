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
from workbench.kernel import cells
from workbench.kernel.devices import check_machine_fits
from workbench.kernel.notices import notice
from workbench.kernel.output import ProgressLine
from workbench.rank import engine, rendezvous

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet

MAX_RANKS = 4096  # past this a typo, not a fleet: nothing is built for it
BUSY_WAIT_S = 3.0  # how long an engine may take to answer before an unfinished command's recover replaces it


class _Phases:
    """Shows ``what: phase…  done-phase 1.2s …`` while phases run, and keeps their seconds."""

    def __init__(self, fleet: Fleet, what: str) -> None:
        self.progress = ProgressLine(fleet.options.progress)
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
    phases: _Phases

    def describe(self) -> str:
        at = f" during its {self.phases.current} phase" if self.phases.current else ""
        source = f" from checkpoint {self.tag!r}" if self.tag else ""
        return (f"%fleet {self.what} was interrupted{at}; run %fleet recover to finish it{source} "
                f"({self.world} ranks)")


def _release_busy(fleet: Fleet, phases: _Phases) -> list[int]:
    """Ranks still inside a call of the interrupted command (a rendezvous, a save, ...) cannot take
    new work: replace them. Their state is in the command's checkpoint, if it took one."""
    registered = set(fleet.client.ids)  # an engine whose start was interrupted may not have registered
    waits = {rank: fleet.client[engine].apply_async(os.getpid)
             for rank, engine in enumerate(fleet.engine_ids()) if engine in registered}
    deadline = time.monotonic() + BUSY_WAIT_S
    busy = [rank for rank in range(fleet.world_size)
            if rank not in waits or not waits[rank].wait(max(0.0, deadline - time.monotonic()))]
    if busy:
        phases.run("engines", f"replacing busy rank {','.join(map(str, busy))}", fleet.replace, busy)
    return busy


def _resize_to(fleet: Fleet, world: int) -> None:
    """Add fresh engines or remove the last ranks until the fleet has ``world`` ranks."""
    if world > fleet.world_size:
        fleet.pool.add_engines(fleet.pool.new_slots(world - fleet.world_size))
    elif world < fleet.world_size:
        fleet.pool.remove_ranks(list(range(world, fleet.world_size)))


def _keep_live_state(fleet: Fleet, lost: set[int]) -> list | None:
    """Survivors set their state aside before the setup replay; returns ``[holds, engine id]``
    pairs: for each state a survivor holds (the whole state, or one shard of hsdp's), the one to
    take it from. None when the survivors cannot give it (sharded without replicas, or none left)."""
    survivors = [r for r in range(fleet.world_size) if r not in lost]
    if not survivors:
        return None
    ids = fleet.engine_ids(survivors)
    try:  # a recover that was interrupted after the survivors set their state aside takes that again
        kept = fleet.client[ids].apply_async(replica.keep, fleet.session.unfinished is not None).get(timeout=60)
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
    _drop_kept(fleet, ids)
    return None


def _refuse_resize(fleet: Fleet, world: int, what: str, ranks: list[int] | None = None) -> None:
    """Refuse, before anything changes, a resize that would lose the data's exact position or
    per-rank state (asks the first of ``ranks``, rank 0 by default: ranks agree on it)."""
    survivor = fleet.engine_ids(ranks or [0])[:1]
    refused = fleet.client[survivor].apply_async(checkpoint_api.refusals_at, world).get()[0]
    if refused:
        raise OptionsError(f"{what} (nothing was changed): {refused[0]}")


def _drop_kept(fleet: Fleet, engine_ids: list[int]) -> None:
    try:
        fleet.client[engine_ids].apply_async(replica.drop)
    except Exception:  # an engine that has died meanwhile kept nothing worth dropping
        pass


def _live_sources(fleet: Fleet, sources: list | None) -> list | None:
    """After the replay: ``sources`` as ``[holds, rank]`` pairs, if every rank now holds a state
    one of them has (hsdp: every shard survived somewhere); else None (the kept state is dropped)."""
    if sources is None:
        return None
    ranks = {m.engine_id: m.rank for m in fleet.members}
    pairs = [[holds, ranks[engine_id]] for holds, engine_id in sources if engine_id in ranks]
    if len(pairs) != len(sources):
        notice("a rank whose live state was to be sent died during the recovery; restoring the latest checkpoint")
    else:
        needed = fleet.client[fleet.engine_ids()].apply_async(replica.holding).get(timeout=60)
        if all(holds in [h for h, _ in pairs] for holds in needed):
            return pairs
        notice("after the setup replay the ranks hold other shards than the survivors kept (the mesh changed); "
               "restoring the latest checkpoint")
    _drop_kept(fleet, fleet.engine_ids())
    return None


def _replay_and_restore(fleet: Fleet, phases: _Phases, tag: str, sources: list | None = None) -> dict:
    def replay():
        with fleet.session.replay() as setup_cells:
            for code, options in setup_cells:
                cells.execute(fleet, code, options, show_output=False)

    phases.run("setup", f"replaying {len(fleet.session.setup_cells)} setup cell(s)", replay)
    pairs = _live_sources(fleet, sources)
    if pairs is not None:
        ranks = sorted(rank for _, rank in pairs)
        names = f"rank {ranks[0]}'s live state" if len(ranks) == 1 else \
            f"the live shards of ranks {','.join(map(str, ranks))}"
        report = phases.run("restore", f"sending {names} to every rank", fleet.checkpoints.from_replica, pairs)
        fleet.session.every_rank_has_state()
        return {"tag": None, "source": ranks[0], "sources": ranks, **report}
    if tag == "latest" and not [e for e in fleet.checkpoints.list() if e.state == "complete"]:
        # nothing saved yet: every rank starts again from the setup state, survivors included
        fleet.client[fleet.engine_ids()].apply_async(engine.set_step, 0).get()
        fleet.session.every_rank_has_state()
        return {"tag": None, "step": 0, "restored": []}
    report = phases.run("restore", "restoring (resharded)", fleet.checkpoints.restore, tag)
    fleet.session.every_rank_has_state()  # a rank replaced on the way (dead before joining) has it too
    return report


def _teardown(fleet: Fleet) -> None:
    """Every rank leaves the process group; background saves the old group broke are set aside."""
    broken = fleet.client[fleet.engine_ids()].apply_async(abandon_saves).get()
    for error in sorted({n for errors in broken for n in errors}):
        notice(f"{error} (not used: it was never committed)")
    fleet.client[fleet.engine_ids()].apply_async(rendezvous.leave).get()


def auto_recovery(fleet: Fleet, what: str, again: bool = False, replace: list[int] = ()) -> dict | None:
    """With ``--auto-recover`` (or ``replace``: --auto-replace-stragglers) and restarts left: say
    ``what`` happened and return the arguments of the recovery to run (``again``: the caller runs
    the interrupted cell again); else None."""
    max_restarts = fleet.options.max_restarts
    if not (fleet.options.auto_recover or replace) or (restart := fleet.session.take_restart(max_restarts)) is None:
        return None
    shrink = _no_slot_for_lost_ranks(fleet)
    without = " without the lost host's ranks (no free slot elsewhere)" if shrink else ""
    notice(f"auto-recover {restart}/{max_restarts}: {what}; recovering{without} (a survivor's "
           f"state or the latest checkpoint){' and running the cell again' if again else ''}")
    return {"shrink": shrink, "replace": () if shrink else list(replace)}


def _no_slot_for_lost_ranks(fleet: Fleet) -> bool:
    """Ranks on a lost host have no free slot on another host: recovering goes on without them."""
    try:
        fleet.pool.replaceable(fleet.pool.dead_ranks(settle_s=0.0))
    except OptionsError:
        return True
    return False


def loss_headlines(fleet: Fleet, ranks: list[int]) -> str:
    """One line for the ranks just lost: ``rank 1 of 3 died (engine 4, pid 123, SIGKILL)``; a lost
    host's ranks share one headline. The same words whether the loss was seen between cells or in one."""
    return "; ".join(dict.fromkeys(fleet.pool.loss(r)[0] for r in ranks))


def lost_between_cells(fleet: Fleet) -> dict | None:
    """The recovery to run (--auto-recover) for engines that died since the last command; None
    when none did. Without --auto-recover, a one-line FleetError that says what to do."""
    dead = fleet.pool.dead_ranks(settle_s=0.0)
    if not dead:
        return None
    if (how := auto_recovery(fleet, loss_headlines(fleet, dead))) is not None:
        return how
    causes = "; ".join(fleet.pool.loss(r)[1] for r in dead)
    raise FleetError(f"{causes}. Run %fleet recover (replaces it, replays the --setup cells, gives every "
                     "rank a survivor's state or the latest checkpoint)")


def recover(fleet: Fleet, shrink: bool = False, replace: list[int] = ()) -> dict:
    """After an engine died: replace it (or, with ``shrink``, go on without it), rebuild
    the process group, replay the setup cells on every rank, then give every rank the
    survivors' state (DDP: a live replica) or the latest complete checkpoint (resharded).
    After an interrupted scale or recover (``fleet.session.unfinished``) it finishes that instead:
    busy engines replaced, the fleet brought to the size it was making, its checkpoint restored."""
    fleet.targets(None)
    phases = _Phases(fleet, "recover")
    unfinished = fleet.session.unfinished
    busy = _release_busy(fleet, phases) if unfinished is not None else []
    died = fleet.pool.dead_ranks(settle_s=0.5)
    dead = sorted(set(died) | set(replace))
    if not shrink:
        fleet.pool.replaceable(dead)  # a lost host's ranks need a free slot elsewhere: refused first if none
    replaced_before = set(fleet.session.fresh_ranks) | set(busy)  # fresh engines already, with no state yet
    tag = unfinished.tag if unfinished is not None and unfinished.tag else "latest"
    sources = None if tag != "latest" else _keep_live_state(fleet, set(dead) | replaced_before)
    if sources is None and tag == "latest" and not died and not replaced_before:
        # every rank is alive (a healthy fleet, or stragglers to replace) but the state is sharded:
        # saved first, as a scale does, so that no rank's live state is lost
        try:
            tag = phases.run("checkpoint", "checkpoint", fleet.checkpoints.save, tag=f"recover-{fleet.generation}")
        except Exception as exc:  # e.g. the process group is broken: only a saved state is left
            notice(f"the live sharded state could not be saved first ({exc}); recovering from the latest "
                   "checkpoint")
    lost = sorted(set(dead) | set(fleet.session.fresh_ranks)) if shrink else []
    if len(lost) >= fleet.world_size:
        raise OptionsError("no rank would be left: recover without --shrink")
    if lost:
        survivors = [r for r in range(fleet.world_size) if r not in lost]
        try:
            _refuse_resize(fleet, fleet.world_size - len(lost), "cannot shrink", survivors)
        except OptionsError:
            _drop_kept(fleet, fleet.engine_ids(survivors))
            raise
    world = fleet.world_size - len(lost) if shrink else (unfinished.world if unfinished is not None else
                                                            fleet.world_size)
    with fleet.session.changing(Unfinished("recover", world, None if tag == "latest" else tag, phases)):
        if lost:
            phases.run("engines", f"removing rank {','.join(map(str, lost))}", fleet.pool.remove_ranks, lost)
            dead = lost
        elif dead and not shrink:
            phases.run("engines", f"replacing rank {','.join(map(str, dead))}", fleet.replace, dead)
        if world != fleet.world_size:
            phases.run("engines", f"{fleet.world_size} → {world} ranks", _resize_to, fleet, world)
        try:
            phases.run("teardown", "process group teardown", _teardown, fleet)
        except Exception:
            # an engine killed a moment before recover looked (still exiting then) fails the teardown
            late = [] if shrink else fleet.pool.dead_ranks(settle_s=2.0)
            if not late:
                raise
            phases.run("engines", f"replacing rank {','.join(map(str, late))}", fleet.replace, late)
            dead = sorted(set(dead) | set(late))
            phases.run("teardown", "process group teardown", _teardown, fleet)
        phases.run("rendezvous", "rendezvous", fleet.rendezvous)
        report = _replay_and_restore(fleet, phases, tag, sources)
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
        tail = f"finished the interrupted {unfinished.what}: {fleet.world_size} ranks; {tail}"
    phases.done(tail)
    replaced = dead if shrink else sorted(set(dead) | replaced_before)
    return {"timings": phases.timings, "replaced": replaced, "checkpoint": report["tag"], "step": report["step"],
            "restored": report["restored"], "source": report.get("source"), "sources": report.get("sources")}


def check_scale_size(n) -> None:
    """A one-line error for a size that is not a whole number of ranks >= 1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise OptionsError(f"scale needs a whole number of ranks >= 1 (got {n!r}); e.g. %fleet scale 3")


def scale(fleet: Fleet, n: int) -> dict:
    """Resize ``fleet`` to ``n`` ranks, keeping training state; returns the phases' seconds
    (:meth:`workbench.kernel.fleet.Fleet.scale` checked ``n`` and recovered lost ranks first)."""
    if fresh := fleet.session.fresh_ranks:
        raise OptionsError(f"rank {','.join(map(str, fresh))} was replaced and has no state yet; "
                           "run %fleet recover before scaling")
    old = fleet.world_size
    if n == old:
        raise OptionsError(f"the fleet already has {n} ranks")
    if n > MAX_RANKS:
        raise OptionsError(f"scale takes at most {MAX_RANKS} ranks (got {n})")
    if n > old and fleet.pool.device_type == "cpu" and fleet.options.launcher == "local" and not fleet.options.attached:
        check_machine_fits(n - old)  # the new engines' memory, before any is started
    _refuse_resize(fleet, n, f"cannot scale to {n} ranks")
    phases = _Phases(fleet, f"scale {old}→{n}")
    slots = fleet.pool.new_slots(n - old) if n > old else []
    launched: dict = {}
    try:
        launched = fleet.pool.launch_cold(slots)  # new engines start while the state is saved
        tag = phases.run("checkpoint", "checkpoint", fleet.checkpoints.save,
                         tag=f"rescale-{fleet.generation}-{old}to{n}")
    except BaseException:
        for set_id in launched:
            fleet.processes.stop_engine_set(set_id)
        raise
    with fleet.session.changing(Unfinished(f"scale {old}→{n}", n, tag, phases)):
        phases.run("teardown", "process group teardown", _teardown, fleet)
        if n > old:
            phases.run("engines", "adding engines", fleet.pool.add_engines, slots, launched)
        else:
            phases.run("engines", "removing engines", fleet.pool.remove_ranks, list(range(n, old)))
        phases.run("rendezvous", "rendezvous", fleet.rendezvous)
        report = _replay_and_restore(fleet, phases, tag)
    phases.done(f"restored {', '.join(report['restored']) or 'nothing'} at step {report['step']}")
    timings = phases.timings
    return {"timings": timings, "checkpoint": tag, "restored": report["restored"], "step": report["step"]}
