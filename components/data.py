"""Tokenizer and a resumable, data-parallel token-window loader.

Every document becomes [BOS] + tokens + [EOS]; documents are concatenated, in file order and
epoch after epoch, into one global token stream, which is cut into consecutive windows of
`seq_len + 1` tokens. Each global micro-batch is the next `local_batch_size * dp_world_size`
windows, dealt to ranks in contiguous blocks of `local_batch_size`. Every rank reads the whole
stream, so the loader state (the position of the next unread token) is global: identical on
all ranks, and valid for any split of the same global micro-batch into ranks.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch

TEXT_SUFFIXES = (".txt", ".jsonl")

# How much of each file check_text_files reads before training: all of a small file, the start
# of a large one, so the check stays a few seconds even for a corpus of many gigabytes.
SCAN_BYTES = 64 * 2**10


class DataError(ValueError):
    """A dataset or tokenizer problem; the message names the path or value and what was expected."""


class Tokenizer:
    """A SentencePiece model with BOS/EOS handling."""

    def __init__(self, path: str | os.PathLike) -> None:
        if not Path(path).is_file():
            raise DataError(f"model.tokenizer_path: no tokenizer file at '{path}'")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=os.fspath(path))
        except (OSError, RuntimeError) as err:
            raise DataError(f"model.tokenizer_path: '{path}' is not a SentencePiece model") from err
        self.vocab_size: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise DataError(f"model.tokenizer_path: '{path}' defines no BOS or no EOS token")

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids: list[int] = self._sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


def find_text_files(dataset_path: str) -> list[Path]:
    """The .txt/.jsonl file at `dataset_path`, or all of them under that folder, sorted."""
    path = Path(dataset_path)
    if path.is_file():
        files = [path] if path.suffix in TEXT_SUFFIXES else []
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    else:
        raise DataError(f"data.dataset_path: no file or folder at '{dataset_path}'")
    if not files:
        raise DataError(f"data.dataset_path: no .txt or .jsonl file at or under '{dataset_path}'")
    return files


def _line_of(data: bytes, offset: int) -> int:
    """1-based line number of byte `offset` in `data`."""
    return data[:offset].count(b"\n") + 1


def _decode_utf8(data: bytes, where: str, final: bool, *, one_line: bool = False) -> str:
    """`data` as UTF-8 text, or a DataError naming `where`:line (`where` alone if `one_line`:
    it names the line already). A NUL byte means binary data. With `final` False the data is a
    prefix, and a character cut at its end is not an error."""
    def at(offset: int) -> str:
        return where if one_line else f"{where}:{_line_of(data, offset)}"

    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{at(nul)}: a NUL byte; this looks like a binary file, not text")
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as err:
        raise DataError(f"{at(err.start)}: expected UTF-8 text (byte {data[err.start]:#04x}: {err.reason})") from None


def parse_jsonl_record(line: bytes, text_field: str, where: str) -> str:
    """The text of one JSONL line: a JSON object whose `text_field` is a string."""
    text = _decode_utf8(line, where, final=True, one_line=True)
    try:
        record = json.loads(text)
    except ValueError as err:
        raise DataError(f"{where}: expected a line of JSON ({err})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise DataError(f"{where}: expected a JSON object with a text field '{text_field}'")
    return record[text_field]


def check_text_files(files: list[Path], text_field: str = "text") -> None:
    """Check the first SCAN_BYTES of every file before anything is written, so that the common
    mistakes (a binary file, another encoding, a broken or foreign JSONL record) stop the run
    at once, naming file:line. Blank JSONL lines are skipped, as the loader skips them.

    Raises DataError also when every file was read whole and no document holds any text (the
    model would learn only BOS and EOS). Problems beyond the scanned prefix are reported, with
    file:line, when the loader reaches them.
    """
    any_text, read_whole = False, True
    for path in files:
        try:
            with path.open("rb") as f:
                data = f.read(SCAN_BYTES + 1)
        except OSError as err:
            raise DataError(f"data.dataset_path: cannot read {path}: {err.strerror}") from None
        whole = len(data) <= SCAN_BYTES
        data, read_whole = data[:SCAN_BYTES], read_whole and whole
        if path.suffix == ".txt":
            text = _decode_utf8(data, str(path), final=whole)
            any_text = any_text or bool(text.strip())
            continue
        lines = data.split(b"\n")
        if not whole:
            lines = lines[:-1]  # the last line may be cut by the prefix
        for number, line in enumerate(lines, start=1):
            if line.strip():
                text = parse_jsonl_record(line, text_field, f"{path}:{number}")
                any_text = any_text or bool(text.strip())
    if read_whole and not any_text:
        raise DataError(f"data.dataset_path: every document in {len(files)} file(s) is empty; nothing to train on")


@dataclass(frozen=True)
class _DocStart:
    """Where a document starts: a whole .txt file, or one line of a .jsonl file."""

    epoch: int
    file_index: int
    byte_offset: int = 0  # of the document's line in a .jsonl file; 0 for a .txt file
    line_number: int = 1  # 1-based, for error messages


class TokenWindowLoader:
    """Streams documents, packs tokens into windows of seq_len + 1, deals windows to
    data-parallel ranks.

    Iterating yields (inputs, labels), both int64 [local_batch_size, seq_len], forever; each
    `iter()` continues where the loader stands. `state_dict()` is the global stream position.
    """

    def __init__(
        self,
        files: list[Path],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        text_field: str = "text",
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
        if not files:
            raise DataError("data.dataset_path: no .txt or .jsonl files to read")
        for path in files:
            if Path(path).suffix not in TEXT_SUFFIXES:
                raise DataError(f"data.dataset_path: '{path}' is not a .txt or .jsonl file")
        self.files = [Path(path) for path in files]
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.text_field = text_field

        # The cursor: the next unread token is tokens[pos] of the document starting at `doc`, and
        # `docs` yields the documents after it. A fresh loader sits before the first document.
        self._docs = self._documents(_DocStart(epoch=0, file_index=0))
        self._doc = _DocStart(epoch=0, file_index=0)
        self._tokens: list[int] = []
        self._pos = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (inputs, labels) forever, continuing from the current state."""
        window = self.seq_len + 1
        before = self.dp_rank * self.local_batch_size * window
        after = (self.dp_world_size - self.dp_rank - 1) * self.local_batch_size * window
        while True:
            ours: list[int] = []
            self._advance(before)
            self._advance(self.local_batch_size * window, out=ours)
            self._advance(after)
            windows = torch.tensor(ours, dtype=torch.int64).view(self.local_batch_size, window)
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._doc.epoch,
            "file_index": self._doc.file_index,
            "byte_offset": self._doc.byte_offset,
            "line_number": self._doc.line_number,
            "token_offset": self._pos,
        }

    def load_state_dict(self, state: dict) -> None:
        """Seek to the saved document (without reading what precedes it) and token within it."""
        keys = ("epoch", "file_index", "byte_offset", "line_number", "token_offset")
        ints = all(type(state.get(k)) is int and state[k] >= 0 for k in keys)
        if set(state) != set(keys) or not ints:
            raise DataError(f"data loader state: expected non-negative ints {keys}, got {state!r}")
        if state["file_index"] >= len(self.files):
            raise DataError(
                f"data loader state: file_index {state['file_index']} is out of range for "
                f"{len(self.files)} files"
            )
        start = _DocStart(
            state["epoch"], state["file_index"], state["byte_offset"], state["line_number"]
        )
        docs = self._documents(start)
        doc, text = next(docs)
        tokens = self.tokenizer.encode(text)
        if state["token_offset"] > len(tokens):
            raise DataError(
                f"data loader state: token_offset {state['token_offset']} is past the end of the "
                f"{len(tokens)}-token document at {self._where(doc)}; has the dataset changed?"
            )
        self._docs, self._doc, self._tokens, self._pos = docs, doc, tokens, state["token_offset"]

    def _advance(self, n: int, out: list[int] | None = None) -> None:
        """Consume the next n tokens of the stream, appending them to `out` if given."""
        while n > 0:
            if self._pos == len(self._tokens):
                self._doc, text = next(self._docs)
                self._tokens, self._pos = self.tokenizer.encode(text), 0
            take = min(n, len(self._tokens) - self._pos)
            if out is not None:
                out += self._tokens[self._pos : self._pos + take]
            self._pos += take
            n -= take

    def _documents(self, start: _DocStart) -> Iterator[tuple[_DocStart, str]]:
        """Every document from `start` on, looping over the files forever."""
        while True:
            from_beginning = start.file_index == 0 and start.byte_offset == 0
            found = False
            for file_index in range(start.file_index, len(self.files)):
                at = start if file_index == start.file_index else _DocStart(start.epoch, file_index)
                for doc in self._file_documents(at):
                    found = True
                    yield doc
            if from_beginning and not found:
                raise DataError(f"data.dataset_path: no documents in {len(self.files)} file(s)")
            start = _DocStart(start.epoch + 1, file_index=0)

    def _file_documents(self, start: _DocStart) -> Iterator[tuple[_DocStart, str]]:
        """The documents of one file, from `start` on."""
        path = self.files[start.file_index]
        if path.suffix == ".txt":
            yield start, _decode_utf8(path.read_bytes(), str(path), final=True)
            return
        offset, line_number = start.byte_offset, start.line_number
        with path.open("rb") as f:
            f.seek(offset)
            for line in f:
                doc = _DocStart(start.epoch, start.file_index, offset, line_number)
                offset, line_number = offset + len(line), line_number + 1
                if line.strip():
                    yield doc, self._parse_jsonl_line(line, doc)

    def _parse_jsonl_line(self, line: bytes, doc: _DocStart) -> str:
        return parse_jsonl_record(line, self.text_field, self._where(doc))

    def _where(self, doc: _DocStart) -> str:
        path = self.files[doc.file_index]
        return f"{path}:{doc.line_number}" if path.suffix == ".jsonl" else str(path)


def build_dataloader(
    cfg_data_path: str,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    text_field: str = "text",
) -> TokenWindowLoader:
    """The loader over every text file found at `data.dataset_path`."""
    return TokenWindowLoader(
        find_text_files(cfg_data_path),
        tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        text_field=text_field,
    )
