"""The cooperative cursor: where the global document stream stands, and the documents ahead of it
whose token lengths every rank knows, counted by the ranks together.

The ranks share out the next documents in rounds, each tokenizes its own and the lengths are
all-gathered over a gloo group, so a rank tokenizes about 1/world of the documents plus its
replica's share rather than all of them; every decision rests on lengths all ranks know, so a bad
document raises the same DataError on every rank. Without a group one process counts everything.
What a document becomes (a text's tokens, a record's `Sample`) is the strategy's (docs/data.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from weft.components.data.errors import DataError
from weft.components.data.files import DocStart, RawDoc, documents


class Counted(NamedTuple):
    """A document whose token length every rank knows."""

    index: int  # its place in the stream, counting from where the cursor was built or sought
    raw: RawDoc
    length: int


class Cursor:
    """The documents of `files` from a start on: counted ahead together with the other ranks of
    `group` (passed to each call that may count), consumed in order by a strategy.

    `build(raw)` reads and tokenizes a document into its unit, `length(unit)` is its token count;
    `batch_tokens` is the tokens of one global micro-batch, which shares the counting out;
    `columns`, those of a Parquet/Arrow row that a document's unit is built from (None: all);
    `source(files, start, columns)` lists the documents from a start on (by default `files.documents`).
    """

    def __init__(self, files: list[Path], build: Callable[[RawDoc], Any], length: Callable[[Any], int],
                 batch_tokens: int, columns: tuple[str, ...] | None = None,
                 source: Callable[..., Iterator[RawDoc]] = documents) -> None:
        self.files, self.build, self.length, self.batch_tokens = files, build, length, batch_tokens
        self.columns, self.source = columns, source
        self.seek(DocStart(epoch=0, file_index=0))

    def seek(self, start: DocStart, opened: tuple[RawDoc, Any, Iterator[RawDoc]] | None = None) -> None:
        """Forget everything read; the next document is the first one from `start` on, or, with
        `opened` (from `open(start)`), the one after it, `opened` itself counted as document 0."""
        self._raw = self.source(self.files, start, self.columns)  # documents not counted yet
        self._raw_next: RawDoc | None = None  # the first of them, once peeked at
        self.counted: deque[Counted] = deque()  # counted, not yet taken by the strategy
        # What reading the document after the counted ones raised: raised when the stream gets there.
        self.failure: tuple[DocStart, BaseException] | None = None
        self.next_index = 0  # stream index of the next document to count
        self._units: dict[int, Any] = {}  # what this rank built, by stream index
        # Totals over the documents counted: tokens per byte estimates the lengths of the next ones.
        self._counted_docs = self._counted_tokens = self._counted_bytes = 0
        if opened is not None:
            raw, unit, self._raw = opened
            self.next_index, self._units[0] = 1, unit
            self._count(raw, self.length(unit))

    def open(self, start: DocStart) -> tuple[RawDoc, Any, Iterator[RawDoc]]:
        """Read and build the document at `start` (no exchange: every rank does it), without
        moving: what `seek(start, opened)` continues from."""
        docs = self.source(self.files, start, self.columns)
        raw = next(docs)
        return raw, self.build(raw), docs

    def next_start(self) -> DocStart:
        """Where the first document not yet taken starts."""
        if self.counted:
            return self.counted[0].raw.start
        return self.failure[0] if self.failure is not None else self._peek_raw().start

    # -- taking counted documents ------------------------------------------------------------

    def peek(self, tokens: int, offset: int, group: dist.ProcessGroup | None) -> Counted:
        """The next counted document, counting more (a round for `tokens` tokens, starting
        `offset` tokens into the global micro-batch) if none is left. Raises what reading a
        document raised once the stream reaches that document, as a single loader would."""
        while not self.counted:
            if self.failure is not None:
                raise self.failure[1]
            self._count_round(tokens, offset, group)
        return self.counted[0]

    def count_ahead(self, tokens: int, held: int, group: dist.ProcessGroup | None) -> None:
        """Count documents until the lengths known, with the `held` tokens before them, cover
        `tokens` tokens (or reach a document that could not be read)."""
        available = held + sum(c.length for c in self.counted)
        while available < tokens and self.failure is None:
            known = len(self.counted)
            self._count_round(tokens - available, available, group)
            available += sum(c.length for c in list(self.counted)[known:])

    def unit(self, counted: Counted) -> Any:
        """The document's unit: kept from counting, or read and built now."""
        unit = self._units.get(counted.index)
        if unit is None:
            unit = self._units[counted.index] = self.build(counted.raw)
        return unit

    def forget_before(self, index: int) -> None:
        """Drop the units of documents before stream index `index`."""
        for passed in [i for i in self._units if i < index]:
            del self._units[passed]

    # -- counting lengths together -----------------------------------------------------------

    def _count_round(self, tokens: int, offset: int, group: dist.ProcessGroup | None) -> None:
        """One round: each rank builds its share of the next documents (about `tokens` tokens'
        worth; the units are kept), and the ranks exchange the lengths, or the error that
        stopped them, so that every rank learns the same lengths and raises the same error.
        Every decision depends only on sizes and lengths all ranks know."""
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        raws = self._next_raws(tokens, world)
        owners = self._owners(raws, offset, world)
        first = self.next_index
        mine = [(first + i, raw) for i, (raw, owner) in enumerate(zip(raws, owners)) if owner == rank]
        lengths, error = self._count_block(mine)
        reports = _exchange(group, (lengths, None if error is None else (type(error).__name__, str(error))))
        reported = [iter(owner_lengths) for owner_lengths, _ in reports]
        for i, (raw, owner) in enumerate(zip(raws, owners)):
            length = next(reported[owner], None)
            if length is None:  # its owner could not read it: the stream ends here, for now
                failure = error if owner == rank else _failure_elsewhere(owner, reports[owner][1])
                self.failure = (raw.start, failure)
                break
            self.counted.append(Counted(first + i, raw, length))
            self._count(raw, length)
        self.next_index = first + len(raws)

    def _count(self, raw: RawDoc, length: int) -> None:
        self._counted_docs += 1
        self._counted_tokens += length
        self._counted_bytes += raw.size + 1  # + 1: an empty file still holds BOS and EOS

    def _next_raws(self, tokens: int, world: int) -> list[RawDoc]:
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

    def _owners(self, raws: list[RawDoc], offset: int, world: int) -> list[int]:
        """The rank that counts each document, the first starting `offset` tokens into the global
        micro-batch: the rank in whose share of a micro-batch (rank g of world: tokens
        [g, g + 1) * size / world) the document is expected to start, by tokens per byte.
        Data-parallel ranks come in rank order and the ranks of one replica split its windows
        (parallel_dims: dp is the outer mesh dim), so a rank mostly counts documents its own
        windows hold, and has their units already. Before anything is counted: one each."""
        if not self._counted_docs:
            return list(range(len(raws)))
        owners, before = [], 0  # bytes before the document, in this round
        scale, tokens, size = self._counted_bytes, self._counted_tokens, self.batch_tokens
        for raw in raws:
            owners.append((offset * scale + before * tokens) * world // (size * scale) % world)
            before += raw.size + 1
        return owners

    def _count_block(self, docs: list[tuple[int, RawDoc]]) -> tuple[list[int], Exception | None]:
        """Lengths of these documents (by stream index; their units are kept), up to the first
        that cannot be read, and what reading it raised."""
        lengths = []
        for index, raw in docs:
            try:
                unit = self.build(raw)
            except Exception as error:  # noqa: BLE001 - every rank must hear of it, or they wait forever
                return lengths, error
            self._units[index] = unit
            lengths.append(self.length(unit))
        return lengths, None

    def _peek_raw(self) -> RawDoc:
        if self._raw_next is None:
            self._raw_next = next(self._raw)
        return self._raw_next

    def _next_raw(self) -> RawDoc:
        raw = self._peek_raw()
        self._raw_next = None
        return raw


def _exchange(group: dist.ProcessGroup | None, report: Any) -> list[Any]:
    """Every rank's report, in rank order (just this one without a group)."""
    if group is None:
        return [report]
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    return reports


def _failure_elsewhere(rank: int, error: tuple[str, str]) -> Exception:
    """The error another rank reported: a DataError is raised here as the same DataError; any other
    failure (a bug, not the data) as a RuntimeError naming that rank, which raises the original."""
    kind, message = error
    if kind == DataError.__name__:
        return DataError(message)
    return RuntimeError(f"data loader: rank {rank} failed reading a document ({kind}: {message})")
