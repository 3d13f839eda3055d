"""Weighted mixtures (`data.mixture`): several sources, each a loader of its own, drawn from in
proportion to their weights.

A *draw* gives every data-parallel rank the next window of one source; a rank's micro-batch is
`local_batch_size` consecutive draws. Which source each draw takes follows the tokens drawn so far
by Tijdeman's rule for the chairman assignment problem (R. Tijdeman, 1980), the same on every rank.
The state is every source's loader state and tokens drawn, so a resume, also under another
data-parallel degree, continues each source exactly. The bounds the rule keeps: docs/data.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weft.components.data.batch import Batch
from weft.components.data.errors import DataError
from weft.components.data.files import TEXT_SUFFIXES

# Characters kept in a source's name (its path's last part): the name appears in metric names.
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class MixtureEntry:
    """One `data.mixture` entry: a source's path, weight and the name its metrics go by."""

    name: str
    path: str
    weight: float


def parse_mixture(entries: list[str], key: str = "data.mixture") -> list[MixtureEntry]:
    """`PATH:WEIGHT` entries as MixtureEntry's; a DataError naming the entry for a bad weight, a
    missing `:WEIGHT` or one path given twice. Whether each path exists is the caller's check."""
    paths, weights = [], []
    for entry in entries:
        path, colon, weight_text = entry.rpartition(":")
        if not colon or not path:
            raise DataError(f"{key}: entry {entry!r}: expected PATH:WEIGHT (a data path and a weight > 0)")
        try:
            weight = float(weight_text)
        except ValueError:
            raise DataError(f"{key}: entry {entry!r}: weight {weight_text!r} is not a number; "
                            "expected PATH:WEIGHT with a weight > 0") from None
        if not math.isfinite(weight) or weight <= 0:
            raise DataError(f"{key}: entry {entry!r}: weight {weight_text}; expected a finite number > 0")
        paths.append(path)
        weights.append(weight)
    return [MixtureEntry(name, path, weight) for name, path, weight in zip(source_names(paths, key), paths, weights)]


def source_names(paths: list[str], key: str = "data.mixture") -> list[str]:
    """Each source's name: its path's last part without a data suffix ('data/web' -> 'web'), or,
    where two share it, as many more of the path's parts as tell them apart ('a/train' ->
    'a_train'); characters other than letters, digits, '_' and '-' become '_'."""
    parts = [[part for part in Path(path).parts if part.strip("/\\")] or ["source"] for path in paths]
    for each in parts:
        each[-1] = next((each[-1][: -len(s)] for s in TEXT_SUFFIXES if each[-1].endswith(s)), each[-1])
    depth = [1] * len(paths)
    while True:
        names = [_NAME_CHARS.sub("_", "_".join(p[-d:])) for p, d in zip(parts, depth)]
        clashes = [i for i, name in enumerate(names) if names.count(name) > 1]
        if not clashes:
            return names
        if any(depth[i] >= len(parts[i]) for i in clashes):
            same = [paths[i] for i in clashes]
            raise DataError(f"{key}: sources {same[0]!r} and {same[1]!r} are one source (give each path once)")
        for i in clashes:
            depth[i] += 1


