"""Read the history rows of a wandb run file (``run-<id>.wandb``) back, for tests.

The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of
chunks (crc32 u32, length u16, type u8: full, first, middle, last) whose
payloads are ``wandb_internal_pb2.Record`` protobufs.
"""

from __future__ import annotations

import json
import struct

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
        else:
            break


def history_rows(path: str) -> list[dict]:
    rows = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
