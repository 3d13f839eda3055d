"""Prompt rows (data.format = prompts), what online RL samples from: JSONL (compressed or not),
Parquet or Arrow rows, each with a `prompt` (a string, continued after BOS, or chat messages,
rendered with the tokenizer's template and its generation prompt) and any other columns, which
reach the reward functions by name.

`PromptRounds` deals them out: generation round r takes the next `round_prompts` rows of an endless
stream of epochs, each epoch the rows in an order drawn from (seed, epoch); each optimizer step takes
`micro_batches` items, every one naming its round, so every rank and every restart sees the same
rounds. Prompt sets are small (thousands of rows): they are read and encoded once, whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weft.components.data import sources
from weft.components.data.errors import DataError
from weft.components.data.files import decode_utf8
from weft.components.data.prompts import encode_prompt, prompt_of


@dataclass(frozen=True)
class PromptRow:
    """One row: its prompt as the file holds it, the prompt's token ids, its other columns, and
    where it is (file:line, or file:row N)."""

    prompt: str | list[dict[str, Any]]
    token_ids: list[int]
    columns: dict[str, Any]
    where: str


def read_prompt_rows(files: list[Path], tokenizer: Any) -> list[PromptRow]:
    """Every row of `files`, checked and encoded, in file order; a DataError names the first bad one."""
    rows = []
    for path in files:
        for where, record in _records(path):
            value = prompt_of(record, where)
            encoded = encode_prompt(value, tokenizer, where)
            rows.append(PromptRow(value, encoded.token_ids, {k: v for k, v in record.items() if k != "prompt"}, where))
    if not rows:
        raise DataError(f"data.dataset_path: no prompt rows in {', '.join(map(str, files))}; expected records "
                        "with a 'prompt'")
    return rows


def _records(path: Path):
    """(file:line or file:row N, record) of every record of one file."""
    if sources.is_columnar(path):
        names = sources.read_schema(path).names
        if "prompt" not in names:
            raise DataError(f"{path}: no 'prompt' column (it has {', '.join(names)}); data.format = prompts "
                            "reads a 'prompt' per row")
        for index, record in sources.rows(path, 0, None):
            yield f"{path}:row {index}", record
        return
    try:
        data = sources.read_decompressed(path) if sources.is_compressed(path) else path.read_bytes()
    except OSError as err:
        raise DataError(f"data.dataset_path: cannot read {path}: {err.strerror}") from None
    text = decode_utf8(data, str(path), final=True)
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}:{number}: expected a line of JSON ({err})") from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise DataError(f"{path}:{number}: expected a JSON object with a 'prompt' (data.format = prompts)")
        yield f"{path}:{number}", record


@dataclass(frozen=True)
class RoundItem:
    """One micro-step's item: the generation round it belongs to (its prompts, each with its place in
    the stream, which seeds its completions) and which step of the round and micro-step it is."""

    round: int
    prompts: list[tuple[int, PromptRow]]
    step_in_round: int
    micro: int

    def to(self, device: Any, non_blocking: bool = False) -> RoundItem:
        return self  # prompts stay on the host; the objective places what it builds from them


@dataclass
class PromptRounds:
    """The training stream of prompt rounds (the loader of data.format = prompts); its state is the
    number of micro-step items taken, which a checkpoint saves."""

    rows: list[PromptRow]
    round_prompts: int  # prompts a generation round samples
    steps_per_round: int  # optimizer steps one round serves (steps_per_generation x num_iterations)
    micro_batches: int  # items per optimizer step (gradient_accumulation_steps)
    seed: int = 0
    taken: int = 0
    _orders: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __iter__(self) -> PromptRounds:
        return self

    def __next__(self) -> RoundItem:
        step, micro = divmod(self.taken, self.micro_batches)
        round_, step_in_round = divmod(step, self.steps_per_round)
        self.taken += 1
        return RoundItem(round_, self.round_rows(round_), step_in_round, micro)

    def round_rows(self, round_: int) -> list[tuple[int, PromptRow]]:
        """The prompts of round `round_`: (stream position, row)."""
        start = round_ * self.round_prompts
        return [(i, self.rows[self._order(i // len(self.rows))[i % len(self.rows)]])
                for i in range(start, start + self.round_prompts)]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=generator).tolist()}
        return self._orders[epoch]

    def state_dict(self) -> dict[str, int]:
        return {"prompt_items": self.taken}

    def load_state_dict(self, state: dict) -> None:
        if "prompt_items" not in state:
            raise DataError("checkpoint: its data position is not a prompt stream's (data.format = prompts); "
                            "resume from a checkpoint of an online RL run")
        self.taken = int(state["prompt_items"])

    def check_records(self) -> int:
        return len(self.rows)

    def close(self) -> None:
        pass
