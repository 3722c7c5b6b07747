"""Engine side: ``workbench.checkpoint.save / restore / maybe_save / register``.

Every rank calls these together (they are collective). Saving goes through
``torch.distributed.checkpoint`` on a gloo group of its own, so an async save
can write in the background while training uses the default group.

An async save stays off the training loop's critical path twice over (torchtitan's
"zero-overhead" recipe): the copy of parameters and optimizer state ("staging", into
shared memory) runs in a background thread while the next forward and backward run, and
the next optimizer step waits for it (a global optimizer pre-step hook; also the end of
the cell), since that step is what changes them in place; everything else (buffers, which
a forward updates, RNG, registered objects) is copied before ``save`` returns. DCP then
plans the save in its background thread, and the bytes are written by a helper process of
the rank at the lowest CPU priority (:mod:`.writer`), so on a machine whose cores the ranks
keep busy the write takes the time training leaves idle, and never the rank's GIL.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import time

from workbench.checkpoint import layout
from workbench.checkpoint.failures import describe, explain
from workbench.checkpoint.state import REGISTERED, CheckpointState
from workbench.checkpoint.storage import absolute, join, store_for
from workbench.errors import CheckpointError
from workbench.messages import Restored
from workbench.rank_state import namespace


def _failure_types() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    return (Exception, CheckpointException)


class _Saves:
    """The save in flight on this rank, and errors not yet reported."""

    def __init__(self) -> None:
        self.pending: concurrent.futures.Future | None = None
        self.pending_tag: str | None = None
        self.errors: list[str] = []
        self.group = None
        self.group_generation = None
        self.last_saved_step: int | None = None
        self.stager = None  # keeps its staging buffers: later async saves only copy into them
        self.staging_done: concurrent.futures.Future | None = None  # the copy of the save in flight
        self._step_hook = None

    def staging(self):
        if self.stager is None:
            # copies in a background thread into cached CPU buffers in shared memory, which the
            # writer process reads (pinned memory needs CUDA)
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))
        if self._step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._step_hook = register_optimizer_step_pre_hook(lambda *_: wait_for_staging())
        return self.stager


SAVES = _Saves()


def _context():
    """(this rank's state, its rendezvous spec, the step logger), once the rank is in a fleet run."""
    from workbench.metrics.logger import LOGGER
    from workbench.rank_state import STATE

    spec = STATE.spec
    if spec is None or STATE.run_dir is None:
        raise CheckpointError("checkpoints need a running fleet: %fleet start first")
    return STATE, spec, LOGGER


def _group(spec):
    """A gloo group for DCP's own collectives (one per process group: generation numbers start
    again in an engine that a later fleet attaches to, so the group must also still exist)."""
    import torch.distributed as dist

    if SAVES.group is None or SAVES.group_generation != spec.generation or not _exists(SAVES.group):
        SAVES.group = dist.new_group(backend="gloo")
        SAVES.group_generation = spec.generation
    return SAVES.group


def _exists(group) -> bool:
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # not in the world group map: destroyed since
        return False
    return True


def wait_for_staging() -> None:
    """Block until the async save in flight has copied the state (parameters and optimizer
    state may change after that); its errors surface with the save's."""
    done = SAVES.staging_done
    if done is not None:
        concurrent.futures.wait([done])
        SAVES.staging_done = None


def take_errors() -> list[str]:
    """Errors of background saves that finished since the last call (reported once)."""
    _reap()
    errors, SAVES.errors = SAVES.errors, []
    return errors


def abandon(timeout_s: float = 10.0) -> list[str]:
    """Before the process group is rebuilt (recover, scale): wait (bounded) for this rank's
    background save to end and hand over its errors, so that a save a dead peer broke does not
    fail the restore that follows. The broken save was never committed, so nothing uses it."""
    future = SAVES.pending
    if future is not None:
        concurrent.futures.wait([future], timeout=timeout_s)
    return take_errors()


def has_pending() -> str | None:
    """The tag of this rank's background save still in flight, if any."""
    _reap()
    return SAVES.pending_tag if SAVES.pending is not None else None


def finish_pending(timeout_s: float = 120.0) -> dict:
    """Before the fleet stops: wait (bounded) for this rank's background save to commit. Returns
    ``{"tag": None}`` with none, else its tag and ``error`` (None once it was committed)."""
    future, tag = SAVES.pending, SAVES.pending_tag
    if future is None:
        return {"tag": None}
    concurrent.futures.wait([future], timeout=timeout_s)
    if not future.done():
        return {"tag": tag, "error": f"still writing after {timeout_s:.0f} s"}
    errors = take_errors()
    return {"tag": tag, "error": errors[0] if errors else None}


def _reap() -> None:
    future = SAVES.pending
    if future is not None and future.done():
        SAVES.pending = None
        exc = future.exception()
        if exc is not None:
            reason = str(exc) if isinstance(exc, CheckpointError) else describe(exc)
            SAVES.errors.append(f"background save of checkpoint {SAVES.pending_tag!r} failed: {reason}")


def wait() -> None:
    """Wait for this rank's background save, if any; raise if it failed."""
    future = SAVES.pending
    if future is not None:
        try:
            future.result()
        except Exception:
            pass
    errors = take_errors()
    if errors:
        raise CheckpointError("; ".join(errors))


def _copy_volatile(state_dict: dict, objects: dict) -> dict:
    """``state_dict`` with the tensors that change outside an optimizer step (model buffers,
    RNG and registered objects) copied now; parameters and optimizer state stay references
    for the background staging."""
    import torch

    buffers = {b.data_ptr() for model in objects["model"].values() for b in model.buffers()}

    def copy(value, volatile: bool):
        if isinstance(value, torch.Tensor) and not hasattr(value, "to_local"):
            return value.clone() if volatile or value.data_ptr() in buffers else value
        if isinstance(value, dict):
            return {k: copy(v, volatile) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v, volatile) for v in value)
        return value

    return {key: copy(value, not key.startswith(("model/", "optimizer/"))) for key, value in state_dict.items()}


