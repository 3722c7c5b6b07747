"""Engine side: where each prepared dataloader is in its data, exactly (exactly-once training data).

A prepared loader's position is the part of its current pass (epoch) that training has
used. It advances when an optimizer step completes (every batch handed to the loop since
the previous step was used by it; with ``--grad-accum K``, at the K-th micro-batch), never
when a batch is fetched, so a live replica's position is that of its last finished step.
A pass left early (a ``break``, an error, an interrupt, a restart) is resumed by the next
iteration from that position, with the same order; a pass that ran to its end starts the next.

Two kinds of loader:

- ``map``: a map-style dataset whose batches accelerate deals out round-robin
  (``BatchSamplerShard``; unsharded on one rank). The position is global: the pass's order
  (the state its shuffle generator had when the pass began) and how many of its batches the
  whole fleet has used. It moves to any world size: the rest of the pass is dealt over the new
  ranks, its tail as the loader's ``drop_last``/``even_batches`` say. Resuming skips indices,
  never loads data.
- ``stream``: everything else (iterable datasets, accelerate's dispatcher). Each rank's position
  is the batches it took from this pass (saved under its own rank's key); resuming reads and
  skips them (accelerate's ``skip_batches``). It moves to another world size only where the
  stream is dealt out by position (accelerate's dispatcher or ``IterableDatasetShard``) and the
  used part divides evenly over the new ranks; otherwise :meth:`DataPosition.refusal` says why.

Positions are saved as one JSON string per loader (no pickle, any shape of generator state).
"""

from __future__ import annotations

import base64
import itertools
import json
import weakref

from workbench.rank_state import STATE


class _Skipped:
    """A batch sampler's batches after the first ``skip`` (indices only: no data is loaded)."""

    def __init__(self, inner, skip: int) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self):
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


_RESUMABLE_CLASSES: dict[type, type] = {}


def _make_resumable(batch_sampler) -> None:
    """Swap the batch sampler's class for a subclass whose next pass skips what
    ``batch_sampler._workbench_skip`` says: ``(local, underlying)``, its own first ``local``
    batches after the first ``underlying`` batches of the sampler it deals out."""
    cls = type(batch_sampler)
    if getattr(cls, "_workbench_resumable", False):
        return
    if cls not in _RESUMABLE_CLASSES:
        def __iter__(self, _original=cls.__iter__):
            local, underlying = self._workbench_skip
            self._workbench_skip = (0, 0)
            if not hasattr(self, "batch_sampler"):  # not sharded (one rank): its batches are the sequence's
                local, underlying = local + underlying, 0
            inner = self.batch_sampler if underlying else None
            if underlying:
                self.batch_sampler = _Skipped(inner, underlying)
            try:
                yield from itertools.islice(_original(self), local, None)
            finally:
                if inner is not None:
                    self.batch_sampler = inner

        _RESUMABLE_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "_workbench_resumable": True, "_workbench_skip": (0, 0),
            "__module__": cls.__module__})
    batch_sampler.__class__ = _RESUMABLE_CLASSES[cls]


