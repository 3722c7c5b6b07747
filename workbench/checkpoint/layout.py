"""On disk: ``<run>/checkpoints/<tag>/`` with DCP shards and ``manifest.json``.

A save writes into ``checkpoints/.tmp-<tag>-<nonce>/``; when every rank has
written its shard, rank 0 writes ``manifest.json`` (step, world size,
strategy, time, file list with sizes, ``complete: true``), fsyncs it and the
folder, and renames the folder to ``checkpoints/<tag>``. Only such folders are
listed or restored; a ``.tmp-`` folder whose writers are gone is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field

from ..errors import CheckpointError

MANIFEST = "manifest.json"
WRITERS = ".writers"  # in a folder being written: one empty file per writer process, named by pid
TMP_PREFIX = ".tmp-"
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: str) -> dict[str, int]:
    found = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, folder)
            if rel != MANIFEST and not rel.startswith(WRITERS + os.sep):
                found[rel] = os.path.getsize(full)
    return found


def commit(tmp: str, final: str, manifest: Manifest) -> None:
    """Write the manifest last (fsynced), then rename the folder into place."""
    if os.path.exists(final):
        raise CheckpointError(f"checkpoint {manifest.tag!r} already exists; pick another --tag or rm it first")
    for name in _files(tmp):
        os.chmod(os.path.join(tmp, name), 0o600)  # torch writes the shards with the process umask
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    manifest.files = _files(tmp)
    path = os.path.join(tmp, MANIFEST)
    fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(manifest), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)
    shutil.rmtree(os.path.join(tmp, WRITERS), ignore_errors=True)
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def read_manifest(path: str) -> Manifest:
    """The manifest of a checkpoint folder, checked against the files; CheckpointError if unusable."""
    name = os.path.basename(path.rstrip("/"))
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint folder at {path}")
    if not os.path.exists(manifest_path):
        raise CheckpointError(f"checkpoint {name!r} is incomplete (no {MANIFEST}): it was never committed")
    try:
        with open(manifest_path) as f:
            data = json.load(f)
        manifest = Manifest(**data)
    except RecursionError:
        raise CheckpointError(f"checkpoint {name!r} is corrupt: its {MANIFEST} is nested too deeply to read") from None
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {name!r} is corrupt: its {MANIFEST} cannot be read ({exc})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"checkpoint {name!r} is corrupt: its {MANIFEST} {problem}")
    if not manifest.complete:
        raise CheckpointError(f"checkpoint {name!r} is incomplete (its manifest says so)")
    for rel, size in manifest.files.items():
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            raise CheckpointError(f"checkpoint {name!r} is corrupt: {rel} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(
                f"checkpoint {name!r} is corrupt: {rel} has {os.path.getsize(full)} bytes, the manifest says {size}"
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


def _writers_alive(tmp: str) -> bool:
    import psutil

    try:
        pids = [int(name) for name in os.listdir(os.path.join(tmp, WRITERS))]
    except (OSError, ValueError):
        # not marked yet: the save has just started, unless the folder is old
        try:
            return time.time() - os.path.getmtime(tmp) < 60
        except OSError:  # gone since it was listed: committed (renamed) or removed by rank 0
            return False
    return any(psutil.pid_exists(pid) for pid in pids)


def list_checkpoints(folder: str, clean: bool = True) -> list[Entry]:
    """Complete checkpoints (oldest first, by step then time), then ones still being written.

    With ``clean``, temporary folders whose writers are gone are removed.
    """
    if not os.path.isdir(folder):
        return []
    complete, writing = [], []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(TMP_PREFIX):
            if _writers_alive(path):
                writing.append(Entry(name[len(TMP_PREFIX):].rsplit("-", 1)[0], path, "writing"))
            elif clean:
                shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        complete.append(Entry(name, path, "complete", manifest))
    complete.sort(key=lambda e: (e.manifest.created, e.manifest.step))
    return complete + writing


def resolve(folder: str, tag: str) -> str:
    """The folder of checkpoint ``tag`` ('latest': the newest complete one), or a folder path."""
    if os.sep in tag and os.path.isdir(tag):
        read_manifest(tag)
        return os.path.abspath(tag)
    entries = [e for e in list_checkpoints(folder) if e.state == "complete"]
    if tag == "latest":
        if not entries:
            raise CheckpointError(f"there is no complete checkpoint in {folder} yet; save one with %checkpoint save")
        return entries[-1].path
    for entry in entries:
        if entry.tag == tag:
            return entry.path
    path = os.path.join(folder, tag)
    if os.path.isdir(path):
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
        shutil.rmtree(entry.path, ignore_errors=True)
    return [e.tag for e in doomed]


def own_folder(folder: str, tag: str, generation: int, step: int) -> str:
    """The temporary folder of a save, named by every rank alike from the tag, the process
    group's generation and the step, without a collective: an async save returns at once
    even when the ranks arrive at it a little apart."""
    try:
        check_new(folder, tag)
        tmp = os.path.join(folder, f"{TMP_PREFIX}{tag}-g{generation}s{step}")
        os.makedirs(tmp, 0o700, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {folder}: {exc.strerror or exc}") from None
    return tmp


def check_new(folder: str, tag: str) -> None:
    """Make the checkpoints folder; refuse a tag that exists."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.path.exists(os.path.join(folder, tag)):
        raise CheckpointError(f"checkpoint {tag!r} already exists; pick another --tag, or rm it first")


def mark_writer(tmp: str) -> None:
    """This process writes into ``tmp`` (listing never removes a folder with live writers)."""
    writers = os.path.join(tmp, WRITERS)
    os.makedirs(writers, exist_ok=True)
    open(os.path.join(writers, str(os.getpid())), "w").close()


def unmark_writer(tmp: str) -> None:
    try:
        os.remove(os.path.join(tmp, WRITERS, str(os.getpid())))
    except OSError:
        pass


def discard(tmp: str, rank: int) -> None:
    """Rank 0 removes a save's temporary folder."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def commit_on_rank0(rank: int, tmp: str, final: str, manifest: Manifest, folder: str,
                    retention: Retention | None) -> str | None:
    """Rank 0 commits the save (then applies ``retention``); returns the error, if any."""
    if rank != 0:
        return None
    try:
        commit(tmp, final, manifest)
        if retention is not None:
            retain(folder, retention)
    except CheckpointError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(exc)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"checkpoint {manifest.tag!r} could not be committed: {exc.strerror or exc}"
    return None
