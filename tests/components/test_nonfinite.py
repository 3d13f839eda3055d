"""The non-finite policy's decisions, step by step (end to end: tests/e2e/test_faults.py)."""

from __future__ import annotations

import math

import pytest
import torch

from weft.components.training.nonfinite import NonFiniteError, NonFinitePolicy


def test_skip_counts_consecutive_steps_and_stops_at_the_limit():
    events = []
    policy = NonFinitePolicy("skip", 2, on_first=lambda step: events.append(("first", step)),
                             before_stop=lambda: events.append("stop"))
    assert policy.allows_update(1, 1.0, 2.0)
    assert not policy.allows_update(2, math.nan, 2.0)
    assert policy.allows_update(3, 1.0, 2.0)  # a finite step resets the run of skips
    assert not policy.allows_update(4, 1.0, math.inf)
    with pytest.raises(NonFiniteError, match=r"^step 5: loss 2 \(this rank\), gradient norm inf: not finite for 2 "
                                             r"steps in a row \(training.max_skipped_steps = 2\)"):
        policy.allows_update(5, torch.tensor(math.inf), torch.tensor(2.0))
    assert policy.skipped == 3 and events == [("first", 2), "stop"]


def test_stop_raises_at_the_first_non_finite_step():
    events = []
    policy = NonFinitePolicy("stop", 3, on_first=lambda step: events.append(step), before_stop=lambda: events.append("stop"))
    assert policy.allows_update(1, torch.tensor(0.5), torch.tensor(3.0))
    with pytest.raises(NonFiniteError, match=r"^step 2: loss nan \(this rank\), gradient norm 0.5: not finite; stopped"):
        policy.allows_update(2, 0.5, math.nan)
    assert events == [2, "stop"]


def test_ignore_lets_every_update_through():
    """A simulated rank's policy: NaN and inf go ahead, uncounted, nothing raised."""
    policy = NonFinitePolicy("ignore", 1)
    assert policy.allows_update(1, torch.tensor(float("nan")), torch.tensor(float("inf")))
    assert policy.skipped == 0 and policy.first_nonfinite_step is None
