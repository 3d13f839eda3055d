"""How a list of sequences to complete is cut into batches: longest prompts first (less left
padding), each batch bounded by its rows (max_batch_sequences) and its KV cache's slots, rows x
(longest prompt + max_completion_length) (max_batch_tokens)."""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(lengths: Sequence[int], max_completion_length: int, max_batch_sequences: int | None = None,
                 max_batch_tokens: int | None = None) -> list[list[int]]:
    """The indices of `lengths` (prompt lengths of the sequences) in batches, each batch's rows
    sorted longest first; every sequence in exactly one batch. A sequence that alone exceeds
    max_batch_tokens gets a batch of its own (the caller refuses it first)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and _fits(batches[-1], lengths, max_completion_length, max_batch_sequences, max_batch_tokens):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _fits(batch: list[int], lengths: Sequence[int], max_completion_length: int, max_batch_sequences: int | None,
          max_batch_tokens: int | None) -> bool:
    """Whether one more row (no longer than the batch's first) keeps the batch within both bounds."""
    rows = len(batch) + 1
    if max_batch_sequences is not None and rows > max_batch_sequences:
        return False
    return max_batch_tokens is None or rows * (lengths[batch[0]] + max_completion_length) <= max_batch_tokens
