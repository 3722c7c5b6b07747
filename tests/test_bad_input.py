"""Every odd input gets one line and changes nothing (issue 40, items 7-12). No fleet: fast."""

from __future__ import annotations

import json
import os

import pytest
import torch
from IPython.core.error import UsageError

from workbench import CheckpointError
from workbench.checkpoint import layout
from workbench.kernel.flags import checkpoint_parser, fleet_parser
from workbench.kernel.processes import UNIX_SOCKET_PATH_MAX, _socket_friendly_tmp
from workbench.metrics.logger import MetricsLogger


@pytest.mark.parametrize("value", [complex(1, 2), 10**400, torch.tensor(1 + 2j), "1.0", None])
def test_log_refuses_what_is_not_a_real_number_at_the_call(value):
    logger = MetricsLogger()
    logger.log(None, {"good": 1.0})
    with pytest.raises(TypeError, match=r"workbench.log\(x=...\) takes real numbers"):
        logger.log(None, {"x": value})
    logger.log(None, {"good": 2.0, "nan": float("nan"), "int": 10**300})
    assert [r[3]["good"] for r in logger._buffer] == [1.0, 2.0]  # nothing dropped, the bad call kept nothing


@pytest.mark.parametrize("line", ["rm '", "scale \\", 'start --name "a'])
def test_unbalanced_quotes_and_a_trailing_backslash_are_one_line(line):
    parser = checkpoint_parser() if line.startswith("rm") else fleet_parser()
    with pytest.raises(UsageError, match="cannot read") as caught:
        parser.parse_line(line)
    assert "\n" not in str(caught.value)


def _manifest(tmp_path, **fields) -> str:
    folder = tmp_path / "crafted"
    folder.mkdir()
    (folder / "data.distcp").write_bytes(b"x")
    base = {"tag": "crafted", "step": 1, "world_size": 2, "strategy": "ddp", "created": 1.7e9,
            "files": {"data.distcp": 1}, "complete": True}
    (folder / layout.MANIFEST).write_text(json.dumps({**base, **fields}) if fields.get("raw") is None else fields["raw"])
    return str(folder)


@pytest.mark.parametrize("created", [1e300, float("nan"), float("inf"), -5])
def test_a_manifest_with_an_impossible_created_time_is_corrupt(tmp_path, created):
    with pytest.raises(CheckpointError, match="created time that is not a time"):
        layout.read_manifest(_manifest(tmp_path, created=created))


def test_a_deeply_nested_manifest_is_corrupt_not_a_recursion_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(CheckpointError, match="corrupt"):
        layout.read_manifest(_manifest(tmp_path, raw='{"tag": ' + deep + "}"))


def test_a_long_tmpdir_gives_the_sockets_a_short_folder(tmp_path, monkeypatch):
    import tempfile

    long = tmp_path / ("scratch-" + "x" * 110)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    chosen = _socket_friendly_tmp()
    assert chosen in ("/tmp", "/dev/shm") and len(chosen) + 40 <= UNIX_SOCKET_PATH_MAX
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert _socket_friendly_tmp() == str(tmp_path) or len(str(tmp_path)) + 40 > UNIX_SOCKET_PATH_MAX
    assert os.path.isdir(chosen)