def _broadcast(value, group, rank: int):
    import torch.distributed as dist

    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def save(tag: str | None = None, *, async_: bool = False, keep_last: int | None = None,
         strategy: str | None = None, to: str | None = None) -> str:
    """Save a checkpoint of this rank's prepared objects; every rank must call it.

    ``tag`` defaults to ``step-<workbench.step>``. With ``async_``, returns at once:
    the state is copied in the background before the next optimizer step changes it,
    then written at low priority; a later save waits for it, and an error is reported
    at the next call or cell. ``keep_last`` K: then delete all but the newest K complete
    checkpoints. ``to``: a folder or fsspec URL (``s3://bucket/prefix``) to save into instead of
    the fleet's checkpoint folder. Returns the tag.
    """
    retention = layout.Retention(keep_last) if keep_last is not None else None
    return _save(tag, async_, retention, strategy, to)


def _save(tag: str | None, async_: bool, retention: layout.Retention | None, strategy: str | None = None,
          to: str | None = None) -> str:
    rank_state, spec, logger = _context()
    wait()  # one save at a time; a failed background save is reported here
    import torch.distributed as dist
    from torch.distributed.checkpoint import async_save
    from torch.distributed.checkpoint import save as dcp_save

    _FAILURES = _failure_types()
    group = _group(spec)
    tag = layout.check_tag(tag) if tag is not None else f"step-{logger.step}"
    folder = absolute(to) if to is not None else rank_state.checkpoint_dir
    tmp = layout.own_folder(folder, tag, spec.generation, logger.step) if async_ else _agreed_folder(folder, tag, spec, group)
    layout.mark_writer(tmp)
    state = CheckpointState(namespace(), spec.rank, logger.step)
    manifest = layout.Manifest(tag=tag, step=logger.step, world_size=spec.world_size,
                               strategy=strategy or _strategy(rank_state), created=time.time())
    if async_:
        from workbench.checkpoint import writer as writer_process

        writer_process.start()
    writer = store_for(folder).storage_writer(tmp, in_helper=async_)
    state_dict: dict = {}
    try:
        state_dict = state.state_dict()
        if async_:
            state_dict = _copy_volatile(state_dict, state.objects)
        else:
            dcp_save(state_dict, storage_writer=writer, process_group=group)
    except _FAILURES as exc:
        reason = explain(exc, tmp, state_dict)  # before rank 0 removes the folder (and frees the space)
        layout.unmark_writer(tmp)
        layout.discard(tmp, spec.rank)
        raise CheckpointError(f"checkpoint {tag!r} was not saved: {reason}") from None
    final = join(folder, tag)
    if not async_:
        if spec.rank != 0:  # rank 0's mark goes with the commit, so the folder is never seen as abandoned
            layout.unmark_writer(tmp)
        error = layout.commit_on_rank0(spec.rank, tmp, final, manifest, folder, retention)
        errors = [None] * spec.world_size
        dist.all_gather_object(errors, error, group=group)
        if any(errors):
            raise CheckpointError(next(e for e in errors if e))
        SAVES.last_saved_step = logger.step
        return tag
    response = async_save(state_dict, storage_writer=writer, process_group=group, async_stager=SAVES.staging())
    SAVES.staging_done, upload = response.staging_completion, response.upload_completion
    done: concurrent.futures.Future = concurrent.futures.Future()

    def finish(future):
        if spec.rank != 0:
            layout.unmark_writer(tmp)
        try:
            future.result()
            error = layout.commit_on_rank0(spec.rank, tmp, final, manifest, folder, retention)
            if error:
                raise CheckpointError(error)
            done.set_result(tag)
        except BaseException as exc:  # noqa: BLE001 - kept for the next call or cell
            reason = explain(exc, tmp, state_dict)
            layout.discard(tmp, spec.rank)
            done.set_exception(CheckpointError(reason))

    upload.add_done_callback(finish)
    SAVES.pending, SAVES.pending_tag = done, tag
    SAVES.last_saved_step = logger.step
    return tag


