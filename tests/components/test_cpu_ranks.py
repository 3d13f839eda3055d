"""The CPU process groups the suite and the simulated world sizes start (components/distributed/
cpu_ranks.py): a port another process takes between `free_port`'s choice and rank 0's bind is
tried again on another, rather than failing the run."""

from __future__ import annotations

import socket

import torch.distributed as dist

from weft.components.distributed import cpu_ranks


def rank_and_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_a_port_taken_before_rank_0_listens_is_tried_again(monkeypatch):
    real = cpu_ranks.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        chosen = [taken.getsockname()[1]]  # the first choice: a port another process holds
        monkeypatch.setattr(cpu_ranks, "free_port", lambda: chosen.pop() if chosen else real())
        assert cpu_ranks.run_distributed(rank_and_size, 2) == [(0, 2), (1, 2)]
        assert not chosen
