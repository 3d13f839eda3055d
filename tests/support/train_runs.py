"""train.py's `train` run in this process, optionally stopped as if SIGTERM arrived during a step."""

from __future__ import annotations

from weft import train
from weft.components.config import parse_args
from weft.components.distributed import Preemption


class StopAfter(Preemption):
    """Acts as if SIGTERM arrived during step `step`."""

    step = 10

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def requested(self) -> bool:
        self.calls += 1
        return self.calls >= self.step


def run(cfg_args: list[str], stop_after: int | None = None) -> list[float]:
    if stop_after is None:
        return train.train(parse_args(cfg_args))
    original = train.Preemption
    StopAfter.step = stop_after
    train.Preemption = StopAfter
    try:
        return train.train(parse_args(cfg_args))
    finally:
        train.Preemption = original
