"""What a hung job leaves behind to say where each rank was: torch's flight recorder (NCCL), and on
gloo weft's own record of the phase each rank last entered.

`flight_recorder_env` sets the environment torch reads for its flight recorder (both spellings of
torch 2.13 and older releases) before the process group exists; read the dumps with `torchfrtrace`.
Gloo never writes its record on a timeout, so each rank of a gloo job publishes in the c10d store
the step and phase it enters (`PhaseRecord`), and the timeout line reads the silent ranks' last
entries back (`last_phases`; docs/observability.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from weft.components.config import JobConfig, check_creatable_folder

# torch names each rank's dump <prefix><global rank>; its analyzer infers the prefix from the names.
TRACE_FILE_PREFIX = "rank_"
# The c10d store key under which a rank publishes the step and phase it last entered, per round of
# torchrun's restarts (a store shared across rounds must not show a dead round's phase).
PHASE_KEY = "weft/last-phase/{restart}/{rank}"


def phase_key(rank: int) -> str:
    return PHASE_KEY.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), rank=rank)


def trace_prefix(cfg: JobConfig) -> Path:
    """Where each rank's flight recorder dump goes, as torch's file prefix: the dump file of rank
    N is this path followed by N."""
    return Path(cfg.job.dump_folder) / cfg.comm.trace_folder / TRACE_FILE_PREFIX


def flight_recorder_env(trace_buf_size: int, prefix: Path | str) -> dict[str, str]:
    """The environment that turns on torch's flight recorder with `trace_buf_size` entries per
    rank and dumps each rank's entries to `<prefix><rank>` when a collective times out; empty for
    0 (weft sets nothing: torch's defaults and the user's own TORCH_FR_* variables apply)."""
    if trace_buf_size == 0:
        return {}
    size, prefix = str(trace_buf_size), str(prefix)
    return {
        "TORCH_FR_BUFFER_SIZE": size,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": size,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def check_trace_folder(cfg: JobConfig) -> None:
    """With comm.trace_buf_size > 0: refuse a trace folder that cannot be created, creating nothing."""
    if cfg.comm.trace_buf_size:
        check_creatable_folder(trace_prefix(cfg).parent, f"comm.trace_folder = {cfg.comm.trace_folder!r}")


def start_flight_recorder(cfg: JobConfig) -> None:
    """Before the process group starts: set the flight recorder's environment and create the folder
    torch writes the dumps into (torch does not create it). Nothing with comm.trace_buf_size = 0."""
    env = flight_recorder_env(cfg.comm.trace_buf_size, trace_prefix(cfg))
    if env:
        os.environ.update(env)
        trace_prefix(cfg).parent.mkdir(parents=True, exist_ok=True)


def trace_files_note(cfg: JobConfig) -> str | None:
    """What the timeout line says about the dumps: where each rank's is, and how to read them;
    None unless the flight recorder is on and the job's collectives run on NCCL (which writes them)."""
    if cfg.comm.trace_buf_size == 0 or not dist.is_initialized() or "nccl" not in dist.get_backend():
        return None
    prefix = trace_prefix(cfg)
    return (f"each rank's last collectives: {prefix}<rank>, written by NCCL's watchdog when it times out "
            f"(read them with: torchfrtrace {prefix.parent})")


class PhaseRecord:
    """Publishes the step and phase this rank enters in the job's c10d store, for the timeout line
    of another rank to name (`last_phases`). A store write is a round trip to the store's host, so
    each phase is published once per step (forward, backward, optimizer; checkpoint, validation),
    at most a few writes a step, and only for gloo jobs (NCCL has the flight recorder)."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self._store, self._key = store, phase_key(rank)
        self._step: int | None = None
        self._published: set[str] = set()

    @classmethod
    def for_job(cls) -> PhaseRecord | None:
        """A record for this rank of a gloo job of several ranks; None for NCCL, one process or the
        fake process group."""
        if not dist.is_initialized() or dist.get_backend() != "gloo" or dist.get_world_size() == 1:
            return None
        return cls(c10d._get_default_store(), dist.get_rank())

    def enter(self, step: int | None, phase: str) -> None:
        if step != self._step:
            self._step, self._published = step, set()
        if phase in self._published:
            return
        self._published.add(phase)
        try:
            self._store.set(self._key, f"step {step} {phase}" if step is not None else f"{phase} before the first step")
        except Exception:  # noqa: BLE001 - the record is advisory; a lost store fails the next collective anyway
            pass


def last_phases(ranks: list[int]) -> dict[int, str]:
    """What each of `ranks` last published with PhaseRecord ("step 3 forward"), for those that did;
    empty if the store cannot be reached."""
    try:
        store = c10d._get_default_store()
        keys = {rank: phase_key(rank) for rank in ranks}
        return {rank: store.get(key).decode() for rank, key in keys.items() if store.check([key])}
    except Exception:  # noqa: BLE001 - the store lives with rank 0's launcher; it may be gone too
        return {}
