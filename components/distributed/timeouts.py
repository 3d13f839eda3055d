"""How long a collective may wait for the other ranks, and what a rank says when one never answers.

Two limits (`[comm]`): a long one while the ranks start, load, compile, save and validate, and a
short one for ordinary steps, so that a rank that stops responding ends the job within minutes.
A timed-out collective raises CollectiveTimeoutError on gloo: one line naming the step, the limit
and the ranks that did not respond, with their last phase (flight_recorder.py). On NCCL the
watchdog aborts the process at the same limit (docs/troubleshooting.md).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from weft.components.distributed.flight_recorder import PhaseRecord, last_phases
from weft.errors import UserError, one_line

# What gloo and the c10d store say when a peer never answered, or went away.
_TIMEOUT_WORDS = ("timed out", "timeout")
_LOST_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")
# How long a rank whose collective failed waits for the other survivors to say they are alive.
CHECK_IN_S = 3.0


# Groups whose collectives may legitimately wait long at any time (a background save's gather
# waits for the slowest writer): they keep the long limit.
_LONG_GROUPS: list[dist.ProcessGroup] = []


def keep_long_timeout(group: dist.ProcessGroup | None) -> None:
    """Exempt `group` from the short training limit (see _LONG_GROUPS)."""
    if group is not None:
        _LONG_GROUPS.append(group)


class CollectiveTimeoutError(UserError):
    """A collective that waited longer than its limit, or lost its peer."""


def set_collective_timeout(seconds: float, long_seconds: float | None = None) -> None:
    """Make `seconds` the limit of every process group of this process (the default one and every
    group created from it: device-mesh dims, gloo side groups), `long_seconds` (default: the same)
    that of the groups given to keep_long_timeout."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    for group in list(c10d._world.pg_map):
        limit = long_seconds if long_seconds is not None and any(group is g for g in _LONG_GROUPS) else seconds
        c10d._set_pg_timeout(timedelta(seconds=limit), group)


# train_step's phase names (recipe/step.py) as the timeout line spells them.
_PHASE_NAMES = {"step": "optimizer"}


class CommTimeouts:
    """The limit in force: `init_s` through the first step of the run and inside `long()` (saves,
    validation), `train_s` for every other step. The newest instance is the one
    `collective_failure` reports for (a process runs one training loop at a time).

    `phases` (gloo jobs) publishes each phase this rank enters (`phase`, `long(phase)`), so that
    another rank's timeout line can say where a silent rank was; `trace_note` (the flight recorder
    on NCCL) is appended to that line to name the dump files."""

    active: CommTimeouts | None = None

    def __init__(self, init_s: float, train_s: float, *, phases: PhaseRecord | None = None,
                 trace_note: str | None = None) -> None:
        self.init_s, self.train_s = init_s, train_s
        self.phases, self.trace_note = phases, trace_note
        self.step: int | None = None
        self._first_step: int | None = None
        self._limit = init_s
        CommTimeouts.active = self

    def _set(self, seconds: float) -> None:
        self._limit = seconds
        set_collective_timeout(seconds, long_seconds=self.init_s)

    def at_step(self, step: int) -> None:
        """Call at the start of each step: the first keeps the long limit (compile), later ones the short."""
        if self._first_step is None:
            self._first_step = step
            self._set(self.init_s)
        elif step == self._first_step + 1:
            self._set(self.train_s)
        self.step = step

    def phase(self, name: str) -> None:
        """Call as each phase of the step begins (train_step's on_phase): published for gloo jobs."""
        if self.phases is not None:
            self.phases.enter(self.step, _PHASE_NAMES.get(name, name))

    @contextlib.contextmanager
    def long(self, phase: str | None = None) -> Iterator[None]:
        """The long limit for what may legitimately take long: a save ("checkpoint"), a validation
        pass ("validation"); `phase` is published as this rank's phase."""
        if phase is not None:
            self.phase(phase)
        previous = self._limit
        self._set(self.init_s)
        try:
            yield
        finally:
            self._set(previous)

    def translate(self, error: BaseException) -> CollectiveTimeoutError | None:
        """`error` as one line naming the step, the limit and the silent ranks, if it is a
        collective's timeout or lost peer; else None."""
        text = str(error).lower()
        timed_out = any(word in text for word in _TIMEOUT_WORDS)
        lost_peer = any(word in text for word in _LOST_PEER_WORDS)
        if not isinstance(error, RuntimeError) or not (timed_out or lost_peer) or not dist.is_initialized():
            return None
        where = f"step {self.step}" if self.step is not None else "before the first step"
        key = "comm.train_timeout_seconds" if self._limit == self.train_s else "comm.init_timeout_seconds"
        limit = f"{key} = {self._limit:g} s" if math.isfinite(self._limit) else "its time limit"
        what = (f"a collective waited longer than {limit}" if timed_out
                else "a collective lost its connection to another rank")
        silent = silent_ranks(f"weft/failed-collective/{self.step}", CHECK_IN_S)
        who = ("could not tell which rank stopped responding" if silent is None else
               "every rank answered the check-in afterwards" if not silent else
               f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not respond")
        seen = last_seen(silent) if self.phases is not None and silent else ""
        note = f"; {self.trace_note}" if self.trace_note else ""
        return CollectiveTimeoutError(f"{where}: {what} ({one_line(error)}); {who}{seen}{note}")


def last_seen(silent: list[int]) -> str:
    """'; last seen: step 3 forward' for one silent rank, '; last seen: rank 1 at step 3 forward,
    rank 2 at ...' for several: what each last published (PhaseRecord); '' if none did."""
    phases = last_phases(silent)
    if not phases:
        return ""
    if len(silent) == 1:
        return f"; last seen: {phases[silent[0]]}"
    return "; last seen: " + ", ".join(f"rank {rank} at {phase}" for rank, phase in sorted(phases.items()))


def silent_ranks(key: str, wait_s: float = CHECK_IN_S) -> list[int] | None:
    """Ranks that did not check in under `key` of the job's store within `wait_s` (each rank
    whose collective failed checks in here), or None if the store cannot be reached."""
    try:
        store = c10d._get_default_store()
        world, rank = dist.get_world_size(), dist.get_rank()
        store.append(key, f"{rank},")
        deadline = time.monotonic() + wait_s
        while True:
            present = {int(r) for r in store.get(key).decode().split(",") if r}
            if len(present) == world or time.monotonic() >= deadline:
                return sorted(set(range(world)) - present)
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store lives with rank 0's launcher; it may be gone too
        return None


def collective_failure(error: BaseException) -> CollectiveTimeoutError | None:
    """What an entry point reports for an uncaught `error`: a collective's timeout or lost peer as
    one line naming the step of the running loop (None for any other error)."""
    timeouts = CommTimeouts.active or CommTimeouts(float("nan"), float("nan"))
    return timeouts.translate(error)
