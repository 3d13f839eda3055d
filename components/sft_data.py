"""Supervised fine-tuning data: chat and prompt/completion records, loss masks, and packing.

A record becomes a sample: its token ids and, for each token, whether the model is trained to
predict it (assistant turns, or the completion, each with its closing end-of-turn / EOS token;
never the prompt). Samples are packed whole, in file order, into windows of `seq_len` inputs;
each keeps its own positions (0, 1, ... from its first token) and a document id of its own, so
attention can be block-causal (models/llama/model.py), and the rest of a window is padding that
supervises nothing. A sample longer than a window is cut to `seq_len + 1` tokens (`truncate`) or
skipped (`drop`); either is counted and logged.

`PackedSampleLoader` keeps the contract of the text loader (components/data.py): every rank
plans the same global sequence of windows and takes its block of each global micro-batch, and
the state is the position of the next unconsumed record, identical on all ranks, so a run can
resume mid-epoch in any data-parallel layout. Planning needs only each sample's token count,
which the ranks count together as the text loader counts document lengths; a rank builds the
samples (tokens and supervision) of its own windows only.

Labels are shifted inputs; a label of IGNORE_INDEX (-100) marks a token that is not supervised.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from components.data import DataError, TokenWindowLoader, _Counted, _DocStart, _RawDoc
from components.loss import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "Batch", "PackedSampleLoader", "Sample", "batches", "build_loader", "chat_sample",
           "document_layout", "prompt_completion_sample"]

CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython")
FORMATS = ("text", "chat", "prompt_completion")


class Batch(NamedTuple):
    """One micro-batch: inputs and labels [batch, seq]; with packing also each token's position in
    its document and its document id (else None: one causal sequence)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        """The batch on `device`; `non_blocking` copies from pinned memory without waiting for them
        (the step's kernels queue behind them on the device)."""
        return Batch(*(None if t is None else t.to(device, non_blocking=non_blocking) for t in self))

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, which CUDA copies asynchronously."""
        return Batch(*(None if t is None else t.pin_memory() for t in self))


@dataclass(frozen=True)
class Sample:
    """Token ids and, per token, whether it is a training target."""

    tokens: list[int]
    supervised: list[bool]


# ---------------------------------------------------------------------------------------------
# Records → samples
# ---------------------------------------------------------------------------------------------


def chat_sample(record: Any, tokenizer: Any, where: str) -> Sample:
    """A `{"messages": [{"role", "content"}, ...]}` record rendered with the tokenizer's chat
    template; the tokens of assistant turns (their content and end-of-turn token) are supervised.

    An assistant turn spans from the end of the conversation before it rendered with the
    generation prompt, to the end of the conversation up to and including it. Tokens are mapped to
    those character spans through the tokenizer's offsets, so the ids are exactly those of the
    whole rendered conversation (what `apply_chat_template` returns).
    """
    messages = check_chat_record(record, where)
    if not hasattr(tokenizer, "render_chat"):
        raise DataError("data.format = 'chat' needs a Hugging Face tokenizer folder with a chat template "
                        "(model.tokenizer_path); a SentencePiece model has none")
    text = tokenizer.render_chat(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        end = tokenizer.render_chat(messages[: i + 1])
        if not (text.startswith(start) and text.startswith(end)):
            raise DataError(f"{where}: the chat template renders a conversation's beginning differently from "
                            "the whole conversation, so assistant turns cannot be located")
        spans.append((len(start), len(end)))
    ids, offsets = tokenizer.encode_with_offsets(text)
    supervised = [any(s <= begin < e for s, e in spans) for begin, _ in offsets]
    return Sample(ids, supervised)


def check_chat_record(record: Any, where: str) -> list[dict[str, Any]]:
    """The record's messages, checked: known roles, string contents, at least one assistant turn."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a JSON object with a non-empty list 'messages'")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must be an object with a string 'content'")
        if message.get("role") not in CHAT_ROLES:
            raise DataError(f"{where}: messages[{i}] has unknown role {message.get('role')!r}; "
                            f"expected one of {', '.join(CHAT_ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to learn")
    return messages


def prompt_completion_sample(record: Any, tokenizer: Any, where: str) -> Sample:
    """`{"prompt", "completion"}` (or Alpaca's `instruction`, optional `input`, `output`) as
    [BOS] prompt completion [EOS]; the completion and EOS are supervised."""
    prompt, completion = check_prompt_completion_record(record, where)
    prompt_ids = tokenizer.encode(prompt, bos=True, eos=False)
    completion_ids = tokenizer.encode(completion, bos=False, eos=True)
    return Sample(prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids))


