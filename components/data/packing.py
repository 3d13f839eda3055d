"""Packed samples, the loader's strategy for `data.format = "chat"` and `"prompt_completion"`.

Each record becomes a sample (formats.py); samples are packed whole, in file order, into windows of
`seq_len` inputs, each with its own positions and document id (block-causal attention), the rest
padding. A longer sample is cut (`truncate`) or skipped (`drop`), and counted. Which samples fill
which window depends only on token counts the ranks count together (cursor.py); the state is the
next record not yet placed, identical on all ranks, so a run resumes mid-epoch in any layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weft.components.data import sources
from weft.components.data.batch import Batch, BatchShape
from weft.components.data.cursor import Counted, Cursor
from weft.components.data.errors import DataError
from weft.components.data.files import (
    STATE_KEYS,
    DocStart,
    RawDoc,
    check_suffixes,
    documents,
    file_documents,
    is_plain_text,
    position_state,
    record_of,
    where,
)
from weft.components.data.formats import SAMPLE_FORMATS, Sample, parse_record
from weft.components.training.loss import IGNORE_INDEX

LONG_SAMPLES = ("truncate", "drop")


class PackedSamples:
    """Packs the samples of `data_format` records whole into windows, padded with the tokenizer's
    pad token (else EOS), label IGNORE_INDEX and a document id of their own."""

    def __init__(self, tokenizer: Any, *, data_format: str, long_samples: str = "truncate") -> None:
        if data_format not in SAMPLE_FORMATS:
            raise ValueError(f"data_format must be one of {sorted(SAMPLE_FORMATS)}, got {data_format!r}")
        if long_samples not in LONG_SAMPLES:
            raise ValueError(f"long_samples must be 'truncate' or 'drop', got {long_samples!r}")
        self.tokenizer, self.data_format, self.long_samples = tokenizer, data_format, long_samples
        self.format = SAMPLE_FORMATS[data_format]
        self.columns = self.format.fields
        self.pad_id = getattr(tokenizer, "pad_id", None)
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_id
        self.truncated = 0  # samples cut to fit a window, since this strategy was built
        self.dropped = 0  # samples skipped as too long

    documents = staticmethod(documents)  # the files' documents (components/data/files.py)

    def check_files(self, files: list[Path]) -> None:
        check_suffixes(files)
        for path in files:
            if is_plain_text(path):
                raise DataError(f"data.dataset_path: '{path}' is not a JSONL, Parquet or Arrow file, which "
                                f"data.format = '{self.data_format}' reads")

    def batch_tokens(self, shape: BatchShape) -> int:
        """Input slots in one global micro-batch."""
        return shape.rows * shape.seq_len

    def build(self, files: list[Path], raw: RawDoc) -> Sample:
        """A record's sample."""
        return self.format.sample(record_of(files, raw, parse_record), self.tokenizer, where(files, raw.start))

    def length(self, sample: Sample) -> int:
        return len(sample.tokens)

    def batches(self, cursor: Cursor, shape: BatchShape, group: dist.ProcessGroup | None) -> Iterator[Batch]:
        """Batch(inputs, labels, positions, document_ids), each [local_batch_size, seq_len], forever."""
        first = shape.dp_rank * shape.local_batch_size
        while True:
            plans = [self._plan_window(cursor, shape, w * shape.seq_len, group) for w in range(shape.rows)]
            ours = [self._fill_window(cursor, shape, plan) for plan in plans[first : first + shape.local_batch_size]]
            cursor.forget_before(cursor.counted[0].index if cursor.counted else cursor.next_index)
            yield Batch(*(torch.tensor([w[i] for w in ours], dtype=torch.int64) for i in range(4)))

    def state_dict(self, cursor: Cursor) -> dict[str, int]:
        return position_state(cursor.next_start(), 0)

    def load_state_dict(self, cursor: Cursor, state: dict) -> None:
        """Seek to the saved record, without reading what precedes it."""
        ints = all(type(state.get(k)) is int and state[k] >= 0 for k in STATE_KEYS)
        if set(state) != set(STATE_KEYS) or not ints or state["token_offset"] != 0:
            raise DataError(f"data loader state: expected non-negative ints {STATE_KEYS} with token_offset 0, "
                            f"got {state!r}")
        if state["file_index"] >= len(cursor.files):
            raise DataError(f"data loader state: file_index {state['file_index']} is out of range for "
                            f"{len(cursor.files)} files")
        cursor.seek(DocStart(state["epoch"], state["file_index"], state["byte_offset"], state["line_number"]))

    def check_records(self, files: list[Path]) -> int:
        """Check what start-up can afford to read, so a bad record fails before training (naming
        file:line) rather than hours in: every line of a JSONL file, but of a Parquet/Arrow file
        only its footer: the columns the format reads, of the right types (`SampleFormat.check_columns`),
        so a folder of thousands of files starts without reading their data pages; a bad value in
        a row is named `file row N` when the loader reaches it. The first record is also built
        (which checks the chat template); no record at all is an error. Returns the records
        counted: JSONL lines and Parquet rows (an Arrow file's are not in its footer)."""
        count = 0
        for index, path in enumerate(files):
            if sources.is_columnar(path):
                schema, rows = sources.read_footer(path)
                self.format.check_columns(schema, str(path))
                count += rows or 0
                continue
            for raw in file_documents(files, DocStart(epoch=0, file_index=index), self.columns):
                self.format.check(record_of(files, raw, parse_record), where(files, raw.start))
                count += 1
        self.build(files, next(documents(files, DocStart(epoch=0, file_index=0), self.columns)))
        return count

    def _plan_window(self, cursor: Cursor, shape: BatchShape, offset: int,
                     group: dist.ProcessGroup | None) -> list[tuple[Counted, int]]:
        """The samples of the next window, each with how many of its tokens it keeps (a sample of
        more than seq_len + 1 tokens is cut to that many), decided from token counts alone;
        samples too long to keep are dropped here. The window starts `offset` input slots into
        the global micro-batch (which tells how much is left to count, and who counts it)."""
        seq_len, plan = shape.seq_len, []
        filled = 0  # input slots taken
        first_dropped: DocStart | None = None  # start of a run of dropped samples
        while filled < seq_len:
            counted = cursor.peek(self.batch_tokens(shape) - offset - filled, offset + filled, group)
            doc = counted.raw.start
            too_long = counted.length - 1 > seq_len  # a sample of n tokens fills n - 1 input slots
            if too_long and self.long_samples == "drop":
                first_dropped = first_dropped or doc
                if doc.epoch > first_dropped.epoch and (doc.file_index, doc.byte_offset, doc.line_number) >= (
                        first_dropped.file_index, first_dropped.byte_offset, first_dropped.line_number):
                    raise DataError(f"data.dataset_path: every sample is longer than training.seq_len + 1 = "
                                    f"{seq_len + 1} tokens; raise seq_len or set data.long_samples = 'truncate'")
                self.dropped += 1
                cursor.counted.popleft()
                continue
            first_dropped = None
            kept = min(counted.length, seq_len + 1)
            if kept - 1 > seq_len - filled:
                break
            cursor.counted.popleft()
            self.truncated += too_long
            plan.append((counted, kept))
            filled += max(kept - 1, 0)
        return plan

    def _fill_window(self, cursor: Cursor, shape: BatchShape,
                     plan: list[tuple[Counted, int]]) -> tuple[list[int], list[int], list[int], list[int]]:
        """(inputs, labels, positions, document_ids) of a planned window, as lists of seq_len ints."""
        inputs: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        document_ids: list[int] = []
        for n_documents, (counted, kept) in enumerate(plan):
            sample = cursor.unit(counted)
            tokens, supervised = sample.tokens[:kept], sample.supervised[:kept]
            length = len(tokens) - 1
            inputs += tokens[:-1]
            labels += [t if keep else IGNORE_INDEX for t, keep in zip(tokens[1:], supervised[1:])]
            positions += range(length)
            document_ids += [n_documents] * length
        padding = shape.seq_len - len(inputs)
        document_ids += [len(plan)] * padding
        return (inputs + [self.pad_id] * padding, labels + [IGNORE_INDEX] * padding,
                positions + list(range(padding)), document_ids)
