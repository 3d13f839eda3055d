"""The limits CommTimeouts puts on every process group, and the line a failed collective becomes.

(That a stopped rank really ends the run within the limit is tests/e2e/test_faults.py's torchrun case.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from weft.components.distributed.timeouts import CommTimeouts, keep_long_timeout


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def limits() -> list[float]:
    """The timeout of each process group, in seconds, in creation order."""
    return [group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in c10d._world.pg_map]


def test_the_long_limit_covers_the_first_step_saves_and_the_long_groups(one_rank):
    dist.new_group(backend="gloo")  # a side group, as the data loaders and SIGTERM handling make
    background = dist.new_group(backend="gloo")
    keep_long_timeout(background)
    timeouts = CommTimeouts(init_s=60, train_s=5)
    timeouts.at_step(11)  # the first step of this run (a resume from step 10): compile runs here
    assert limits() == [60, 60, 60]
    timeouts.at_step(12)
    assert limits() == [5, 5, 60]
    with timeouts.long():
        assert limits() == [60, 60, 60]
    assert limits() == [5, 5, 60]


def test_a_timed_out_collective_becomes_one_line_naming_the_step(one_rank):
    timeouts = CommTimeouts(init_s=60, train_s=5)
    timeouts.at_step(1)
    timeouts.at_step(2)
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    assert str(timeouts.translate(gloo)) == (
        f"step 2: a collective waited longer than comm.train_timeout_seconds = 5 s ({gloo}); every rank answered "
        "the check-in afterwards")
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert str(timeouts.translate(lost)).startswith("step 2: a collective lost its connection to another rank (")
    assert timeouts.translate(RuntimeError("CUDA out of memory")) is None
    assert timeouts.translate(ValueError("timed out")) is None