def _agreed_folder(folder: str, tag: str, spec, group) -> str:
    """The folder to write into, made by rank 0 and sent to every rank (or its error)."""
    decision = None
    if spec.rank == 0:
        try:
            decision = {"tmp": layout.agreed_folder(folder, tag, secrets.token_hex(3))}
        except OSError as exc:
            decision = {"error": f"cannot write checkpoints to {folder}: {exc.strerror or exc}"}
        except CheckpointError as exc:
            decision = {"error": str(exc)}
    decision = _broadcast(decision, group, spec.rank)
    if "error" in decision:
        raise CheckpointError(decision["error"])
    return decision["tmp"]


def _strategy(rank_state) -> str:
    key = rank_state.accelerator_key
    return key[0].strategy if key else "none"


MAYBE_SAVE_KEEP_LAST = 3


def maybe_save(every: int, *, async_: bool = True, keep_last: int | None = MAYBE_SAVE_KEEP_LAST) -> str | None:
    """In a training loop: save when ``workbench.step`` is a multiple of ``every`` (tag
    ``step-<N>``), keeping the newest ``keep_last`` of these periodic checkpoints (default 3;
    None keeps all). Checkpoints with a tag of your own are never deleted by it."""
    _, _, logger = _context()
    if every < 1:
        raise CheckpointError(f"maybe_save(every=...) needs a positive number of steps (got {every})")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"maybe_save(keep_last=...) must be at least 1, or None to keep all (got {keep_last})")
    step = logger.step
    if step == 0 or step % every or SAVES.last_saved_step == step:
        return None
    return _save(None, async_, layout.Retention(keep_last, periodic_only=True) if keep_last is not None else None)


