"""Token shards: a corpus tokenized once, ahead of training (`python -m weft.components.data.prepare`),
read memory-mapped by the run with no tokenizer work.

A shard folder holds `manifest.json` and, per source file, `shard_NNNNN.tokens` (the documents' ids
back to back, uint16 or uint32) and `shard_NNNNN.offsets` (their boundaries, uint64); the layout
and the manifest's fields are in docs/data.md. `ShardWindows` is `TextWindows` over shards, so
windows, document masking, the cursor and resume are the text loader's; a position's `file_index`
is the shard, `line_number` the document in it and `byte_offset` where its ids start.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weft.components.data.errors import DataError
from weft.components.data.files import DocStart, RawDoc
from weft.components.data.windows import TextWindows

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENS_SUFFIX = ".tokens"
OFFSETS_SUFFIX = ".offsets"
OFFSETS_DTYPE = np.dtype("<u8")


def shard_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned type that holds every id of the vocabulary."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def tokenizer_identity(path: str | Path, tokenizer: Any) -> dict[str, Any]:
    """What names a tokenizer: its path's name, vocabulary size and the SHA-256 of its bytes (a
    SentencePiece file; a Hugging Face folder's tokenizer.json and tokenizer_config.json)."""
    path = Path(path)
    parts = [path / n for n in ("tokenizer.json", "tokenizer_config.json")] if path.is_dir() else [path]
    digest = hashlib.sha256()
    for part in parts:
        if part.is_file():
            digest.update(part.read_bytes())
    return {"name": path.name, "vocab_size": tokenizer.vocab_size, "sha256": digest.hexdigest()}


def is_shard_folder(dataset_path: str | Path) -> bool:
    return (Path(dataset_path) / MANIFEST).is_file()


def are_shards(files: list[Path]) -> bool:
    """`files` are the `.tokens` shards of a shard folder (what the plan found there)."""
    return bool(files) and all(Path(path).suffix == TOKENS_SUFFIX for path in files)


def check_shard_format(data_format: str) -> None:
    """Shards hold text windows: a record format cannot read them."""
    if data_format != "text":
        raise DataError(f"data.format = '{data_format}': token shards hold text windows; expected 'text'")


@dataclass(frozen=True)
class Manifest:
    """A checked manifest: its folder, dtype, tokenizer identity and shards (name, tokens, documents)."""

    folder: Path
    dtype: np.dtype
    tokenizer: dict[str, Any]
    shards: list[dict[str, Any]]

    @property
    def token_files(self) -> list[Path]:
        return [self.folder / (s["name"] + TOKENS_SUFFIX) for s in self.shards]


def read_manifest(folder: str | Path, key: str = "data.dataset_path") -> Manifest:
    """The manifest of a shard folder, checked against the shards' file sizes (never their
    tokens); a DataError naming `key` and the file on the first problem."""
    folder = Path(folder)
    where = folder / MANIFEST
    try:
        manifest = json.loads(where.read_text())
        version = manifest.get("format_version")
    except (OSError, ValueError, AttributeError) as err:
        raise DataError(f"{key}: cannot read {where} as a JSON manifest ({err})") from None
    if version != FORMAT_VERSION:
        raise DataError(f"{key}: {where} has format_version {version!r}; this weft reads version {FORMAT_VERSION} "
                        "(prepare the shards again with python -m weft.components.data.prepare)")
    try:
        dtype, shards, tokenizer = np.dtype(manifest["dtype"]), manifest["shards"], manifest["tokenizer"]
        sizes = [(s["name"], int(s["tokens"]), int(s["documents"])) for s in shards]
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{key}: {where} is not a weft shard manifest ({type(err).__name__}: {err})") from None
    for name, tokens, documents in sizes:
        for suffix, expected in [(TOKENS_SUFFIX, tokens * dtype.itemsize), (OFFSETS_SUFFIX, (documents + 1) * 8)]:
            path = folder / (name + suffix)
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                found = "is missing" if size is None else f"holds {size:,} bytes"
                raise DataError(f"{key}: shard {path} {found}; {MANIFEST} expects {expected:,} bytes; "
                                "the shard is corrupt or incomplete: prepare the shards again")
    if not any(documents for _, _, documents in sizes):
        raise DataError(f"{key}: {where} lists no documents; nothing to train on")
    return Manifest(folder, dtype, tokenizer, shards)


