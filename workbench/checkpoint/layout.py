"""On disk: ``<run>/checkpoints/<tag>/`` (or ``<--checkpoint-dir>/<tag>/``) with DCP shards
and ``manifest.json``.

A save writes into ``checkpoints/.tmp-<tag>-<nonce>/``; when every rank has
written its shard, rank 0 writes ``manifest.json`` (step, world size,
strategy, time, file list with sizes, ``complete: true``), fsyncs it and the
folder, and renames the folder to ``checkpoints/<tag>``. Only such folders are
listed or restored; a ``.tmp-`` folder whose writers are gone is removed.
On an object store (:mod:`.storage`) the save writes into ``<tag>/`` itself and
the manifest is the commit.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field

from workbench.checkpoint.safe_io import referenced_files
from workbench.checkpoint.storage import MANIFEST, TMP_PREFIX, WRITERS, basename, is_url, join, store_for  # noqa: F401 - part of the layout
from workbench.errors import CheckpointError

FORMAT = 1
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass
class Manifest:
    tag: str
    step: int
    world_size: int
    strategy: str
    created: float
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes
    complete: bool = True
    format: int = FORMAT

    @property
    def size(self) -> int:
        return sum(self.files.values())


@dataclass
class Entry:
    """One row of ``%checkpoint list``."""

    tag: str
    path: str
    state: str  # "complete" or "writing"
    manifest: Manifest | None = None


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_PATTERN.match(tag) or tag in ("latest",):
        raise CheckpointError(
            f"{tag!r} is not a usable checkpoint tag: use letters, digits, '.', '_' or '-' "
            "(up to 100, not 'latest'), e.g. --tag warmup-done"
        )
    return tag


def commit(tmp: str, final: str, manifest: Manifest) -> None:
    """Write the manifest last, making ``tmp`` the complete checkpoint ``final``."""
    store = store_for(final)
    if store.exists(join(final, MANIFEST)) or (final != tmp and store.exists(final)):
        raise CheckpointError(f"checkpoint {manifest.tag!r} already exists; pick another --tag or rm it first")

    def manifest_text(files: dict[str, int]) -> str:
        manifest.files = files
        return json.dumps(asdict(manifest), indent=1)

    store.commit(tmp, final, referenced_files(tmp), manifest_text)


def read_manifest(path: str) -> Manifest:
    """The manifest of a checkpoint folder, checked against the files; CheckpointError if unusable."""
    store = store_for(path)
    name = basename(path)
    manifest_path = join(path, MANIFEST)
    if not store.isdir(path):
        raise CheckpointError(f"no checkpoint folder at {path}")
    if not store.exists(manifest_path):
        raise CheckpointError(f"checkpoint {name!r} is incomplete (no {MANIFEST}): it was never committed")
    try:
        manifest = Manifest(**json.loads(store.read_text(manifest_path)))
    except RecursionError:
        raise CheckpointError(f"checkpoint {name!r} is corrupt: its {MANIFEST} is nested too deeply to read") from None
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {name!r} is corrupt: its {MANIFEST} cannot be read ({exc})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"checkpoint {name!r} is corrupt: its {MANIFEST} {problem}")
    if not manifest.complete:
        raise CheckpointError(f"checkpoint {name!r} is incomplete (its manifest says so)")
    present = store.files(path)
    for rel, size in manifest.files.items():
        if rel not in present:
            raise CheckpointError(f"checkpoint {name!r} is corrupt: {rel} is missing")
        if present[rel] != size:
            raise CheckpointError(
                f"checkpoint {name!r} is corrupt: {rel} has {present[rel]} bytes, the manifest says {size}"
            )
    return manifest


MAX_CREATED = 32503680000.0  # 3000-01-01: a later (or NaN, or infinite) created time is not a real one


def _manifest_problem(m: Manifest) -> str | None:
    """What is wrong with a manifest's fields (wrong types, no files, files outside its folder)."""
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool)

    checks = [
        (isinstance(m.tag, str), "has a tag that is not text"),
        (whole(m.step) and m.step >= 0, "has a step that is not a whole number >= 0"),
        (whole(m.world_size) and m.world_size >= 1, "has a world size that is not a whole number >= 1"),
        (isinstance(m.strategy, str), "has a strategy that is not text"),
        (isinstance(m.created, (int, float)) and not isinstance(m.created, bool) and 0 <= m.created < MAX_CREATED,
         "has a created time that is not a time (seconds since 1970, before the year 3000)"),
        (isinstance(m.complete, bool), "has a complete flag that is not true or false"),
        (isinstance(m.files, dict) and m.files, "lists no files"),
    ]
    for ok, problem in checks:
        if not ok:
            return problem
    for rel, size in m.files.items():
        if not isinstance(rel, str) or os.path.isabs(rel) or os.path.normpath(rel).startswith(os.pardir):
            return f"lists a file outside its folder ({rel!r})"
        if not whole(size) or size < 0:
            return f"gives {rel!r} a size that is not a whole number"
    return None


def _pending_tag(name: str, path: str, store) -> str | None:
    """The tag of a save not yet committed in folder ``name``, or None for a committed one."""
    if name.startswith(TMP_PREFIX):
        return name[len(TMP_PREFIX):].rsplit("-", 1)[0]
    if store.remote and not store.exists(join(path, MANIFEST)):
        return name  # an object store's save writes into <tag>/ until its manifest is there
    return None


