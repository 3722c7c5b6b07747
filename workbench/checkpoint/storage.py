"""Where checkpoints are kept: a local folder, or any fsspec URL (``s3://bucket/prefix``, ``gs://``...).

A local save is written into a temporary folder that is renamed into place once complete
(:mod:`.layout`). Object stores have no rename, so a save there writes straight into
``<prefix>/<tag>/`` and its manifest last: a folder without a manifest is a save still being
written, or one whose writers died, which the next save removes. Credentials are the storage
library's business (for S3: the AWS_* variables, ~/.aws, an instance role); nothing here
passes them on or writes them down.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import time
from collections.abc import Callable

from workbench.errors import CheckpointError

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"  # a local save's folder until it is committed: .tmp-<tag>-<nonce>
WRITERS = ".writers"  # in a folder being written: one empty file per writer process, named <host>-<pid>
UNMARKED_GRACE_S = 60.0  # a folder with no writer marks this young is a save that has just begun
OTHER_HOST_WRITER_S = 3600.0  # a writer on another host (whose pid can't be checked) counts as alive this long


def is_url(location: str) -> bool:
    """A location that fsspec resolves (``s3://...``), as opposed to a local path."""
    return "://" in str(location) and not str(location).startswith("file://")


def store_for(location: str) -> "Store":
    return ObjectStore(location) if is_url(location) else LocalStore()


def absolute(location: str) -> str:
    """A URL as it is; a local path made absolute (the ranks' working folder may differ)."""
    return location.rstrip("/") if is_url(location) else os.path.abspath(os.path.expanduser(location))


def join(folder: str, *names: str) -> str:
    """A path inside ``folder`` (a local folder or a URL)."""
    if is_url(folder):
        return "/".join([folder.rstrip("/"), *names])
    return os.path.join(folder, *names)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path.rstrip(os.sep))


def writer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _writer_alive(name: str, age_s: float) -> bool:
    import psutil

    host, _, pid = name.rpartition("-")
    if not pid.isdigit():
        return False
    if host and host != socket.gethostname():
        return age_s < OTHER_HOST_WRITER_S
    return psutil.pid_exists(int(pid))


class Store:
    """The operations :mod:`.layout` needs from a place that keeps checkpoints."""

    remote: bool

    def prepare(self, folder: str) -> None:
        """Make sure checkpoints can be written under ``folder``; CheckpointError in one line if not."""
        raise NotImplementedError

    def subfolders(self, folder: str) -> list[str]:
        """The names of the folders directly in ``folder`` (none if it does not exist)."""
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def read_text(self, path: str) -> str:
        raise NotImplementedError

    def files(self, folder: str) -> dict[str, int]:
        """Every file under ``folder`` but the manifest and the writer marks: relative path -> bytes."""
        raise NotImplementedError

    def rmtree(self, path: str) -> None:
        raise NotImplementedError

    def staging(self, folder: str, tag: str, suffix: str) -> str:
        """The folder a save of ``tag`` writes into until it is committed."""
        raise NotImplementedError

    def commit(self, tmp: str, final: str, keep: set[str], manifest_text: Callable[[dict[str, int]], str]) -> None:
        """Make the save in ``tmp`` the complete checkpoint ``final`` holding the files ``keep``
        (others, left by a save that died there, are removed); its manifest, the text
        ``manifest_text`` gives for those files (path -> bytes), is written last."""
        raise NotImplementedError

    def mark_writer(self, tmp: str) -> None:
        raise NotImplementedError

    def unmark_writer(self, tmp: str) -> None:
        raise NotImplementedError

    def writers_alive(self, tmp: str) -> bool:
        """Whether a process may still write into ``tmp`` (listing never removes such a folder)."""
        raise NotImplementedError

    def storage_writer(self, path: str, in_helper: bool):
        """DCP's storage writer for ``path`` (``in_helper``: its writes run in the rank's helper process)."""
        raise NotImplementedError

    def reader_base(self) -> type:
        """DCP's storage reader class for this kind of place."""
        raise NotImplementedError


