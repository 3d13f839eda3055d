"""Tokenizer and a resumable, data-parallel token-window loader.

Every document becomes [BOS] + tokens + [EOS]; documents are concatenated, in file order and
epoch after epoch, into one global token stream, which is cut into consecutive windows of
`seq_len + 1` tokens. Each global micro-batch is the next `local_batch_size * dp_world_size`
windows, dealt to ranks in contiguous blocks of `local_batch_size`. Every rank follows the whole
stream, so the loader state (the position of the next unread token) is global: identical on all
ranks, and valid for any split of the same global micro-batch into ranks.

Following the stream takes the token length of every document, but a rank needs the tokens of
only the documents its own windows hold. So the ranks of the job count lengths together, in
rounds: the next documents, about what the micro-batch still lacks, are shared out (each to the
rank whose share of the micro-batch it is expected to fall in, by the tokens per byte so far);
each rank tokenizes its own and keeps the tokens, and the ranks all-gather the lengths over a
gloo group (`components.distributed.shared_gloo_group`). Then each rank tokenizes what its own
windows need and it does not hold already. A rank thus tokenizes about 1/world of the documents
plus its replica's share (1/dp, mostly the same documents), not all of them. Documents counted
but not yet consumed carry over to the next micro-batch. Every decision rests on lengths and
sizes all ranks know, so they all make the same ones, and a document that cannot be read is
reported in the same exchange: every rank raises the same DataError (naming file:line) when the
stream reaches it, after the same batches as a single loader. Without a process group, with one
rank, or with the fake group of job.simulate_world_size, one process counts everything itself.
"""

from __future__ import annotations

import codecs
import json
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import sentencepiece as spm
import torch
import torch.distributed as dist

from components.distributed import shared_gloo_group
from components.errors import UserError

TEXT_SUFFIXES = (".txt", ".jsonl")

# How much of each file check_text_files reads before training: all of a small file, the start
# of a large one, so the check stays a few seconds even for a corpus of many gigabytes.
SCAN_BYTES = 64 * 2**10


class DataError(UserError):
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


def find_text_files(dataset_path: str, key: str = "data.dataset_path") -> list[Path]:
    """The .txt/.jsonl file at `dataset_path`, or all of them under that folder, sorted."""
    path = Path(dataset_path)
    if path.is_file():
        files = [path] if path.suffix in TEXT_SUFFIXES else []
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    else:
        raise DataError(f"{key}: no file or folder at '{dataset_path}'")
    if not files:
        raise DataError(f"{key}: no .txt or .jsonl file at or under '{dataset_path}'")
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


class _RawDoc(NamedTuple):
    """A document found but not yet read: its start, its size in bytes (what every rank knows of
    it before anyone tokenizes it), and its line if it is one of a .jsonl file (None for a .txt
    file, read by whichever rank tokenizes it)."""

    start: _DocStart
    size: int
    line: bytes | None


class _Counted(NamedTuple):
    """A document whose token length every rank knows."""

    index: int  # its place in the stream, counting from where the loader was built or loaded
    raw: _RawDoc
    length: int


