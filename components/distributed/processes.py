"""Processes and devices: pick the device, join the process group when launched by torchrun,
or simulate one rank of a bigger job with a fake process group."""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def launched_world_size() -> int:
    """World size announced by torchrun (1 for a plain `python train.py`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def collective_backend(device_type: str, *, share_gpus: bool = False, cpu_offload: bool = False) -> str:
    """The process group's backend string: gloo between CPU processes; NCCL between GPUs, plus gloo
    for CPU tensors with `cpu_offload` ("cuda:nccl,cpu:gloo": FSDP's offloaded gradients are CPU
    tensors that gradient clipping all-reduces); gloo for ranks that `share_gpus` (NCCL refuses two
    ranks on one device; gloo moves CUDA tensors through host memory: correct, slow, for tests)."""
    if device_type != "cuda" or share_gpus:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def gpu_binding_line(local_world_size: int, visible_gpus: int, share_gpus: bool) -> str | None:
    """What start-up states about how this node's processes map onto GPUs, or None when each
    process simply takes its own of the visible GPUs.

    Fewer visible GPUs than processes is normal when a launcher binds one GPU per process (SLURM
    gpu-bind, a per-task CUDA_VISIBLE_DEVICES): each sees its own as device 0 and NCCL is right.
    Ranks that really share a GPU must say so (`share_gpus`), since that costs NCCL."""
    if share_gpus:
        return (f"{local_world_size} processes share {visible_gpus} visible GPU(s) (parallelism.share_gpus): "
                "collectives run on gloo through host memory, slowly, and float8 cannot be all-gathered")
    if local_world_size > visible_gpus:
        return (f"each process sees {visible_gpus} GPU(s) for {local_world_size} processes on this node: taking "
                "the launcher to have bound GPUs to processes (NCCL stops with 'Duplicate GPU detected' if two "
                "share one; set parallelism.share_gpus = true for that)")
    return None


def local_world_size() -> int:
    """Processes on this node, as torchrun announces them (1 for a plain `python train.py`)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def init_distributed(timeout_s: float = 600.0, simulate_world_size: int = 0, *, share_gpus: bool = False,
                     cpu_offload: bool = False) -> torch.device:
    """Choose this process's device (its local GPU if there is one, else the CPU) and, under
    torchrun, join the default process group (`collective_backend(device, share_gpus=...,
    cpu_offload=...)`). Reuses a group that already exists. simulate_world_size > 0: instead play
    rank 0 of that many ranks in this one process (`init_fake_distributed`)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if simulate_world_size > 0:
        init_fake_distributed(simulate_world_size)
    elif launched_world_size() > 1 and not dist.is_initialized():
        backend = collective_backend(device.type, share_gpus=share_gpus, cpu_offload=cpu_offload)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


def init_fake_distributed(world_size: int, rank: int = 0) -> None:
    """Make this one process rank `rank` of a `world_size`-rank job whose collectives do nothing.

    torch's "fake" backend accepts every collective and returns at once, moving no data. So
    everything that depends on the layout is real: the shapes of this rank's parameter shards,
    its compute, its memory, the step time of its compute; what collectives would have brought
    from other ranks is not (all-gathered weights, reduced gradients and losses are garbage,
    and time on the network is zero). Use it to measure one rank of a layout bigger than the
    machine, or, with a meta-device model, to check a layout without devices at all. Device
    meshes and sub-groups are built as usual; every group is fake, none can be gloo.
    """
    # Importing this registers the "fake" backend; the module needs nothing else from torch.testing.

    if dist.is_initialized():
        raise RuntimeError("init_fake_distributed: a process group already exists")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_fake_distributed: rank {rank} is not in 0..{world_size - 1}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


# Gloo groups over every rank, one per name, for the current default process group (see below).
_SHARED_GLOO_GROUPS: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def shared_gloo_group(name: str) -> dist.ProcessGroup | None:
    """A gloo group of every rank of the job, created on the first call with this `name` and reused
    after: for small CPU-side exchanges (the data loaders count document lengths together) that
    must not queue behind, or interleave with, the training loop's NCCL collectives. Each thread
    that communicates uses a name of its own, since the collectives of one group must come in the
    same order on every rank.

    The first call with a name is a collective (it creates a group): every rank makes it at the
    same point of the program, from the main thread. A new default process group (tests create
    several in one process) gets new groups. None without a process group, with one rank, or with
    the fake process group of `init_fake_distributed` (there is no other rank to talk to).
    """
    if not dist.is_initialized() or is_fake_distributed() or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    cached = _SHARED_GLOO_GROUPS.get(name)
    if cached is None or cached[0] is not world:
        _SHARED_GLOO_GROUPS[name] = (world, dist.new_group(backend="gloo"))
    return _SHARED_GLOO_GROUPS[name][1]


def simulation_warning(world_size: int) -> str:
    """What a run under `init_fake_distributed` measures, in one log line."""
    return (f"simulating rank 0 of {world_size} ranks in one process (fake process group): collectives move "
            "nothing, so losses and gradient norms are meaningless (a NaN neither stops nor skips a step); memory "
            "and compute time are one rank's")


def is_fake_distributed() -> bool:
    """Whether the default process group is the fake one of `init_fake_distributed`."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every generator; with `deterministic`, also force deterministic kernels (slower)."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def all_reduce_mean(value: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Mean of a scalar over a process group (gloo has no AVG, so SUM then divide). With a fake
    process group: this rank's own value (there is nothing to average it with)."""
    if group is None or is_fake_distributed():
        return value.item()
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value.item() / dist.get_world_size(group)


# Seconds a SIGTERM'd process may take to reach the end of its current step (where it saves and
# stops) before it exits without saving; override with the environment variable.
SIGTERM_GRACE_ENV = "WEFT_SIGTERM_GRACE_S"
DEFAULT_SIGTERM_GRACE_S = 20.0
EXIT_SIGTERM = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


def sigterm_grace_s() -> float:
    try:
        return max(0.0, float(os.environ.get(SIGTERM_GRACE_ENV, DEFAULT_SIGTERM_GRACE_S)))
    except ValueError:
        return DEFAULT_SIGTERM_GRACE_S


class Preemption:
    """Turns SIGTERM (what schedulers and torchrun send before killing) into a request to stop.

    `requested()` is called once per step by every rank and agrees across ranks over a gloo group,
    so all ranks stop on the same step (and save one checkpoint together) even if only some got the
    signal; with a fake process group the signal is read locally. A rank blocked in a collective
    never runs Python's handler, so a watchdog thread woken through `signal.set_wakeup_fd` ends the
    process with exit status 143 if the loop has not acknowledged the request within the grace
    period (WEFT_SIGTERM_GRACE_S, default 20 s), and at once on a second SIGTERM.
    """

    def __init__(self, grace_s: float | None = None) -> None:
        self._signalled = False
        self._grace_s = sigterm_grace_s() if grace_s is None else grace_s
        self._acknowledged = threading.Event()
        self._closed = False
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watchdog = threading.Thread(target=self._watch, name="weft-sigterm-watchdog", daemon=True)
        self._watchdog.start()
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() and not is_fake_distributed() else None

    def _on_sigterm(self, signum, frame) -> None:
        self._signalled = True

    def _watch(self) -> None:
        """Wait for SIGTERMs (as bytes on the wakeup socket); enforce the grace period."""
        sigterms, deadline = 0, None
        while not self._closed:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([self._reader], [], [], timeout)
                received = self._reader.recv(64) if ready else b""
            except (OSError, ValueError):  # closed under us by close()
                return
            if ready and not received:
                return
            sigterms += received.count(bytes([signal.SIGTERM]))
            if sigterms >= 2:
                _exit_now("a second SIGTERM: stopping at once, without saving")
            if sigterms == 1 and deadline is None and not self._acknowledged.is_set():
                deadline = time.monotonic() + self._grace_s
            if deadline is not None and self._acknowledged.is_set():
                deadline = None  # the loop reached the end of its step: it saves and stops
            if deadline is not None and time.monotonic() >= deadline and not self._closed:
                _exit_now(f"SIGTERM, and the training loop did not reach the end of its step within "
                          f"{self._grace_s:g} s (blocked in a collective or an allocation?): stopping without saving")

    def requested(self) -> bool:
        flag = torch.tensor([int(self._signalled)])
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item():
            self._acknowledged.set()  # the loop will save and stop: the watchdog stands down
        return bool(flag.item())

    def close(self) -> None:
        """Restore the signal handling, and end the watchdog before its socket closes: a thread
        still inside select() on a closed socket at interpreter exit aborted multi-node runs
        ("terminate called without an active exception") after their last step."""
        self._closed = True
        signal.signal(signal.SIGTERM, self._previous)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        try:
            self._writer.send(b"\0")  # wakes select(); not a SIGTERM byte
        except OSError:
            pass
        self._watchdog.join(timeout=5)
        self._writer.close()
        self._reader.close()


def _exit_now(reason: str) -> None:
    """End the process from the watchdog thread: one line, then exit without cleanup (the main
    thread may hold locks, or be stuck in C++ that never returns)."""
    try:
        sys.stderr.write(f"weft: {reason}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_SIGTERM)


def restart_warning() -> str | None:
    """Under `torchrun --max-restarts N`, what the restarted ranks need from torchrun's environment.

    torch 2.13's torchrun shares its rendezvous store with the workers, and the ranks of a
    restarted round can then read the dead round's gloo addresses and fail to connect
    (pytorch/pytorch#135712); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each round its own."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        return (f"torchrun --max-restarts {restarts}: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment, "
                "or a restarted job may fail to connect its ranks (pytorch/pytorch#135712)")
    return None
