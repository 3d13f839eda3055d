"""Time left: the elapsed time of the training loop and an estimate of the time to its last step."""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta


class TimeLeft:
    """Elapsed time since construction (the start of the training loop) and the time to the last
    step: the mean wall time per step over the last `recent` log windows (validation and
    checkpoint saves included) times the steps left. The first window (start-up: the first
    batch, compilation, warm-up) counts only until a second one has ended."""

    def __init__(self, start_step: int, last_step: int, recent: int = 10):
        self.start, self.start_step, self.last_step = time.perf_counter(), start_step, last_step
        self.marks: deque[tuple[int, float]] = deque(maxlen=recent + 1)  # (step, time) at each log

    def at_log(self, step: int) -> tuple[float, float]:
        """(elapsed seconds, remaining seconds) at the log of `step`."""
        now = time.perf_counter()
        self.marks.append((step, now))
        first_step, first_time = self.marks[0] if len(self.marks) > 1 else (self.start_step, self.start)
        per_step = (now - first_time) / max(step - first_step, 1)
        return now - self.start, per_step * max(self.last_step - step, 0)


def clock(seconds: float) -> str:
    """Seconds as H:MM:SS (days as "N days, H:MM:SS")."""
    return str(timedelta(seconds=round(seconds)))
