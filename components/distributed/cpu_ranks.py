"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns.

For tests and benchmarks: each rank is a fresh process with one thread; results come back in rank
order, and a failure on any rank is raised in the caller with that rank's traceback.

Ranks are forked from multiprocessing's fork server, which imports torch (and what `preload` names) once, not spawned
as new interpreters that import them again for every rank of every run: on 2 CPU cores that is
about 4 s less per 4-rank run. A rank sees the caller's environment variables as they were when
the first run started the server."""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What every rank imports anyway, imported once by the fork server (not its callers' modules: a
# test's own module is imported by each rank, as before); `preload` adds to it.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "numpy"]


def preload(*modules: str) -> None:
    """Have the fork server import `modules` too (the suite's conftest names weft's recipe), once,
    before the first run; later calls are too late for a server already started."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on the port `free_port` chose: another process (another group's
    gloo connections, on ephemeral ports) took it between the choice and the bind."""


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0, attempts: int = 3) -> list[Any]:
    """Call fn(*args) on every rank of a fresh gloo group; return the results in rank order.

    fn must be importable (defined at module level). A failure on any rank raises here with
    that rank's traceback. A port taken before rank 0 listens on it (before fn runs) is tried
    again on another, up to `attempts` times.
    """
    for attempt in range(1, attempts + 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _PortTaken:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the first run starts the server
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                crashed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                if crashed:
                    raise RuntimeError(f"ranks {crashed} died without reporting (exit codes "
                                       f"{[procs[r].exitcode for r in crashed]})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed run did not finish in {timeout:.0f} s") from None
                continue
            outcomes[rank] = (status, value)
            if status == "error":
                break
    finally:
        port_taken = any(s == "error" and "EADDRINUSE" in v and "init_process_group" in v for s, v in outcomes.values())
        for p in procs:  # the others of a group that could not start would wait for rank 0's store: stop them
            p.join(timeout=timeout if len(outcomes) == world_size else 0 if port_taken else 5)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcomes.items()) if s == "error"]
    if port_taken:
        raise _PortTaken("distributed run could not start\n" + "\n".join(errors))
    if errors:
        raise RuntimeError("distributed run failed\n" + "\n".join(errors))
    return [outcomes[r][1] for r in range(world_size)]
