"""Preference pairs, the loader's strategy for `data.format = "preference"`.

A record is `{prompt, chosen, rejected}`: all strings, or all lists of chat messages (no `prompt`:
chosen and rejected are whole conversations whose messages before the last assistant turn are the
prompt). Each answer is tokenized as TRL 1.16's DPOTrainer does (`answer_sample`): prompt (with the
generation prompt) and prompt + answer are tokenized whole, and the answer starts where the two id
lists diverge. A pair fills two rows of a batch, chosen then rejected, padded to seq_len; only the
answers' tokens are supervised (`labels`); `row_labels` holds every token's, the prompt's too
(ORPO's NLL term reads the chosen rows').
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weft.components.data import sources
from weft.components.data.batch import Batch, BatchShape
from weft.components.data.cursor import Cursor
from weft.components.data.errors import DataError
from weft.components.data.files import DocStart, documents, file_documents, named, record_of, where
from weft.components.data.formats import CHAT_ROLES, Sample, parse_record
from weft.components.data.packing import PackedSamples
from weft.components.training.loss import IGNORE_INDEX

TRUNCATION = ("keep_start", "keep_end", "drop")
FIELDS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """A record's two rows: token ids with, per token, whether it is supervised (the answer's);
    `fits` False: no truncation rule can fit it in a row (it is skipped and counted)."""

    chosen: Sample
    rejected: Sample
    fits: bool = True
    truncated: bool = False


def check_preference_record(record: Any, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen answer, rejected answer): three strings, or three lists of messages."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise DataError(f"{where}: expected a JSON object with 'chosen' and 'rejected' (and 'prompt')")
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        return prompt, chosen, rejected
    if not all(isinstance(v, list) for v in (chosen, rejected)) or not isinstance(prompt, list | None):
        raise DataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all lists of chat "
                        "messages ('prompt' may be left out of conversations)")
    for key, messages in (("prompt", prompt or []), ("chosen", chosen), ("rejected", rejected)):
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                    or message.get("role") not in CHAT_ROLES:
                raise DataError(f"{where}: {key}[{i}] must be a message {{'role': one of {', '.join(CHAT_ROLES)}, "
                                "'content': a string}")
    if prompt is None:  # whole conversations: the prompt is what precedes the last assistant turn
        prompt, chosen = split_conversation(chosen, "chosen", where)
        prompt_r, rejected = split_conversation(rejected, "rejected", where)
        if prompt != prompt_r:
            raise DataError(f"{where}: chosen and rejected have different prompts (the messages before their last "
                            "assistant turn); a preference pair compares two answers to one prompt")
    if not chosen or not rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' must each hold at least one message")
    return prompt, chosen, rejected


def split_conversation(messages: list, key: str, where: str) -> tuple[list, list]:
    """(the messages before the trailing assistant turn, that turn) of a whole conversation."""
    if not messages or messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: '{key}' must end with an assistant message when the record has no 'prompt'")
    return messages[:-1], messages[-1:]


def answer_sample(prompt: Any, answer: Any, tokenizer: Any) -> tuple[Sample, int]:
    """The row of prompt + answer and where its answer starts: the first id where the prompt's
    ids and prompt + answer's ids differ, as TRL 1.16's DPOTrainer tokenizes them. Strings: the
    answer gets the EOS token's text if it does not end with it, and both get the special tokens the
    tokenizer itself adds (`encode_plain`); chat: the template's ids, the prompt's with the
    generation prompt, nothing added."""
    if isinstance(prompt, str):
        eos = getattr(tokenizer, "eos_token", None)  # a SentencePiece model has no EOS text: its id is appended
        text = prompt + answer + (eos if eos is not None and not answer.endswith(eos) else "")
        prompt_ids, ids = tokenizer.encode_plain(prompt), tokenizer.encode_plain(text)
        if eos is None and (not ids or ids[-1] != tokenizer.eos_id):
            ids.append(tokenizer.eos_id)
    else:
        prompt_ids = tokenizer.encode_chat(prompt, add_generation_prompt=True)
        ids = tokenizer.encode_chat(prompt + answer)
    start = 0
    while start < min(len(ids), len(prompt_ids)) and ids[start] == prompt_ids[start]:
        start += 1
    return Sample(ids, [i >= start for i in range(len(ids))]), start


def preference_pair(record: Any, tokenizer: Any, where: str, *, max_tokens: int, truncation: str) -> Pair:
    """A record's pair, each row at most `max_tokens` ids (seq_len + 1) by `truncation`: keep_start
    cuts the answers' ends, keep_end cuts the prompt's start (by what the longer row is over),
    drop keeps no pair that is too long. A pair no rule fits (keep_start: the prompt alone fills the
    row; keep_end: an answer alone does) comes back with fits False."""
    prompt, chosen, rejected = check_preference_record(record, where)
    if not isinstance(prompt, str) and not hasattr(tokenizer, "render_chat"):
        raise DataError(f"{where}: chat messages need a Hugging Face tokenizer folder with a chat template "
                        "(model.tokenizer_path); a SentencePiece model has none")
    (c, c_start), (r, r_start) = answer_sample(prompt, chosen, tokenizer), answer_sample(prompt, rejected, tokenizer)
    if c.tokens[:c_start] != r.tokens[:r_start]:
        raise DataError(f"{where}: chosen and rejected tokenize to different prompts (the prompt's last tokens merge "
                        "with the answers'); a preference pair compares two answers to one prompt")
    if c_start in (len(c.tokens), 0) or r_start in (len(r.tokens), 0):
        raise DataError(f"{where}: an answer adds no token to the prompt (or the prompt none before it)")
    longest = max(len(c.tokens), len(r.tokens))
    if longest <= max_tokens:
        return Pair(c, r)
    if truncation == "keep_start" and c_start < max_tokens:
        return Pair(*(Sample(s.tokens[:max_tokens], s.supervised[:max_tokens]) for s in (c, r)), truncated=True)
    cut = longest - max_tokens
    if truncation == "keep_end" and cut < c_start:
        return Pair(*(Sample(s.tokens[cut:], s.supervised[cut:]) for s in (c, r)), truncated=True)
    return Pair(c, r, fits=False)


class PreferencePairs(PackedSamples):
    """Batches of pairs: `local_batch_size` pairs per rank, as 2 × local_batch_size rows (chosen,
    rejected, chosen, ...) of seq_len inputs, padded (label IGNORE_INDEX), with `row_labels`. Pairs that do not fit are
    skipped and counted (`dropped`), cut ones counted (`truncated`); state and files as PackedSamples."""

    def __init__(self, tokenizer: Any, *, seq_len: int, truncation: str = "keep_start") -> None:
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
        super().__init__(tokenizer, data_format="chat")
        self.data_format, self.columns = "preference", FIELDS
        self.seq_len, self.truncation = seq_len, truncation

    def batch_tokens(self, shape: BatchShape) -> int:
        return 2 * shape.rows * shape.seq_len

    def build(self, files: list[Path], raw) -> Pair:
        record = record_of(files, raw, parse_record)
        return preference_pair(record, self.tokenizer, where(files, raw.start), max_tokens=self.seq_len + 1,
                               truncation=self.truncation)

    def length(self, pair: Pair) -> int:
        """What every rank decides from (one rank built the pair): its longer row's ids (at most
        seq_len + 1), plus seq_len + 1 for a truncated pair, and for one that does not fit (its
        rows whole, so more than 2 × (seq_len + 1) in all: `needs` reads its seq_len back)."""
        cut = pair.truncated or not pair.fits
        return max(len(pair.chosen.tokens), len(pair.rejected.tokens)) + cut * (self.seq_len + 1)

    def needs(self, length: int) -> int | None:
        """The seq_len a pair of this `length` would need whole, if it does not fit (else None)."""
        return length - self.seq_len - 2 if length > 2 * (self.seq_len + 1) else None

    def batches(self, cursor: Cursor, shape: BatchShape, group: dist.ProcessGroup | None) -> Iterator[Batch]:
        """Batch(inputs, labels, row_labels=...), each [2 × local_batch_size, seq_len], forever."""
        first = shape.dp_rank * shape.local_batch_size
        skipped: list[tuple[DocStart, int]] = []  # (start, seq_len needed) of the pairs dropped in a row
        while True:
            taken = []
            while len(taken) < shape.rows:
                counted = cursor.peek(self.batch_tokens(shape) - 2 * len(taken) * shape.seq_len,
                                      2 * len(taken) * shape.seq_len, group)
                cursor.counted.popleft()
                if self.needs(counted.length) is not None:
                    self._skip(skipped, counted.raw.start, self.needs(counted.length), cursor.files)
                    continue
                skipped.clear()
                self.truncated += counted.length > shape.seq_len + 1
                taken.append(counted)
            rows = [self._row(sample, shape.seq_len)
                    for counted in taken[first:first + shape.local_batch_size]
                    for sample in (cursor.unit(counted).chosen, cursor.unit(counted).rejected)]
            cursor.forget_before(cursor.counted[0].index if cursor.counted else cursor.next_index)
            inputs, labels, row_labels = (torch.tensor([row[i] for row in rows], dtype=torch.int64) for i in range(3))
            yield Batch(inputs, labels, row_labels=row_labels)

    def _skip(self, skipped: list[tuple[DocStart, int]], doc: DocStart, needs: int, files: list[Path]) -> None:
        """Count a dropped pair; once the pairs dropped in a row reach the first of them again an
        epoch on, every pair is dropped, and training would wait forever for one: a DataError."""
        first = skipped[0][0] if skipped else doc
        if doc.epoch > first.epoch and (doc.file_index, doc.byte_offset, doc.line_number) >= (
                first.file_index, first.byte_offset, first.line_number):
            least, most = min(n for _, n in skipped), max(n for _, n in skipped)
            raise DataError(f"{named(files)}: all {len(skipped)} pairs dropped: none fits training.seq_len = "
                            f"{self.seq_len} under preference.truncation = '{self.truncation}' (whole, they need "
                            f"seq_len {least}{'' if least == most else f' to {most}'})")
        self.dropped += 1
        skipped.append((doc, needs))

    def check_records(self, files: list[Path]) -> int:
        """Every JSONL record checked (of a Parquet/Arrow file, its footer's columns), the first
        one built; the records counted."""
        count = 0
        for index, path in enumerate(files):
            if sources.is_columnar(path):
                schema, rows = sources.read_footer(path)
                if not {"chosen", "rejected"} <= set(schema.names):
                    raise DataError(f"data.format = 'preference': {path} needs columns 'chosen' and 'rejected' (and "
                                    f"'prompt'); its columns: {sources.describe_columns(schema)}")
                count += rows or 0
                continue
            for raw in file_documents(files, DocStart(epoch=0, file_index=index), self.columns):
                check_preference_record(record_of(files, raw, parse_record), where(files, raw.start))
                count += 1
        self.build(files, next(documents(files, DocStart(epoch=0, file_index=0), self.columns)))
        return count

    def _row(self, sample: Sample, seq_len: int) -> tuple[list[int], list[int], list[int]]:
        """Inputs, labels (the answer's tokens) and row labels (every token's), padded to seq_len."""
        inputs = sample.tokens[:-1]
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(sample.tokens[1:], sample.supervised[1:])]
        padding = seq_len - len(inputs)
        return (inputs + [self.pad_id] * padding, labels + [IGNORE_INDEX] * padding,
                sample.tokens[1:] + [IGNORE_INDEX] * padding)