def list_checkpoints(folder: str, clean: bool = True) -> list[Entry]:
    """Complete checkpoints (oldest first, by step then time), then ones still being written.

    With ``clean``, unfinished saves whose writers are gone are removed.
    """
    store = store_for(folder)
    complete, writing = [], []
    for name in store.subfolders(folder):
        path = join(folder, name)
        pending = _pending_tag(name, path, store)
        if pending is not None:
            if store.writers_alive(path):
                writing.append(Entry(pending, path, "writing"))
            elif clean:
                store.rmtree(path)
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        complete.append(Entry(name, path, "complete", manifest))
    complete.sort(key=lambda e: (e.manifest.created, e.manifest.step))
    return complete + writing


def resolve(folder: str, tag: str) -> str:
    """The folder of checkpoint ``tag`` ('latest': the newest complete one), or of a path or URL:
    a checkpoint's folder, or a folder of checkpoints (its newest)."""
    if is_url(tag) or (os.sep in tag and os.path.isdir(tag)):
        path = tag.rstrip("/") if is_url(tag) else os.path.abspath(tag)
        store = store_for(path)
        if not store.exists(join(path, MANIFEST)):
            held = [e for e in list_checkpoints(path, clean=False) if e.state == "complete"]
            if held:
                return held[-1].path
        read_manifest(path)
        return path
    entries = [e for e in list_checkpoints(folder) if e.state == "complete"]
    if tag == "latest":
        if not entries:
            raise CheckpointError(f"there is no complete checkpoint in {folder} yet; save one with %checkpoint save")
        return entries[-1].path
    for entry in entries:
        if entry.tag == tag:
            return entry.path
    path = join(folder, tag)
    if store_for(folder).isdir(path):
        read_manifest(path)  # raises with the reason it is not usable
    known = ", ".join(e.tag for e in entries) or "none yet"
    raise CheckpointError(f"no checkpoint named {tag!r}; complete checkpoints: {known}")


@dataclass(frozen=True)
class Retention:
    """Which complete checkpoints a save keeps after it commits."""

    keep_last: int
    """the newest this many stay"""
    periodic_only: bool = False
    """only periodic ``step-<N>`` checkpoints (``maybe_save``) are candidates for deletion"""


PERIODIC_TAG = re.compile(r"step-\d+")


def retain(folder: str, retention: Retention) -> list[str]:
    """Delete all but the newest ``retention.keep_last`` complete checkpoints (of those it
    covers); never one being written."""
    if retention.keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1 (got {retention.keep_last})")
    complete = [e for e in list_checkpoints(folder, clean=False) if e.state == "complete"
                and (not retention.periodic_only or PERIODIC_TAG.fullmatch(e.tag))]
    doomed = complete[:-retention.keep_last]
    for entry in doomed:
        store_for(folder).rmtree(entry.path)
    return [e.tag for e in doomed]


def own_folder(folder: str, tag: str, generation: int, step: int) -> str:
    """The temporary folder of a save, named by every rank alike from the tag, the process
    group's generation and the step, without a collective: an async save returns at once
    even when the ranks arrive at it a little apart."""
    check_new(folder, tag)
    return store_for(folder).staging(folder, tag, f"g{generation}s{step}")


def agreed_folder(folder: str, tag: str, nonce: str) -> str:
    """Rank 0's temporary folder for a save of ``tag`` (sent to the other ranks)."""
    check_new(folder, tag)
    return store_for(folder).staging(folder, tag, nonce)


def check_new(folder: str, tag: str) -> None:
    """Make the checkpoints folder; refuse a tag that exists."""
    store = store_for(folder)
    store.prepare(folder)
    if store.exists(join(folder, tag, MANIFEST)) or (not store.remote and store.exists(join(folder, tag))):
        raise CheckpointError(f"checkpoint {tag!r} already exists; pick another --tag, or rm it first")


def mark_writer(tmp: str) -> None:
    """This process writes into ``tmp`` (listing never removes a folder with live writers)."""
    store_for(tmp).mark_writer(tmp)


def unmark_writer(tmp: str) -> None:
    store_for(tmp).unmark_writer(tmp)


def discard(tmp: str, rank: int) -> None:
    """Rank 0 removes a save's temporary folder."""
    store = store_for(tmp)
    if rank == 0 and not (store.remote and store.exists(join(tmp, MANIFEST))):  # never a committed checkpoint
        store.rmtree(tmp)


def commit_on_rank0(rank: int, tmp: str, final: str, manifest: Manifest, folder: str,
                    retention: Retention | None) -> str | None:
    """Rank 0 commits the save, applies ``retention`` and removes saves that died unfinished;
    returns the error, if any."""
    if rank != 0:
        return None
    try:
        commit(tmp, final, manifest)
        if retention is not None:
            retain(folder, retention)
        list_checkpoints(folder, clean=True)
    except CheckpointError as exc:
        discard(tmp, rank)
        return str(exc)
    except OSError as exc:
        discard(tmp, rank)
        return f"checkpoint {manifest.tag!r} could not be committed: {exc.strerror or exc}"
    return None
