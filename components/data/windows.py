"""Text windows, the loader's strategy for `data.format = "text"`.

Every document becomes [BOS] + tokens + [EOS]; documents are concatenated, in file order and
epoch after epoch, into one global token stream, which is cut into consecutive windows of
`seq_len + 1` tokens. Each global micro-batch is the next `local_batch_size * dp_world_size`
windows, dealt to ranks in contiguous blocks of `local_batch_size`. The state is the position of
the next unread token (the document it lies in, and the offset within it): global, identical on
all ranks, and valid for any split of the same global micro-batch into ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weft.components.data.batch import Batch, BatchShape
from weft.components.data.cursor import Counted, Cursor
from weft.components.data.errors import DataError
from weft.components.data.files import (
    STATE_KEYS,
    DocStart,
    RawDoc,
    check_suffixes,
    documents,
    position_state,
    read_text,
    where,
)


class TextWindows:
    """Packs the token stream into windows of seq_len + 1; a window's inputs are its first
    seq_len tokens, its labels the last seq_len."""

    truncated = dropped = 0  # a document is never cut or skipped, only split across windows

    def __init__(self, tokenizer: Any, *, text_field: str = "text") -> None:
        self.tokenizer, self.text_field = tokenizer, text_field
        self.columns = (text_field,)
        # The next token is token `_pos` of document `_current`; before the first document, an
        # empty placeholder at the stream's start (so the state points there).
        self._current = Counted(-1, RawDoc(DocStart(epoch=0, file_index=0), 0, None), 0)
        self._pos = 0

    documents = staticmethod(documents)  # the files' documents (components/data/files.py)

    def check_files(self, files: list[Path]) -> None:
        """Any data file holds text documents."""
        check_suffixes(files)

    def check_records(self, files: list[Path]) -> int:
        raise TypeError("text windows are checked by components.data.check_text_files, not record by record")

    def batch_tokens(self, shape: BatchShape) -> int:
        """Tokens of the stream in one global micro-batch."""
        return shape.rows * (shape.seq_len + 1)

    def build(self, files: list[Path], raw: RawDoc) -> list[int]:
        """A document's tokens."""
        return self.tokenizer.encode(read_text(files, raw, self.text_field))

    def length(self, tokens: list[int]) -> int:
        return len(tokens)

    def batches(self, cursor: Cursor, shape: BatchShape, group: dist.ProcessGroup | None) -> Iterator[Batch]:
        """This rank's windows of each global micro-batch, forever, as Batch(inputs, labels)."""
        window = shape.seq_len + 1
        before = shape.dp_rank * shape.local_batch_size * window
        ours_size = shape.local_batch_size * window
        after = (shape.dp_world_size - shape.dp_rank - 1) * shape.local_batch_size * window
        while True:
            cursor.count_ahead(self.batch_tokens(shape), self._current.length - self._pos, group)
            ours: list[int] = []
            self._advance(cursor, before, group)
            self._advance(cursor, ours_size, group, out=ours)
            self._advance(cursor, after, group)
            cursor.forget_before(self._current.index)
            windows = torch.tensor(ours, dtype=torch.int64).view(shape.local_batch_size, window)
            yield Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def _advance(self, cursor: Cursor, n: int, group: dist.ProcessGroup | None, out: list[int] | None = None) -> None:
        """Consume the next n tokens of the stream, appending them to `out` if given: only then
        are the documents' tokens needed, not just their lengths."""
        while n > 0:
            if self._pos == self._current.length:
                self._current, self._pos = cursor.peek(n, 0, group), 0
                cursor.counted.popleft()
            take = min(n, self._current.length - self._pos)
            if out is not None:
                out += cursor.unit(self._current)[self._pos : self._pos + take]
            self._pos += take
            n -= take

    def state_dict(self, cursor: Cursor) -> dict[str, int]:
        return position_state(self._current.raw.start, self._pos)

    def load_state_dict(self, cursor: Cursor, state: dict) -> None:
        """Seek to the saved document (without reading what precedes it) and token within it.
        Every rank tokenizes that one document (it needs no exchange, so loading is local)."""
        ints = all(type(state.get(k)) is int and state[k] >= 0 for k in STATE_KEYS)
        if set(state) != set(STATE_KEYS) or not ints:
            raise DataError(f"data loader state: expected non-negative ints {STATE_KEYS}, got {state!r}")
        if state["file_index"] >= len(cursor.files):
            raise DataError(f"data loader state: file_index {state['file_index']} is out of range for "
                            f"{len(cursor.files)} files")
        start = DocStart(state["epoch"], state["file_index"], state["byte_offset"], state["line_number"])
        opened = cursor.open(start)
        raw, tokens, _ = opened
        if state["token_offset"] > len(tokens):
            raise DataError(
                f"data loader state: token_offset {state['token_offset']} is past the end of the "
                f"{len(tokens)}-token document at {where(cursor.files, raw.start)}; has the dataset changed?"
            )
        cursor.seek(start, opened)
        self._current, self._pos = Counted(0, raw, len(tokens)), state["token_offset"]