class TokenWindowLoader:
    """Streams documents, packs tokens into windows of seq_len + 1, deals windows to
    data-parallel ranks.

    Iterating yields (inputs, labels), both int64 [local_batch_size, seq_len], forever; each
    `iter()` continues where the loader stands. `state_dict()` is the global stream position.

    With a process group (and `cooperate`), every rank of the job must iterate its loader alike:
    they count document lengths together over `exchange_group` (module docstring).
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
        cooperate: bool = True,
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
        # The ranks that count lengths together: every rank of the job (None: this process alone).
        # Whoever iterates the loader from another thread gives it a group of its own (prefetch.py).
        self.exchange_group = shared_gloo_group("data") if cooperate else None
        self._seek(_DocStart(epoch=0, file_index=0))

    def _seek(self, start: _DocStart) -> None:
        """Forget everything read; the next document is the first one from `start` on."""
        self._raw = self._documents(start)  # documents not counted yet
        self._raw_next: _RawDoc | None = None  # the first of them, once peeked at
        self._counted: deque[_Counted] = deque()  # counted, not yet reached by the cursor
        # What reading the document after the counted ones raised: raised when the stream gets there.
        self._failure: tuple[_DocStart, BaseException] | None = None
        self._next_index = 0
        self._units: dict[int, Any] = {}  # tokens this rank has, by stream index
        # Totals over the documents counted: tokens per byte estimates the lengths of the next ones.
        self._counted_docs = self._counted_tokens = self._counted_bytes = 0
        # The cursor: the next unread token is token `pos` of the current document (a fresh
        # loader's is an empty placeholder before the first document).
        self._current = _Counted(-1, _RawDoc(start, 0, None), 0)
        self._pos = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (inputs, labels) forever, continuing from the current state."""
        window = self.seq_len + 1
        before = self.dp_rank * self.local_batch_size * window
        ours_size = self.local_batch_size * window
        after = (self.dp_world_size - self.dp_rank - 1) * self.local_batch_size * window
        while True:
            self._count_ahead(self._batch_tokens())
            ours: list[int] = []
            self._advance(before)
            self._advance(ours_size, out=ours)
            self._advance(after)
            self._forget_before(self._current.index)
            windows = torch.tensor(ours, dtype=torch.int64).view(self.local_batch_size, window)
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        doc = self._current.raw.start
        return {
            "epoch": doc.epoch,
            "file_index": doc.file_index,
            "byte_offset": doc.byte_offset,
            "line_number": doc.line_number,
            "token_offset": self._pos,
        }

    def load_state_dict(self, state: dict) -> None:
        """Seek to the saved document (without reading what precedes it) and token within it.
        Every rank tokenizes that one document (it needs no exchange, so loading is local)."""
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
        raw = next(docs)
        tokens = self._build(raw)
        if state["token_offset"] > len(tokens):
            raise DataError(
                f"data loader state: token_offset {state['token_offset']} is past the end of the "
                f"{len(tokens)}-token document at {self._where(raw.start)}; has the dataset changed?"
            )
        self._seek(start)
        self._raw, self._next_index = docs, 1
        self._current, self._pos = _Counted(0, raw, len(tokens)), state["token_offset"]
        self._units[0] = tokens
        self._count(raw, len(tokens))

    # -- the cursor -------------------------------------------------------------------------

    def _count_ahead(self, n: int) -> None:
        """Count documents until the lengths known cover the next n tokens of the stream (or
        reach a document that could not be read)."""
        available = self._current.length - self._pos + sum(c.length for c in self._counted)
        while available < n and self._failure is None:
            known = len(self._counted)
            self._count_round(n - available, offset=available)
            available += sum(c.length for c in list(self._counted)[known:])

    def _advance(self, n: int, out: list[int] | None = None) -> None:
        """Consume the next n tokens of the stream, appending them to `out` if given: only then
        are the documents' tokens needed, not just their lengths."""
        while n > 0:
            if self._pos == self._current.length:
                self._current, self._pos = self._peek_counted(n, offset=0), 0
                self._counted.popleft()
            take = min(n, self._current.length - self._pos)
            if out is not None:
                out += self._unit(self._current)[self._pos : self._pos + take]
            self._pos += take
            n -= take

    # -- counting lengths together ----------------------------------------------------------

    def _peek_counted(self, tokens: int, offset: int) -> _Counted:
        """The next counted document, counting more (a round for `tokens` tokens, starting
        `offset` tokens into the global micro-batch) if none is left. Raises what reading a
        document raised once the stream reaches that document, as the single loader did."""
        while not self._counted:
            if self._failure is not None:
                raise self._failure[1]
            self._count_round(tokens, offset)
        return self._counted[0]

    def _count_round(self, tokens: int, offset: int) -> None:
        """One round: each rank tokenizes its share of the next documents (about `tokens` tokens'
        worth; their tokens are kept), and the ranks exchange the lengths, or the error that
        stopped them, so that every rank learns the same lengths and raises the same error.
        Every decision depends only on sizes and lengths all ranks know."""
        rank, world = self._exchange_rank()
        raws = self._next_raws(tokens, world)
        owners = self._owners(raws, offset, world)
        first = self._next_index
        mine = [(first + i, raw) for i, (raw, owner) in enumerate(zip(raws, owners)) if owner == rank]
        lengths, error = self._count_block(mine)
        reports = self._exchange((lengths, None if error is None else (type(error).__name__, str(error))))
        reported = [iter(owner_lengths) for owner_lengths, _ in reports]
        for i, (raw, owner) in enumerate(zip(raws, owners)):
            length = next(reported[owner], None)
            if length is None:  # its owner could not read it: the stream ends here, for now
                failure = error if owner == rank else _failure_elsewhere(owner, reports[owner][1])
                self._failure = (raw.start, failure)
                break
            self._counted.append(_Counted(first + i, raw, length))
            self._count(raw, length)
        self._next_index = first + len(raws)

    def _count(self, raw: _RawDoc, length: int) -> None:
        self._counted_docs += 1
        self._counted_tokens += length
        self._counted_bytes += raw.size + 1  # + 1: an empty file still holds BOS and EOS

    def _next_raws(self, tokens: int, world: int) -> list[_RawDoc]:
        """The next documents to count: one per rank at first, then enough for about `tokens`
        tokens by the tokens per byte so far, and an eighth more (so one round mostly suffices);
        at most twice as many as counted so far, while the estimate rests on few documents."""
        if not self._counted_docs:
            return [self._next_raw() for _ in range(world)]
        wanted_bytes = -(-tokens * self._counted_bytes * 9 // (self._counted_tokens * 8))
        raws = [self._next_raw()]
        size = raws[0].size + 1
        while size < wanted_bytes and len(raws) < 2 * self._counted_docs + world:
            raws.append(self._next_raw())
            size += raws[-1].size + 1
        return raws

    def _owners(self, raws: list[_RawDoc], offset: int, world: int) -> list[int]:
        """The rank that counts each document, the first starting `offset` tokens into the global
        micro-batch: the rank in whose share of a micro-batch (rank g of world: tokens
        [g, g + 1) * size / world) the document is expected to start, by tokens per byte.
        Data-parallel ranks come in rank order and the ranks of one replica split its windows
        (parallel_dims: dp is the outer mesh dim), so a rank mostly counts documents its own
        windows hold, and has their tokens already. Before anything is counted: one each."""
        if not self._counted_docs:
            return list(range(len(raws)))
        owners, before = [], 0  # bytes before the document, in this round
        scale, tokens, size = self._counted_bytes, self._counted_tokens, self._batch_tokens()
        for raw in raws:
            owners.append((offset * scale + before * tokens) * world // (size * scale) % world)
            before += raw.size + 1
        return owners

    def _batch_tokens(self) -> int:
        """Tokens in one global micro-batch."""
        return self.local_batch_size * self.dp_world_size * (self.seq_len + 1)

    def _count_block(self, docs: list[tuple[int, _RawDoc]]) -> tuple[list[int], Exception | None]:
        """Lengths of these documents (by stream index; their tokens are kept), up to the first
        that cannot be read, and what reading it raised."""
        lengths = []
        for index, raw in docs:
            try:
                unit = self._build(raw)
            except Exception as error:  # noqa: BLE001 - every rank must hear of it, or they wait forever
                return lengths, error
            self._units[index] = unit
            lengths.append(self._length(unit))
        return lengths, None

    def _exchange_rank(self) -> tuple[int, int]:
        group = self.exchange_group
        return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)

    def _exchange(self, report: Any) -> list[Any]:
        """Every rank's report, in rank order (just this one without a group)."""
        if self.exchange_group is None:
            return [report]
        reports: list[Any] = [None] * dist.get_world_size(self.exchange_group)
        dist.all_gather_object(reports, report, group=self.exchange_group)
        return reports

    def _unit(self, counted: _Counted) -> Any:
        """The document's tokens: kept from counting, or read and tokenized now."""
        unit = self._units.get(counted.index)
        if unit is None:
            unit = self._units[counted.index] = self._build(counted.raw)
        return unit

    def _forget_before(self, index: int) -> None:
        """Drop the tokens of documents the cursor has passed."""
        for passed in [i for i in self._units if i < index]:
            del self._units[passed]

    # -- reading documents ------------------------------------------------------------------

    def _build(self, raw: _RawDoc) -> Any:
        """What the loader keeps of a document: its tokens (PackedSampleLoader: a Sample)."""
        return self.tokenizer.encode(self._read(raw))

    def _length(self, unit: Any) -> int:
        return len(unit)

    def _read(self, raw: _RawDoc) -> Any:
        """The document's text (PackedSampleLoader: its record): a .txt file, or a .jsonl line."""
        if raw.line is None:
            path = self.files[raw.start.file_index]
            return _decode_utf8(path.read_bytes(), str(path), final=True)
        return self._parse_jsonl_line(raw.line, raw.start)

    def _peek_raw(self) -> _RawDoc:
        if self._raw_next is None:
            self._raw_next = next(self._raw)
        return self._raw_next

    def _next_raw(self) -> _RawDoc:
        raw = self._peek_raw()
        self._raw_next = None
        return raw

    def _documents(self, start: _DocStart) -> Iterator[_RawDoc]:
        """Every document from `start` on, looping over the files forever. Finding them reads
        the .jsonl lines but parses nothing: that is left to the rank that tokenizes them."""
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

    def _file_documents(self, start: _DocStart) -> Iterator[_RawDoc]:
        """The documents of one file, from `start` on."""
        path = self.files[start.file_index]
        if path.suffix == ".txt":
            yield _RawDoc(start, path.stat().st_size, None)
            return
        offset, line_number = start.byte_offset, start.line_number
        with path.open("rb") as f:
            f.seek(offset)
            for line in f:
                doc = _DocStart(start.epoch, start.file_index, offset, line_number)
                offset, line_number = offset + len(line), line_number + 1
                if line.strip():
                    yield _RawDoc(doc, len(line), line)

    def _parse_jsonl_line(self, line: bytes, doc: _DocStart) -> str:
        return parse_jsonl_record(line, self.text_field, self._where(doc))

    def _where(self, doc: _DocStart) -> str:
        path = self.files[doc.file_index]
        return f"{path}:{doc.line_number}" if path.suffix == ".jsonl" else str(path)


def _failure_elsewhere(rank: int, error: tuple[str, str]) -> Exception:
    """The error another rank reported: a DataError is raised here as the same DataError; any other
    failure (a bug, not the data) as a RuntimeError naming that rank, which raises the original."""
    kind, message = error
    if kind == DataError.__name__:
        return DataError(message)
    return RuntimeError(f"data loader: rank {rank} failed reading a document ({kind}: {message})")


def build_dataloader(
    cfg_data_path: str,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    text_field: str = "text",
    cooperate: bool = True,
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
        cooperate=cooperate,
    )