class LocalStore(Store):
    """A folder on a local (or shared) filesystem; files private to the user, commits by rename."""

    remote = False

    def prepare(self, folder: str) -> None:
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoints to {folder}: {exc.strerror or exc}") from None

    def subfolders(self, folder: str) -> list[str]:
        if not os.path.isdir(folder):
            return []
        return sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read_text(self, path: str) -> str:
        with open(path) as f:
            return f.read()

    def files(self, folder: str) -> dict[str, int]:
        found = {}
        for root, _dirs, names in os.walk(folder):
            for name in names:
                full = os.path.join(root, name)
                rel = os.path.relpath(full, folder)
                if rel != MANIFEST and not rel.startswith(WRITERS + os.sep):
                    found[rel] = os.path.getsize(full)
        return found

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def staging(self, folder: str, tag: str, suffix: str) -> str:
        tmp = os.path.join(folder, f"{TMP_PREFIX}{tag}-{suffix}")
        try:
            os.makedirs(tmp, 0o700, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoints to {folder}: {exc.strerror or exc}") from None
        return tmp

    def commit(self, tmp: str, final: str, keep: set[str], manifest_text: Callable[[dict[str, int]], str]) -> None:
        files = self.files(tmp)
        for rel in set(files) - keep:
            os.remove(os.path.join(tmp, rel))
            del files[rel]
        for name in files:
            os.chmod(os.path.join(tmp, name), 0o600)  # torch writes the shards with the process umask
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        path = os.path.join(tmp, MANIFEST)
        fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(manifest_text(files))
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".part", path)
        shutil.rmtree(os.path.join(tmp, WRITERS), ignore_errors=True)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(os.path.dirname(final))

    def mark_writer(self, tmp: str) -> None:
        writers = os.path.join(tmp, WRITERS)
        os.makedirs(writers, exist_ok=True)
        open(os.path.join(writers, writer_name()), "w").close()

    def unmark_writer(self, tmp: str) -> None:
        try:
            os.remove(os.path.join(tmp, WRITERS, writer_name()))
        except OSError:
            pass

    def writers_alive(self, tmp: str) -> bool:
        try:
            names = os.listdir(os.path.join(tmp, WRITERS))
            age = time.time() - os.path.getmtime(os.path.join(tmp, WRITERS))
        except OSError:
            # not marked yet: the save has just started, unless the folder is old
            try:
                return time.time() - os.path.getmtime(tmp) < UNMARKED_GRACE_S
            except OSError:  # gone since it was listed: committed (renamed) or removed by rank 0
                return False
        return any(_writer_alive(name, age) for name in names)

    def storage_writer(self, path: str, in_helper: bool):
        from torch.distributed.checkpoint import FileSystemWriter

        from workbench.checkpoint.writer import HelperWriter

        return (HelperWriter if in_helper else FileSystemWriter)(path, thread_count=1)

    def reader_base(self) -> type:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ObjectStore(Store):
    """An fsspec URL (S3 and the like): no folders and no rename, so the manifest is the commit."""

    remote = True

    def __init__(self, location: str) -> None:
        self.fs = _filesystem(location.split("://", 1)[0])

    def _key(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def _fresh(self, path: str) -> None:
        self.fs.invalidate_cache(self._key(path))  # other processes write here: never trust a cached listing

    def prepare(self, folder: str) -> None:
        bucket = self._key(folder).split("/", 1)[0]
        try:
            self.fs.ls(bucket, refresh=True)
        except FileNotFoundError:
            raise CheckpointError(f"cannot write checkpoints to {folder}: bucket {bucket!r} does not exist "
                                  "(create it first; workbench never creates buckets)") from None
        except PermissionError as exc:
            raise CheckpointError(f"cannot write checkpoints to {folder}: access denied ({_reason(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own types for a bad endpoint or URL
            raise CheckpointError(f"cannot reach {folder}: {_reason(exc)}") from None

    def subfolders(self, folder: str) -> list[str]:
        self._fresh(folder)
        try:
            entries = self.fs.ls(self._key(folder), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def isdir(self, path: str) -> bool:
        self._fresh(path)
        return self.fs.isdir(self._key(path))

    def exists(self, path: str) -> bool:
        self._fresh(path)
        return self.fs.exists(self._key(path))

    def read_text(self, path: str) -> str:
        return self.fs.cat_file(self._key(path)).decode()

    def _objects(self, folder: str) -> dict[str, dict]:
        self._fresh(folder)
        key = self._key(folder).rstrip("/")
        try:
            found = self.fs.find(key, detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(key) + 1:]: info for name, info in found.items() if name.startswith(key + "/")}

    def files(self, folder: str) -> dict[str, int]:
        return {rel: int(info["size"]) for rel, info in self._objects(folder).items()
                if rel != MANIFEST and not rel.startswith(WRITERS + "/")}

    def rmtree(self, path: str) -> None:
        try:
            self.fs.rm(self._key(path), recursive=True)
        except FileNotFoundError:
            pass
        self._fresh(path)

    def staging(self, folder: str, tag: str, suffix: str) -> str:
        return join(folder, tag)

    def commit(self, tmp: str, final: str, keep: set[str], manifest_text: Callable[[dict[str, int]], str]) -> None:
        files = self.files(tmp)
        for rel in set(files) - keep:
            self.fs.rm(self._key(join(tmp, rel)))
            del files[rel]
        self.rmtree(join(tmp, WRITERS))
        self.fs.pipe_file(self._key(join(tmp, MANIFEST)), manifest_text(files).encode())

    def mark_writer(self, tmp: str) -> None:
        self.fs.pipe_file(self._key(join(tmp, WRITERS, writer_name())), b"")

    def unmark_writer(self, tmp: str) -> None:
        try:
            self.fs.rm(self._key(join(tmp, WRITERS, writer_name())))
        except (FileNotFoundError, OSError):
            pass

    def writers_alive(self, tmp: str) -> bool:
        objects = self._objects(tmp)
        if MANIFEST in objects:
            return False
        now = time.time()
        ages = {rel: now - _modified(info) for rel, info in objects.items()}
        marks = {rel.split("/", 1)[1]: age for rel, age in ages.items() if rel.startswith(WRITERS + "/")}
        if not marks:  # not marked yet: the save has just begun, unless its objects are old
            return bool(ages) and min(ages.values()) < UNMARKED_GRACE_S
        return any(_writer_alive(name, age) for name, age in marks.items())

    def storage_writer(self, path: str, in_helper: bool):
        from workbench.checkpoint.writer import HelperObjectStoreWriter, ObjectStoreWriter

        return (HelperObjectStoreWriter if in_helper else ObjectStoreWriter)(path, thread_count=1)

    def reader_base(self) -> type:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # DCP's own fsspec reader

        return FsspecReader


@functools.cache
def _filesystem(protocol: str):
    import fsspec

    try:
        return fsspec.filesystem(protocol)
    except ImportError as exc:
        package = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(
            protocol, exc.name or "its fsspec package")
        raise CheckpointError(f"checkpoints on {protocol}:// need {package}: pip install {package}") from None
    except ValueError as exc:
        raise CheckpointError(f"{protocol}:// is not a storage that fsspec knows ({exc})") from None


def _modified(info: dict) -> float:
    when = info.get("LastModified") or info.get("mtime") or info.get("updated")
    if hasattr(when, "timestamp"):
        return when.timestamp()
    return float(when) if when is not None else 0.0


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__

