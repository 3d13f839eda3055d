"""The loader: one class for every data format, which the format's strategy fills with batches,
and `build_loader`, the one factory train.py calls for training and validation data.

A loader streams its files' documents through the cooperative cursor and lets its strategy
(`TextWindows` for text, `PackedSamples` for records) build this rank's block of each global
micro-batch. `state_dict()` is a position in the global stream, identical on all ranks, so a run
resumes on exactly the next sample, also under another data-parallel degree. Every rank of the
job iterates its loader alike, over a gloo group (`exchange_group`, or the one given to `stream`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from weft.components.data.batch import Batch, BatchShape, document_layout
from weft.components.data.cursor import Cursor
from weft.components.data.files import DocStart, RawDoc
from weft.components.data.packing import PackedSamples
from weft.components.data.preference import PreferencePairs
from weft.components.data.prompt_rows import PromptRounds, read_prompt_rows
from weft.components.data.shards import ShardWindows, are_shards, check_shard_format, read_manifest
from weft.components.data.windows import TextWindows
from weft.components.distributed.processes import shared_gloo_group


class Strategy(Protocol):
    """How a loader turns documents into batches (TextWindows, PackedSamples, ShardWindows)."""

    tokenizer: Any
    columns: tuple[str, ...]  # the columns of a Parquet/Arrow row a document is read from
    truncated: int  # samples cut to fit a window so far
    dropped: int  # samples skipped as too long so far

    def check_files(self, files: list[Path]) -> None: ...  # DataError for a file it cannot read
    def documents(self, files: list[Path], start: DocStart, columns: tuple[str, ...] | None) -> Iterator[RawDoc]: ...
    def check_records(self, files: list[Path]) -> int: ...  # the records checked at start-up; their number
    def batch_tokens(self, shape: BatchShape) -> int: ...  # stream tokens in one global micro-batch
    def build(self, files: list[Path], raw: RawDoc) -> Any: ...  # a document's unit (tokens, Sample)
    def length(self, unit: Any) -> int: ...
    def batches(self, cursor: Cursor, shape: BatchShape, group: Any) -> Iterator[Batch]: ...
    def state_dict(self, cursor: Cursor) -> dict[str, int]: ...
    def load_state_dict(self, cursor: Cursor, state: dict) -> None: ...


class Loader:
    """This rank's micro-batches of the documents in `files`, made by `strategy`, for global
    micro-batches of `local_batch_size * dp_world_size` rows of `seq_len` tokens."""

    def __init__(self, files: list[Path], strategy: Strategy, *, seq_len: int, local_batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, exchange_group: dist.ProcessGroup | None = None) -> None:
        self.shape = BatchShape(seq_len, local_batch_size, dp_rank, dp_world_size)
        self.files = [Path(path) for path in files]
        strategy.check_files(self.files)
        self.strategy = strategy
        # The ranks that count lengths together when iterated: every rank of the job (None: alone).
        self.exchange_group = exchange_group
        self.cursor = Cursor(self.files, functools.partial(strategy.build, self.files), strategy.length,
                             strategy.batch_tokens(self.shape), strategy.columns, strategy.documents)

    @property
    def tokenizer(self) -> Any:
        return self.strategy.tokenizer

    @property
    def truncated(self) -> int:
        """Samples cut to fit a window since the loader was built."""
        return self.strategy.truncated

    @property
    def dropped(self) -> int:
        """Samples skipped as too long since the loader was built."""
        return self.strategy.dropped

    def __iter__(self) -> Iterator[Batch]:
        return self.stream(self.exchange_group)

    def stream(self, exchange_group: dist.ProcessGroup | None, *, document_masking: bool = False) -> Iterator[Batch]:
        """The batches from the current state on, forever, counting lengths with the ranks of
        `exchange_group` (every rank of the job, or None: alone). With `document_masking`, text
        windows get positions and document ids from their BOS tokens, or EOS ones where the tokenizer
        has no BOS (packed samples have them)."""
        for batch in self.strategy.batches(self.cursor, self.shape, exchange_group):
            if document_masking and batch.positions is None:
                batch = Batch(batch.inputs, batch.labels, *document_layout(batch.inputs, self.tokenizer.bos_id,
                                                                         self.tokenizer.eos_id))
            yield batch

    def state_dict(self) -> dict[str, int]:
        return self.strategy.state_dict(self.cursor)

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(self.cursor, state)

    def check_records(self) -> int:
        """Check the records (chat, prompt/completion; text is checked by `check_text_files`) so a
        bad one stops the run at start-up naming its file:line: every JSONL line, a Parquet/Arrow
        file's columns from its footer (PackedSamples.check_records); the number of records."""
        return self.strategy.check_records(self.files)


def batches(loader: Loader, *, document_masking: bool = False) -> Iterator[Batch]:
    """The loader's micro-batches, continuing from its state; with `document_masking`, text
    windows get positions and document ids from their BOS tokens."""
    return loader.stream(loader.exchange_group, document_masking=document_masking)


def build_loader(
    data_format: str,
    files: list[Path],
    tokenizer: Any,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    text_field: str = "text",
    long_samples: str = "truncate",
    truncation: str = "keep_start",
    cooperate: bool = True,
) -> Loader:
    """The loader of `files` in `data_format`: text windows for 'text', else packed samples of chat
    or prompt/completion records, pairs of 'preference' records (cut by `truncation`). With `cooperate` (and a process group of more than one rank) it
    counts document lengths with every rank of the job. `files` that are the `.tokens` shards of a
    shard folder (components/data/shards.py) are read as text windows over their token ids."""
    if data_format == "prompts":  # online RL's prompt rows, read whole (recipe/objectives/grpo.py deals them out)
        return PromptRounds(read_prompt_rows(files, tokenizer), round_prompts=local_batch_size, steps_per_round=1,
                            micro_batches=1)
    if are_shards(files):
        check_shard_format(data_format)
        strategy: Strategy = ShardWindows(tokenizer, read_manifest(Path(files[0]).parent))
    elif data_format == "text":
        strategy = TextWindows(tokenizer, text_field=text_field)
    elif data_format == "preference":
        strategy = PreferencePairs(tokenizer, seq_len=seq_len, truncation=truncation)
    else:
        strategy = PackedSamples(tokenizer, data_format=data_format, long_samples=long_samples)
    return Loader(files, strategy, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                  dp_world_size=dp_world_size, exchange_group=shared_gloo_group("data") if cooperate else None)
