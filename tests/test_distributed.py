"""components/distributed.py: which collective backend a rank gets."""

from __future__ import annotations

import pytest
import torch

from components.distributed import collective_backend


@pytest.mark.parametrize("gpus, local_ranks, expected", [
    (0, 2, "gloo"),  # CPU processes
    (8, 8, "nccl"),  # one GPU each
    (8, 4, "nccl"),
    (1, 2, "gloo"),  # two ranks on one GPU: NCCL refuses to share a device
])
def test_backend_by_gpus_and_local_ranks(monkeypatch, gpus, local_ranks, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert collective_backend("cuda" if gpus else "cpu") == expected
