"""What a loader yields: one `Batch` per micro-batch, whatever the data format, and the shape of
the global micro-batch it is this rank's block of (`BatchShape`).

Text windows carry inputs and labels alone (one causal sequence per row) unless document masking
gives them positions and document ids from their BOS tokens, or EOS ones where the tokenizer has
none (`document_layout`); packed samples
always carry both. Labels are the inputs shifted by one; IGNORE_INDEX (-100, components/training/loss.py) marks a
token that is not supervised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class Batch(NamedTuple):
    """One micro-batch: inputs and labels [batch, seq]; with packing also each token's position in
    its document and its document id (else None: one causal sequence). Preference pairs also carry
    `row_labels`: every next token of a row, the prompt's too (`labels` has only the answer's)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    row_labels: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        """The batch on `device`; `non_blocking` copies from pinned memory without waiting for them
        (the step's kernels queue behind them on the device)."""
        return Batch(*(None if t is None else t.to(device, non_blocking=non_blocking) for t in self))

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, which CUDA copies asynchronously."""
        return Batch(*(None if t is None else t.pin_memory() for t in self))


@dataclass(frozen=True)
class BatchShape:
    """A global micro-batch of `local_batch_size * dp_world_size` rows of `seq_len` inputs, dealt
    to data-parallel ranks in contiguous blocks of `local_batch_size` rows: this rank's is block
    `dp_rank`."""

    seq_len: int
    local_batch_size: int
    dp_rank: int = 0
    dp_world_size: int = 1

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {self.local_batch_size}")
        if not 0 <= self.dp_rank < self.dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_world_size}), got {self.dp_rank}")

    @property
    def rows(self) -> int:
        """Rows of the global micro-batch."""
        return self.local_batch_size * self.dp_world_size


def document_layout(inputs: torch.Tensor, bos_id: int | None, eos_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids of packed text windows, where each document starts with BOS, or
    (a tokenizer without BOS, `bos_id` None) right after the EOS that ends the one before.

    Positions restart at 0 at every document start; a window's tokens before its first start (the
    tail of a document begun in an earlier window) count from 0 at the window start.
    """
    index = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    if bos_id is not None:
        is_start = inputs == bos_id
    else:
        if eos_id is None:
            raise ValueError("document_layout needs bos_id, or eos_id where the tokenizer has no BOS")
        is_start = torch.zeros_like(inputs, dtype=torch.bool)
        is_start[..., 1:] = inputs[..., :-1] == eos_id
    starts = torch.where(is_start, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - starts, is_start.long().cumsum(dim=-1)