def _encode(generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def _decode(text: str):
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


class DataPosition:
    """The position of one prepared loader (``loader._workbench_position``)."""

    def __init__(self, loader, world_size: int) -> None:
        from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
        from torch.utils.data import BatchSampler, IterableDataset

        self.loader = weakref.proxy(loader)
        self.world = world_size  # the world size ``start`` and ``done`` were counted at
        dispatcher = isinstance(loader, DataLoaderDispatcher)
        batch_sampler = getattr(loader, "batch_sampler", None)
        iterable = isinstance(loader.dataset, IterableDataset)
        self.sharded = isinstance(batch_sampler, BatchSamplerShard) and not dispatcher and not iterable
        if self.sharded or (world_size == 1 and isinstance(batch_sampler, BatchSampler)
                            and not dispatcher and not iterable):
            self.kind = "map"
            self.split = bool(getattr(batch_sampler, "split_batches", False))
            self.batch_sampler = batch_sampler
            _make_resumable(batch_sampler)
        else:
            self.kind = "stream"
            self.split = bool(getattr(loader, "split_batches", False))
            self.batch_sampler = None
        # a stream that can move to another world size: one sequence dealt out by position
        self.dealt = dispatcher or isinstance(loader.dataset, IterableDatasetShard)
        self.open = False  # a pass began and has not run to its end
        self.start = 0  # map: underlying batches skipped when the open pass began; stream: rounds skipped
        self.yielded = 0  # batches this rank handed to the loop in the open pass (after the skipped ones)
        self.done = 0  # of those, the ones completed optimizer steps used
        self.pass_generators: list[str] = []  # the shuffle generators' states when the open pass began
        begin = loader.begin

        def begin_pass():  # after accelerate synchronised the generator, before the pass draws from it
            self.pass_generators = [_encode(g) for g in self._generators()]
            begin()

        loader.begin = begin_pass
        STATE.positions.add(self)

    # ------------------------------------------------------------ live
    def _generators(self) -> list:
        found = []
        for generator in (getattr(self.loader, "synchronized_generator", None),
                          getattr(self.loader, "generator", None)):
            if generator is not None and all(generator is not g for g in found):
                found.append(generator)
        return found

    def _per_local(self, world: int) -> int:
        """Batches of the dealt-out sequence behind one batch of one rank."""
        return 1 if self.split else world

    def _total(self) -> int | None:
        if self.kind != "map":
            return None
        inner = getattr(self.batch_sampler, "batch_sampler", self.batch_sampler) if self.sharded else self.batch_sampler
        try:
            return len(inner)
        except TypeError:
            return None

    def consumed(self) -> int:
        """Map: batches of the pass's whole sequence that training has used; stream: this rank's rounds."""
        if self.kind == "map":
            used = self.start + self.done * self._per_local(self.world)
            total = self._total()
            return used if total is None else min(used, total)
        return self.start + self.done

    def _finished(self) -> bool:
        total = self._total()
        return self.kind == "map" and total is not None and self.consumed() >= total

    def iterate(self, batches):
        """Wraps one pass of the loader (accelerate's ``__iter__``)."""
        from workbench.rank_state import STATE

        world = STATE.world_size
        if self.open and self._finished():  # every batch used, the loop just never asked for the end
            self.loader.iteration += 1
            self.open = False
        if self.open:
            self._arm(world)
        else:
            self.open, self.start, self.yielded, self.done, self.world = True, 0, 0, 0, world
        try:
            for batch in batches:
                self.yielded += 1
                if not STATE.positions_at_steps:
                    self.done = self.yielded
                yield batch
            self.open, self.start, self.yielded, self.done = False, 0, 0, 0
        finally:
            if self.kind == "stream":
                self.loader.skip_batches = 0  # set by _arm for this pass only

    def _arm(self, world: int) -> None:
        """The next pass resumes the open one: same order, the used part skipped."""
        for generator, state in zip(self._generators(), self.pass_generators, strict=False):
            generator.set_state(_decode(state))
        if self.kind == "map":
            if world == self.world:  # the same dealing as before: exact, the padded tail included
                self.batch_sampler._workbench_skip = (self.done, self.start)
                self.yielded = self.done
                return
            self.batch_sampler._workbench_skip = (0, self.consumed())
            self.start = self.consumed()
        else:
            if world != self.world:  # refusal() allowed it: the used part divides evenly
                self.start = self.consumed() * self._per_local(self.world) // self._per_local(world)
            else:
                self.start = self.consumed()
            self.loader.skip_batches = self.start
        self.world, self.yielded, self.done = world, 0, 0

    # ------------------------------------------------------------ saved
    def state(self) -> str:
        """What a checkpoint keeps (JSON)."""
        saved = {"kind": self.kind, "dealt": self.dealt, "split": self.split, "world": self.world,
                 "epoch": int(getattr(self.loader, "iteration", 0)), "open": self.open, "start": self.start,
                 "done": self.done, "generators": self.pass_generators}
        if not self.open or self._finished():  # the next pass is a new epoch, drawn from the generators as they are
            saved.update(open=False, start=0, done=0, generators=[_encode(g) for g in self._generators()])
            saved["epoch"] += int(self.open)
        return json.dumps(saved)

    def load(self, text: str) -> None:
        """Take a saved position: the next pass resumes it (resharded if the world size changed)."""
        saved = json.loads(text)
        self.loader.iteration = int(saved["epoch"])
        self.open, self.world = bool(saved["open"]), int(saved["world"])
        self.start, self.done = int(saved["start"]), int(saved["done"])
        self.yielded = self.done
        self.pass_generators = list(saved["generators"])
        if not self.open:
            for generator, state in zip(self._generators(), self.pass_generators, strict=False):
                generator.set_state(_decode(state))


def refusal(name: str, text: str, world: int) -> str | None:
    """Why the saved position ``text`` of loader ``name`` cannot go on at ``world`` ranks, or None."""
    saved = json.loads(text)
    old = int(saved["world"])
    if world == old or saved["kind"] == "map" or not saved["open"]:
        return None
    used = int(saved["start"]) + int(saved["done"])
    if not saved["dealt"]:
        return (f"dataloader {name!r} reads an iterable dataset that each rank reads its own part of, "
                f"{used} batches into epoch {saved['epoch']}: it can go on only at {old} ranks (or from the start of "
                "an epoch); scale or restore at that size, or use a map-style dataset")
    per_local = 1 if saved["split"] else old
    sequence = used * per_local
    if saved["split"] or sequence % world == 0:
        return None
    fits = [m for m in range(1, 2 * max(old, world) + 1) if sequence % m == 0 and m != old][:4]
    return (f"dataloader {name!r} has used {sequence} batches of its stream in epoch {saved['epoch']}, which do not "
            f"divide over {world} ranks; it can go on at {', '.join(map(str, [old, *fits]))} ranks "
            "(or from the start of an epoch)")


class _DiesWithItsRank:
    """A DataLoader ``worker_init_fn`` that first ties the worker's life to its rank's: a worker
    outliving a killed rank would keep the rank's process-group sockets open, and the
    survivors would wait in their collective instead of being released."""

    def __init__(self, inner, rank_pid: int) -> None:
        self.inner, self.rank_pid = inner, rank_pid

    def __call__(self, worker_id: int) -> None:
        from workbench.rank_state import die_with_parent

        die_with_parent(self.rank_pid)
        if self.inner is not None:
            self.inner(worker_id)


def track(loader) -> None:
    """Give a prepared loader an exact position, and workers that die with their rank
    (``accelerator.prepare`` calls it)."""
    import os

    from workbench.rank_state import STATE

    _install()
    loader._workbench_position = DataPosition(loader, STATE.world_size)
    base = getattr(loader, "base_dataloader", loader)
    if getattr(base, "num_workers", 0) and not isinstance(base.worker_init_fn, _DiesWithItsRank):
        base.worker_init_fn = _DiesWithItsRank(base.worker_init_fn, os.getpid())


def optimizer_prepared() -> None:
    """From now on positions advance when an optimizer step completes."""
    STATE.positions_at_steps = True


def step_completed() -> None:
    """An optimizer step completed: it used every batch handed out so far."""
    for position in list(STATE.positions):
        position.done = position.yielded


def _install() -> None:
    """Wrap accelerate's prepared loaders' ``__iter__`` once per process: a loader with a
    position (:func:`track`) counts what it hands out and resumes where it stands."""
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    for cls in (DataLoaderShard, DataLoaderDispatcher):
        if getattr(cls.__iter__, "_workbench", False):
            continue

        def __iter__(self, _original=cls.__iter__):
            position = self.__dict__.get("_workbench_position")
            return _original(self) if position is None else position.iterate(_original(self))

        __iter__._workbench = True
        cls.__iter__ = __iter__
