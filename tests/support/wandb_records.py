"""Read what wandb wrote in offline mode: the records of a run's `.wandb` file.

wandb (0.2x-0.3x) no longer ships a Python reader of that file (`wandb.sdk.internal.datastore` is
gone; its Go core writes it), so this reads the format directly: a 7-byte header (":W&B", magic
0xBEE1, version 0), then LevelDB-log blocks of 32 KiB holding chunks, each with a header of crc32
(4 bytes), length (2) and type (1: full, 2: first, 3: middle, 4: last), whose joined payloads
are serialized `wandb.proto.wandb_internal_pb2.Record`s.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32 * 1024
CHUNK_HEADER = struct.Struct("<IHB")
FILE_HEADER = b":W&B\xe1\xbe\x00"


def records(path: Path) -> list:
    """Every Record in the .wandb file at path, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:len(FILE_HEADER)] == FILE_HEADER, f"{path}: not a .wandb file"
    payloads, pending, pos = [], b"", len(FILE_HEADER)
    while pos + CHUNK_HEADER.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER.size:  # the block's tail is padding
            pos += left_in_block
            continue
        _, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        pos += CHUNK_HEADER.size
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            payloads.append(pending)
            pending = b""
    out = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def history(path: Path) -> dict[int, dict[str, float]]:
    """step -> {key: value} of every wandb.log at that step (wandb's own _step/_runtime/_timestamp left out)."""
    steps: dict[int, dict[str, float]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items.pop("_step"))
        steps.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return steps


def run_info(path: Path) -> tuple[str, dict]:
    """(run id, config as {key: value}) from the file's run record."""
    run = next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
    return run.run_id, {item.key: json.loads(item.value_json) for item in run.config.update}


def finished_run_file(folder: Path, timeout: float = 30.0) -> Path:
    """The .wandb file of the one offline run under folder (its `wandb/offline-run-*/`), once it
    holds the run's exit record: wandb's core process writes it after `finish()` returns."""
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
        if len(found) == 1 and any(r.WhichOneof("record_type") == "exit" for r in _complete_records(found[0])):
            return found[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no finished wandb run under {folder} after {timeout:.0f} s (found {found})")
        time.sleep(0.1)


def _complete_records(path: Path) -> list:
    try:
        return records(path)
    except Exception:  # a file still being written: a header or a chunk not there yet
        return []