class Mixture:
    """This rank's micro-batches of `local_batch_size` rows, each row one draw from the source
    whose turn it is (module docstring). `loaders`: one per source, each built with one window
    per rank (local_batch_size 1) for the same seq_len and data-parallel rank and degree."""

    def __init__(self, names: list[str], loaders: list[Any], weights: list[float], *, local_batch_size: int) -> None:
        if not (len(names) == len(loaders) == len(weights) > 0):
            raise ValueError("a mixture needs one name, loader and weight per source")
        shapes = {(one.shape.seq_len, one.shape.local_batch_size, one.shape.dp_world_size) for one in loaders}
        if len(shapes) != 1 or next(iter(shapes))[1] != 1:
            raise ValueError(f"a mixture's loaders draw one window per rank, of one seq_len and dp: {shapes}")
        self.names, self.loaders, self.local_batch_size = list(names), list(loaders), local_batch_size
        self.shares = [w / sum(weights) for w in weights]
        seq_len, _, dp = next(iter(shapes))
        self.draw_tokens = seq_len * dp  # tokens one draw gives the step, over every rank
        self.tokens = [0] * len(names)  # tokens drawn from each source so far

    @property
    def exchange_group(self) -> dist.ProcessGroup | None:
        return self.loaders[0].exchange_group

    @property
    def tokenizer(self) -> Any:
        return self.loaders[0].tokenizer

    @property
    def truncated(self) -> int:
        return sum(loader.truncated for loader in self.loaders)

    @property
    def dropped(self) -> int:
        return sum(loader.dropped for loader in self.loaders)

    def __iter__(self) -> Iterator[Batch]:
        return self.stream(self.exchange_group)

    def next_source(self) -> int:
        """The source of the next draw, by Tijdeman's rule (module docstring), in units of draws."""
        n = len(self.shares)
        if n == 1:
            return 0
        slack = 1 / (2 * n - 2)
        drawn = (sum(self.tokens) + self.draw_tokens) / self.draw_tokens  # draws, this one included
        # How far each source is behind its share; these sum to this one draw, so the largest is at
        # least 1/n >= slack and some source is always due.
        behind = [share * drawn - tokens / self.draw_tokens for share, tokens in zip(self.shares, self.tokens)]
        due = [i for i in range(n) if behind[i] >= slack - 1e-9]
        return min(due, key=lambda i: ((1 - slack - behind[i]) / self.shares[i], i))

    def stream(self, exchange_group: dist.ProcessGroup | None, *, document_masking: bool = False) -> Iterator[Batch]:
        """The micro-batches from the current state on, forever (as `Loader.stream`)."""
        streams = [loader.stream(exchange_group, document_masking=document_masking) for loader in self.loaders]
        while True:
            rows = []
            for _ in range(self.local_batch_size):
                source = self.next_source()
                rows.append(next(streams[source]))
                self.tokens[source] += self.draw_tokens
            yield _stack(rows)

    def state_dict(self) -> dict[str, str]:
        """Every source's loader state and tokens drawn, by name, as JSON text: one checkpoint entry
        whatever the sources, so a checkpoint of other sources is refused here, naming them."""
        return {"mixture": json.dumps({name: {"tokens": tokens, **loader.state_dict()}
                                       for name, loader, tokens in zip(self.names, self.loaders, self.tokens)})}

    def load_state_dict(self, state: dict) -> None:
        saved = mixture_state(state)
        if saved is None or set(saved) != set(self.names):
            had = sorted(saved) if saved is not None else "not a mixture's"
            raise DataError(f"data loader state: the checkpoint's sources are {had}, this run's data.mixture has "
                            f"{sorted(self.names)}; a mixture resumes with its sources as saved (weights may change)")
        for i, (name, loader) in enumerate(zip(self.names, self.loaders)):
            cursor = dict(saved[name])
            tokens = cursor.pop("tokens", None)
            if type(tokens) is not int or tokens < 0:
                raise DataError(f"data loader state: source {name!r}: expected a token count, got {tokens!r}")
            loader.load_state_dict(cursor)
            self.tokens[i] = tokens


def _stack(rows: list[Batch]) -> Batch:
    """One micro-batch of these one-row-per-rank batches, in order."""
    return Batch(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*rows)))


def mixture_state(state: Any) -> dict[str, dict] | None:
    """A mixture's saved state by source name, or None if `state` is not a mixture's."""
    text = state.get("mixture") if isinstance(state, dict) else None
    try:
        saved = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return saved if isinstance(saved, dict) and all(isinstance(v, dict) for v in saved.values()) else None


def source_tokens(state: dict) -> dict[str, int]:
    """Tokens drawn from each source, from a loader's state (a mixture's; else empty)."""
    return {name: cursor["tokens"] for name, cursor in (mixture_state(state) or {}).items()}
