"""A fingerprint of the training data, kept with each checkpoint, so a resume notices changed data.

It names every data file (relative to data.dataset_path), its size and the SHA-256 of its first
64 KiB, or of a Parquet file its footer. A resume over different data would train on other
samples than the interrupted run, so a changed fingerprint stops the run unless
`data.allow_changed_data` says to go on. What it notices and what it cannot: docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from weft.errors import UserError

FINGERPRINT_FILE = "data_fingerprint.json"
HEAD_BYTES = 64 * 1024
HASHED_PARTS = {"head_sha256": f"its first {HEAD_BYTES // 1024} KiB differ", "footer_sha256": "its Parquet footer differs"}


class DataChangedError(UserError):
    """The data differs from the data a checkpoint was trained on."""


def data_fingerprint(files: list[Path], dataset_path: str | Path) -> dict[str, dict[str, object]]:
    """{name: {"size": bytes, "head_sha256" or "footer_sha256": hex}} of each file, named relative
    to dataset_path."""
    root = Path(dataset_path)
    fingerprint = {}
    for path in files:
        name = str(path.relative_to(root)) if root.is_dir() and path.is_relative_to(root) else path.name
        key, part = hashed_part(path)
        fingerprint[name] = {"size": path.stat().st_size, key: hashlib.sha256(part).hexdigest()}
    return fingerprint


def hashed_part(path: Path) -> tuple[str, bytes]:
    """("footer_sha256", a Parquet file's footer: its metadata, their length and the magic 'PAR1'),
    read from the end of the file; else (any other file, or a Parquet file whose end is no
    footer) ("head_sha256", its first HEAD_BYTES)."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if path.name.endswith(".parquet") and size >= 12:
            f.seek(size - 8)
            tail = f.read(8)
            length = int.from_bytes(tail[:4], "little")
            if tail[4:] == b"PAR1" and length <= size - 12:
                f.seek(size - 8 - length)
                return "footer_sha256", f.read(length) + tail
        f.seek(0)
        return "head_sha256", f.read(HEAD_BYTES)


def difference(saved: dict[str, dict[str, object]], current: dict[str, dict[str, object]]) -> str | None:
    """The first difference between two fingerprints, in words, or None if they agree."""
    for name, then in saved.items():
        now = current.get(name)
        if now is None:
            return f"file {name} is gone"
        if now["size"] != then["size"]:
            return f"file {name} changed ({then['size']:,} bytes then, {now['size']:,} now)"
        for key, part in HASHED_PARTS.items():  # those both hold (a checkpoint may predate footer hashes)
            if key in now and key in then and now[key] != then[key]:
                return f"file {name} changed (same size, {part})"
    added = sorted(set(current) - set(saved))
    return f"file {added[0]} is new" if added else None


def check_resumed_data(current: dict[str, dict[str, object]], described: str, resume_folder: Path | None,
                       allow_changed: bool) -> tuple[str, str | None]:
    """(the fingerprint `current` as JSON text, to save with each checkpoint; a note to log, or None).

    Compares `current` (data_fingerprint's, of the data `described`, e.g. "data.dataset_path = 'x'")
    with the fingerprint saved in `resume_folder` (the checkpoint the run will resume from; None or
    a checkpoint without a fingerprint: nothing to compare). A difference raises DataChangedError
    naming the file, or with `allow_changed` becomes the note."""
    text = json.dumps(current, indent=1, sort_keys=True) + "\n"
    saved_file = resume_folder / FINGERPRINT_FILE if resume_folder is not None else None
    if saved_file is None or not saved_file.is_file():
        return text, None
    try:
        saved = json.loads(saved_file.read_text())
    except (OSError, ValueError) as e:
        raise DataChangedError(f"checkpoint {resume_folder}: cannot read {FINGERPRINT_FILE} ({e})") from None
    changed = difference(saved, current)
    if changed is None:
        return text, None
    where = f"{described}: {changed} since checkpoint {resume_folder} was saved"
    if not allow_changed:
        raise DataChangedError(f"{where}; the resumed run would read other samples than the interrupted one; restore "
                               "the data, or set data.allow_changed_data = true to resume anyway")
    return text, f"{where}; resuming anyway (data.allow_changed_data = true)"
