"""Processes and devices: pick the device, join the process group when launched by torchrun."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """World size announced by torchrun (1 for a plain `python train.py`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def collective_backend(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Choose this process's device (its local GPU if there is one, else the CPU) and, under
    torchrun, join the default process group: NCCL on GPUs, gloo on CPU. Reuses a group that
    already exists."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launched_world_size() > 1 and not dist.is_initialized():
        dist.init_process_group(collective_backend(device.type), timeout=timedelta(seconds=timeout_s))
    return device


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every generator; with `deterministic`, also force deterministic kernels (slower)."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def all_reduce_mean(value: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Mean of a scalar over a process group (gloo has no AVG, so SUM then divide)."""
    if group is None:
        return value.item()
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value.item() / dist.get_world_size(group)


class Preemption:
    """Turns SIGTERM (what schedulers and torchrun send before killing) into a request to stop.

    `requested()` is called once per step by every rank; it agrees across ranks over a gloo
    group, so all ranks stop on the same step (and can save one checkpoint together) even if
    the signal reached only some of them.
    """

    def __init__(self) -> None:
        self._signalled = False
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    def _on_sigterm(self, signum, frame) -> None:
        self._signalled = True

    def requested(self) -> bool:
        flag = torch.tensor([int(self._signalled)])
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