def restore(tag: str = "latest") -> Restored:
    """Load checkpoint ``tag`` ('latest', a tag, a checkpoint's folder or URL, or a folder or URL
    of checkpoints: its newest) into this rank's prepared objects.

    Works into a different world size (DCP reshards). Returns what was restored.
    """
    rank_state, spec, logger = _context()
    wait()
    import torch.distributed.checkpoint as dcp

    from workbench.checkpoint.safe_io import safe_planner, safe_reader

    _FAILURES = _failure_types()
    path = layout.resolve(rank_state.checkpoint_dir, tag)
    manifest = layout.read_manifest(path)
    reader = safe_reader(path)
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    state = CheckpointState(namespace(), spec.rank, logger.step)
    saved_keys = {key.split(".", 1)[0] for key in saved}
    template = state.template(saved_keys, same_world=manifest.world_size == spec.world_size)
    _check_shapes(template, saved, manifest.tag)
    try:
        positions = state.position_template(saved_keys)
        if positions:  # small: read first, so a refusal comes before anything is loaded
            dcp.load(positions, storage_reader=safe_reader(path), planner=safe_planner(), process_group=_group(spec))
        refused = state.refusals(positions, saved_keys, manifest.world_size, spec.world_size)
        if refused:
            raise CheckpointError(f"checkpoint {manifest.tag!r} cannot be restored into {spec.world_size} ranks "
                                  f"(nothing was changed): {refused[0]}")
        dcp.load(template, storage_reader=reader, planner=safe_planner(), process_group=_group(spec))
    except CheckpointError:
        raise
    except _FAILURES as exc:
        raise CheckpointError(f"checkpoint {manifest.tag!r} could not be loaded: {describe(exc)}") from None
    restored = state.apply(template)
    logger.step = int(template.get("workbench", {}).get("step", manifest.step))
    return Restored(tag=manifest.tag, step=logger.step, saved_world_size=manifest.world_size,
                    world_size=spec.world_size, restored=restored, path=path)


def refusals_at(world: int) -> list[str]:
    """Why this rank's training state cannot move to ``world`` ranks: data positions that cannot
    be resharded, per-rank registered objects. Empty when it can."""
    from workbench.rank_state import STATE

    rank = STATE.spec.rank if STATE.spec else 0
    return CheckpointState(namespace(), rank, step=0, any_generation=True).live_refusals(world)


def _check_shapes(template: dict, saved: dict, tag: str) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(template)
    mismatched, missing = [], []
    for key, value in flat.items():
        shape = getattr(value, "shape", None)
        if shape is None:
            continue
        meta = saved.get(key)
        if meta is None:
            if not key.startswith(("rng/", "optimizer/")):
                missing.append(key)
            continue
        saved_shape = getattr(meta, "size", None)
        if saved_shape is not None and tuple(saved_shape) != tuple(shape):
            mismatched.append(f"{_readable(key)} is {tuple(saved_shape)} in the checkpoint, {tuple(shape)} here")
    if mismatched:
        more = f" (and {len(mismatched) - 3} more)" if len(mismatched) > 3 else ""
        raise CheckpointError(f"checkpoint {tag!r} does not fit: " + "; ".join(mismatched[:3]) + more)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        top = missing[0].split(".", 1)[0]
        held = sorted(k.split(".", 1)[1] for k in saved if k.startswith(top + ".") and "." in k)
        holds = f"; it holds {', '.join(held[:4])}{' …' if len(held) > 4 else ''}" if held else ""
        names = ", ".join(_readable(k) for k in missing[:3])
        raise CheckpointError(f"checkpoint {tag!r} does not fit: it has no {names}{more}{holds}")


def _readable(key: str) -> str:
    """``model/net.0.weight`` -> ``model 'net': 0.weight``."""
    top, _, rest = key.partition(".")
    kind, _, name = top.partition("/")
    return f"{kind} {name!r}: {rest}" if name and rest else key


def register(name: str, obj, *, per_rank: bool | None = None) -> None:
    """Include ``obj`` in every checkpoint as ``name``: anything with ``state_dict``/``load_state_dict``,
    a dict or a list (restored in place). ``per_rank=True``: every rank keeps its own value (a
    torchdata ``StatefulDataLoader`` is per rank by default); such state restores only at the
    world size it was saved at, and a restore or scale to another size is refused."""
    if not isinstance(name, str) or not name.isidentifier():
        raise CheckpointError(f"register() needs a name that is a Python identifier (got {name!r})")
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")) and not isinstance(obj, (dict, list)):
        raise CheckpointError(f"register({name!r}, ...) takes an object with state_dict/load_state_dict, a dict "
                              "or a list")
    if per_rank is None:
        per_rank = type(obj).__name__ == "StatefulDataLoader"
    REGISTERED[name] = (obj, bool(per_rank))
