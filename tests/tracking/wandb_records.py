"""Read the records of a W&B offline run file (`run-<id>.wandb`) with wandb's own protobuf schema.

The file is a LevelDB-style log: a 7-byte header (':W&B', magic, version), then 32 KiB blocks of
chunks, each with a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last);
a chunk never straddles a block, a block tail under 7 bytes is padding. wandb no longer ships a
Python reader for it, only the schema (`wandb.proto.wandb_internal_pb2.Record`).
"""

from __future__ import annotations

import json
import struct

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunks = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunks += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def history(path) -> list[dict]:
    """The rows logged with run.log, as {key: value}."""
    out = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            out.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return out


def run_record(path):
    """(run id, display name, project, config dict) of the file's run record."""
    for r in records(path):
        if r.WhichOneof("record_type") == "run":
            config = {item.key: json.loads(item.value_json) for item in r.run.config.update}
            return r.run.run_id, r.run.display_name, r.run.project, config
    raise AssertionError(f"{path}: no run record")