def check_tokenizer(manifest: Manifest, identity: dict[str, Any], tokenizer_path: str) -> None:
    """The run's tokenizer must be the one the shards were made with."""
    made = manifest.tokenizer
    if made.get("sha256") != identity["sha256"] or made.get("vocab_size") != identity["vocab_size"]:
        def named(t: dict[str, Any]) -> str:
            return f"'{t.get('name')}', vocabulary {t.get('vocab_size')}, sha256 {str(t.get('sha256'))[:12]}"
        raise DataError(f"model.tokenizer_path = '{tokenizer_path}': the shards in {manifest.folder} were made with "
                        f"another tokenizer ({named(made)}) than this one ({named(identity)})")


class ShardWindows(TextWindows):
    """Text windows over token shards: `build` reads a document's ids from the memory-mapped shard
    and checks them against the vocabulary; nothing is tokenized."""

    def __init__(self, tokenizer: Any, manifest: Manifest) -> None:
        super().__init__(tokenizer)
        self.manifest = manifest
        self._tokens: dict[int, np.memmap] = {}
        self._offsets: dict[int, np.ndarray] = {}

    def check_files(self, files: list[Path]) -> None:
        if files != self.manifest.token_files:
            raise DataError(f"data.dataset_path: expected the shards of {self.manifest.folder / MANIFEST}")

    def documents(self, files: list[Path], start: DocStart, columns: object = None) -> Iterator[RawDoc]:
        """Every document from `start` on, shard after shard, epoch after epoch (`columns`: unused,
        a shard has none)."""
        itemsize = self.manifest.dtype.itemsize
        while True:
            for file_index in range(start.file_index, len(files)):
                offsets = self.offsets(file_index)
                first = start.line_number - 1 if file_index == start.file_index else 0
                if file_index == start.file_index and first < len(offsets) - 1 and \
                        int(offsets[first]) * itemsize != start.byte_offset:
                    raise DataError(f"data loader state: document {start.line_number} of {files[file_index]} does "
                                    f"not start at byte {start.byte_offset}; has the dataset changed?")
                for doc in range(first, len(offsets) - 1):
                    begin, end = int(offsets[doc]), int(offsets[doc + 1])
                    yield RawDoc(DocStart(start.epoch, file_index, begin * itemsize, doc + 1),
                                 (end - begin) * itemsize, None)
            start = DocStart(start.epoch + 1, file_index=0)

    def build(self, files: list[Path], raw: RawDoc) -> list[int]:
        """The document's ids, each checked to be below the vocabulary size."""
        doc = raw.start
        begin = doc.byte_offset // self.manifest.dtype.itemsize
        ids = self.tokens(doc.file_index)[begin : begin + raw.size // self.manifest.dtype.itemsize]
        if len(ids) and int(ids.max()) >= self.tokenizer.vocab_size:
            bad = begin + int(np.argmax(ids >= self.tokenizer.vocab_size))
            raise DataError(f"{files[doc.file_index]}: token {bad:,} is id {int(ids[bad - begin])}, outside the "
                            f"tokenizer's vocabulary ({self.tokenizer.vocab_size}); the shard is corrupt")
        return ids.tolist()

    def tokens(self, file_index: int) -> np.memmap:
        if file_index not in self._tokens:
            path = self.manifest.token_files[file_index]
            self._tokens[file_index] = np.memmap(path, dtype=self.manifest.dtype, mode="r") \
                if path.stat().st_size else np.zeros(0, self.manifest.dtype)
        return self._tokens[file_index]

    def offsets(self, file_index: int) -> np.ndarray:
        """The shard's document boundaries, checked to rise from 0 to its token count."""
        if file_index not in self._offsets:
            path = self.manifest.token_files[file_index].with_suffix(OFFSETS_SUFFIX)
            offsets = np.fromfile(path, dtype=OFFSETS_DTYPE)
            tokens = int(self.manifest.shards[file_index]["tokens"])
            rising = len(offsets) > 0 and offsets[0] == 0 and offsets[-1] == tokens
            if not rising or np.any(np.diff(offsets.astype(np.int64)) < 0):
                raise DataError(f"{path}: document boundaries do not rise from 0 to the shard's {tokens:,} tokens; "
                                "the shard is corrupt")
            self._offsets[file_index] = offsets
        return self._offsets[file_index]
