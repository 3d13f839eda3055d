"""train.py as a replica group's torchrun worker, with the faults the fault-tolerance tests inject.

    torchrun ... tests/support/ft_worker.py --job.config_file ... --fault_tolerance.enable ...

Environment (each optional):
- WEFT_TEST_KILL=FAULT,FAULT,...  the fault of each attempt (TORCHELASTIC_RESTART_COUNT 0, 1, ...):
  between:K SIGKILLs this worker after its K-th committed step; allreduce:K as it enters step K's
  gradient all-reduce, while the other groups are inside theirs; '' none.
- WEFT_TEST_READY=PATH  a restarted worker creates PATH.<attempt> once it has asked for its first quorum.
- WEFT_TEST_WAIT=K:PATH,K:PATH,...  after its K-th committed step, wait (60 s at most) until PATH
  exists: the survivor keeps training until the killed group is back, however slow its restart.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from weft import train
from weft.components.distributed.processes import Preemption
from weft.components.ft import groups as ft

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTS = os.environ.get("WEFT_TEST_KILL", "").split(",")
kill_where, _, kill_step = (FAULTS[ATTEMPT] if ATTEMPT < len(FAULTS) else "").partition(":")
WAITS = dict(wait.split(":", 1) for wait in os.environ.get("WEFT_TEST_WAIT", "").split(",") if wait)

def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults(Preemption):
    """`requested` is asked once after every committed step: the place for between-step faults."""

    def __init__(self) -> None:
        super().__init__()
        self.committed = 0

    def requested(self) -> bool:
        self.committed += 1
        if kill_where == "between" and self.committed == int(kill_step):
            die()
        if str(self.committed) in WAITS:
            deadline = time.monotonic() + 60
            while not Path(WAITS[str(self.committed)]).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        return super().requested()


average = ft.ReplicaGroups.average_gradients
quorum = ft.ReplicaGroups._timed_quorum


def average_or_die(self, params):
    if kill_where == "allreduce" and self.manager.current_step() + 1 == int(kill_step):
        die()
    return average(self, params)


def quorum_announced(self, *args, **kwargs):
    """The first quorum of a restarted attempt: READY appears half a second after it was asked for,
    so that a survivor waiting for READY finds it waiting in the lighthouse."""
    if ATTEMPT and os.environ.get("WEFT_TEST_READY") and not getattr(self, "announced", False):
        self.announced = True
        threading.Timer(0.5, Path(f"{os.environ['WEFT_TEST_READY']}.{ATTEMPT}").touch).start()
    return quorum(self, *args, **kwargs)


ft.ReplicaGroups.average_gradients = average_or_die
ft.ReplicaGroups._timed_quorum = quorum_announced

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:], make_preemption=Faults))
