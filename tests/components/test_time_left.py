"""The time left the log line gives: the wall time per step, checkpoint saves included, times the
steps left; checked against the time the run actually took to its last step."""

from __future__ import annotations

import json
import logging
import time

import pytest

from weft import train
from weft.components.checkpoint.checkpointer import Checkpointer
from weft.components.observe.time_left import TimeLeft, clock
from weft.recipe.step import train_step

from tests.support.train_runs import run_args

STEP_S, SAVE_S, STEPS = 0.15, 0.3, 12


def test_clock_and_estimate_by_hand(monkeypatch):
    assert clock(7323.4) == "2:02:03" and clock(0) == "0:00:00" and clock(90061) == "1 day, 1:01:01"
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    left = TimeLeft(start_step=4, last_step=20, recent=2)
    now[0] = 106.0
    assert left.at_log(6) == (6.0, 3.0 * 14)  # the first window alone: 6 s for steps 5-6
    now[0] = 110.0
    assert left.at_log(8) == (10.0, 2.0 * 12)  # from the first log on: 4 s for steps 7-8
    now[0] = 111.0
    assert left.at_log(10) == (11.0, 1.25 * 10)  # 5 s for steps 7-10
    now[0] = 113.0
    assert left.at_log(12) == (13.0, 0.75 * 8)  # the last 2 windows: 3 s for steps 9-12


@pytest.mark.slow
def test_time_left_is_within_20_percent_of_the_actual_time(tmp_path, monkeypatch):
    """Each step sleeps STEP_S, every second step's checkpoint save SAVE_S (saves are left out of
    tokens/s but not out of the time left): the estimate at each log from step 4 to 8 is within
    20% of the time from that log to the last step's."""
    def steady_step(*args, **kwargs):
        time.sleep(STEP_S)
        return train_step(*args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", lambda self, step, **kwargs: time.sleep(SAVE_S))
    logged: dict[int, float] = {}  # step -> when its line was logged

    class WhenLogged(logging.Filter):
        def filter(self, record):
            words = record.getMessage().split()
            if words[:1] == ["step"] and words[2] == "loss":
                logged[int(words[1])] = time.perf_counter()
            return True

    when = WhenLogged()
    logging.getLogger("weft").addFilter(when)
    try:
        assert train.main(run_args(tmp_path, "--metrics.log_freq", "2", steps=STEPS, seq_len=64, checkpoint_every=2),
                          train_step=steady_step) == 0
    finally:
        logging.getLogger("weft").removeFilter(when)

    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(logged) == sorted(records) == list(range(2, STEPS + 1, 2))
    for step in range(4, 9, 2):
        actual = logged[STEPS] - logged[step]
        assert records[step]["time/remaining_seconds"] == pytest.approx(actual, rel=0.2), step
    assert records[STEPS]["time/remaining_seconds"] == 0
    assert records[STEPS]["time/elapsed_seconds"] >= STEPS * STEP_S + (STEPS // 2 - 1) * SAVE_S