def check_prompt_completion_record(record: Any, where: str) -> tuple[str, str]:
    """(prompt, completion) of a prompt/completion or Alpaca record, checked."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        prompt, completion = record["prompt"], record["completion"]
    elif isinstance(record, dict) and isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"{where}: 'input' must be a string")
        prompt = record["instruction"] + (f"\n\n{extra}" if extra else "") + "\n\n"
        completion = record["output"]
    else:
        raise DataError(f"{where}: expected a JSON object with string fields 'prompt' and 'completion' "
                        "(or 'instruction' and 'output')")
    return prompt, completion


_SAMPLE_BUILDERS = {"chat": chat_sample, "prompt_completion": prompt_completion_sample}
_RECORD_CHECKS = {"chat": check_chat_record, "prompt_completion": check_prompt_completion_record}


def document_layout(inputs: torch.Tensor, bos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids of packed text windows, where each document starts with BOS.

    Positions restart at 0 at every BOS; a window's tokens before its first BOS (the tail of a
    document begun in an earlier window) count from 0 at the window start.
    """
    index = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    is_start = inputs == bos_id
    starts = torch.where(is_start, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - starts, is_start.long().cumsum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Packing loader
# ---------------------------------------------------------------------------------------------


class PackedSampleLoader(TokenWindowLoader):
    """Packs chat or prompt/completion samples into windows; yields `Batch`es forever.

    Samples go whole into the current window while they fit, in record order; the window is then
    padded (pad token, label IGNORE_INDEX, a document id of its own). The state is the position of
    the next record not yet placed in a window.

    Which samples fill which window depends only on their token counts, which the ranks count
    together as the text loader counts document lengths (a record is the unit here); a rank then
    builds the samples of its own windows only, mostly ones it built while counting.
    """

    def __init__(
        self,
        files: list[Path],
        tokenizer: Any,
        *,
        data_format: str,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        long_samples: str = "truncate",
        cooperate: bool = True,
    ) -> None:
        super().__init__(files, tokenizer, seq_len=seq_len, local_batch_size=local_batch_size,
                         dp_rank=dp_rank, dp_world_size=dp_world_size, cooperate=cooperate)
        if data_format not in _SAMPLE_BUILDERS:
            raise ValueError(f"data_format must be one of {sorted(_SAMPLE_BUILDERS)}, got {data_format!r}")
        if long_samples not in ("truncate", "drop"):
            raise ValueError(f"long_samples must be 'truncate' or 'drop', got {long_samples!r}")
        for path in self.files:
            if path.suffix != ".jsonl":
                raise DataError(f"data.dataset_path: '{path}' is not a .jsonl file, which data.format = "
                                f"'{data_format}' reads")
        self.data_format = data_format
        self.long_samples = long_samples
        self.pad_id = getattr(tokenizer, "pad_id", None)
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_id
        self.truncated = 0  # samples cut to fit a window, since this loader was built
        self.dropped = 0  # samples skipped as too long

    def __iter__(self) -> Iterator[Batch]:
        """Yield Batch(inputs, labels, positions, document_ids), each [local_batch_size, seq_len]."""
        first = self.dp_rank * self.local_batch_size
        n_windows = self.local_batch_size * self.dp_world_size
        while True:
            plans = [self._plan_window(w * self.seq_len) for w in range(n_windows)]
            ours = [self._fill_window(plan) for plan in plans[first : first + self.local_batch_size]]
            self._forget_before(self._counted[0].index if self._counted else self._next_index)
            yield Batch(*(torch.tensor([w[i] for w in ours], dtype=torch.int64) for i in range(4)))

    def state_dict(self) -> dict[str, int]:
        if self._counted:
            doc = self._counted[0].raw.start
        else:
            doc = self._failure[0] if self._failure is not None else self._peek_raw().start
        return {"epoch": doc.epoch, "file_index": doc.file_index, "byte_offset": doc.byte_offset,
                "line_number": doc.line_number, "token_offset": 0}

    def load_state_dict(self, state: dict) -> None:
        """Seek to the saved record, without reading what precedes it."""
        keys = ("epoch", "file_index", "byte_offset", "line_number", "token_offset")
        ints = all(type(state.get(k)) is int and state[k] >= 0 for k in keys)
        if set(state) != set(keys) or not ints or state["token_offset"] != 0:
            raise DataError(f"data loader state: expected non-negative ints {keys} with token_offset 0, got {state!r}")
        if state["file_index"] >= len(self.files):
            raise DataError(f"data loader state: file_index {state['file_index']} is out of range for "
                            f"{len(self.files)} files")
        self._seek(_DocStart(state["epoch"], state["file_index"], state["byte_offset"], state["line_number"]))

    def check_records(self) -> int:
        """Read every record once before training, so a bad one fails at start-up (naming its
        file:line) rather than hours in; the first is also tokenized, which checks the chat
        template. Returns the number of records."""
        count = 0
        for raw in self._documents(_DocStart(epoch=0, file_index=0)):
            if raw.start.epoch > 0:
                break
            if count == 0:
                self._build(raw)
            _RECORD_CHECKS[self.data_format](self._read(raw), self._where(raw.start))
            count += 1
        return count

    def _parse_jsonl_line(self, line: bytes, doc: _DocStart) -> Any:  # the record, not a text field
        try:
            return json.loads(line)
        except ValueError as err:
            raise DataError(f"{self._where(doc)}: expected a line of JSON ({err})") from err

    def _build(self, raw: _RawDoc) -> Sample:
        return _SAMPLE_BUILDERS[self.data_format](self._read(raw), self.tokenizer, self._where(raw.start))

    def _length(self, sample: Sample) -> int:
        return len(sample.tokens)

    def _batch_tokens(self) -> int:
        return self.local_batch_size * self.dp_world_size * self.seq_len

    def _plan_window(self, offset: int) -> list[tuple[_Counted, int]]:
        """The samples of the next window, each with how many of its tokens it keeps (a sample of
        more than seq_len + 1 tokens is cut to that many), decided from token counts alone;
        samples too long to keep are dropped here. The window starts `offset` input slots into
        the global micro-batch (which tells how much is left to count, and who counts it)."""
        plan: list[tuple[_Counted, int]] = []
        filled = 0  # input slots taken
        first_dropped: _DocStart | None = None  # start of a run of dropped samples
        while filled < self.seq_len:
            counted = self._peek_counted(self._batch_tokens() - offset - filled, offset + filled)
            doc = counted.raw.start
            too_long = counted.length - 1 > self.seq_len  # a sample of n tokens fills n - 1 input slots
            if too_long and self.long_samples == "drop":
                first_dropped = first_dropped or doc
                if doc.epoch > first_dropped.epoch and (doc.file_index, doc.byte_offset) >= (
                        first_dropped.file_index, first_dropped.byte_offset):
                    raise DataError(f"data.dataset_path: every sample is longer than training.seq_len + 1 = "
                                    f"{self.seq_len + 1} tokens; raise seq_len or set data.long_samples = 'truncate'")
                self.dropped += 1
                self._counted.popleft()
                continue
            first_dropped = None
            kept = min(counted.length, self.seq_len + 1)
            if kept - 1 > self.seq_len - filled:
                break
            self._counted.popleft()
            self.truncated += too_long
            plan.append((counted, kept))
            filled += max(kept - 1, 0)
        return plan

    def _fill_window(self, plan: list[tuple[_Counted, int]]) -> tuple[list[int], list[int], list[int], list[int]]:
        """(inputs, labels, positions, document_ids) of a planned window, as lists of seq_len ints."""
        inputs: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        documents: list[int] = []
        for n_documents, (counted, kept) in enumerate(plan):
            sample = self._unit(counted)
            tokens, supervised = sample.tokens[:kept], sample.supervised[:kept]
            length = len(tokens) - 1
            inputs += tokens[:-1]
            labels += [t if keep else IGNORE_INDEX for t, keep in zip(tokens[1:], supervised[1:])]
            positions += range(length)
            documents += [n_documents] * length
        padding = self.seq_len - len(inputs)
        documents += [len(plan)] * padding
        return (inputs + [self.pad_id] * padding, labels + [IGNORE_INDEX] * padding,
                positions + list(range(padding)), documents)


# ---------------------------------------------------------------------------------------------
# What the recipe calls
# ---------------------------------------------------------------------------------------------


def build_loader(
    data_format: str,
    files: list[Path],
    tokenizer: Any,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    text_field: str = "text",
    long_samples: str = "truncate",
    cooperate: bool = True,
) -> TokenWindowLoader:
    """The text loader for format 'text', else a packing loader of chat / prompt_completion samples."""
    common = dict(seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
                  cooperate=cooperate)
    if data_format == "text":
        return TokenWindowLoader(files, tokenizer, text_field=text_field, **common)
    return PackedSampleLoader(files, tokenizer, data_format=data_format, long_samples=long_samples, **common)


def batches(loader: TokenWindowLoader, *, document_masking: bool = False) -> Iterator[Batch]:
    """The loader's micro-batches as `Batch`es, continuing from its state. Text windows get
    positions and document ids from their BOS tokens when `document_masking` is set."""
    if isinstance(loader, PackedSampleLoader):
        yield from loader
        return
    for inputs, labels in loader:
        if document_masking:
            yield Batch(inputs, labels, *document_layout(inputs, loader.tokenizer.bos_id))
        else:
            yield Batch(inputs, labels)
