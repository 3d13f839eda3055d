"""[profiling]: torch.profiler traces of a window of steps, and CUDA memory snapshots.

Traces: one torch.profiler.profile driven by the training step (`StepProfiler.step`, phases through
`StepProfiler.on_phase`); each rank writes a window of `warmup` + `active` steps ending at a multiple
of `freq` as <dump>/<folder>/step-N/rank-R.json.gz, kept out of the logged throughput. Memory
snapshots (CUDA only): each rank dumps the allocator's history every `memory_snapshot_freq` steps
and on out-of-memory. The decisions are pure functions, tested without a GPU; with both off
`StepProfiler` does nothing (docs/observability.md).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from weft.components.config import ConfigError, JobConfig, check_creatable_folder
from weft.components.config.schema import Profiling
from weft.components.observe.metrics import MetricsLogger

logger = logging.getLogger("weft")

# train_step's on_phase names -> the record_function regions that mark them in a trace.
PHASE_REGIONS = {"forward": "forward", "backward": "backward", "step": "optimizer"}
MEMORY_SNAPSHOT_FOLDER = "memory_snapshot"  # under the dump folder
PERFETTO = "https://ui.perfetto.dev"
MEMORY_VIZ = "https://pytorch.org/memory_viz"


# ---- plan time ---------------------------------------------------------------------------------

def check_profiling(cfg: JobConfig, device_type: str, *, check_folders: bool = True) -> None:
    """Refuse, in one line (ConfigError), a window that does not fit in freq, memory snapshots
    without CUDA and (check_folders) an output folder that cannot be created. Creates nothing."""
    p, dump = cfg.profiling, Path(cfg.job.dump_folder)
    if p.enable and p.freq < p.warmup + p.active:
        raise ConfigError(f"profiling.freq = {p.freq}: a window of profiling.warmup + profiling.active = "
                          f"{p.warmup + p.active} steps must fit in it; expected >= {p.warmup + p.active}")
    if p.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError("profiling.enable_memory_snapshot = true: needs CUDA (it records the CUDA caching "
                          "allocator), and this run has no GPU")
    if check_folders and p.enable:
        check_creatable_folder(dump / p.folder, f"profiling.folder = {p.folder!r}")
    if check_folders and p.enable_memory_snapshot:
        check_creatable_folder(dump / MEMORY_SNAPSHOT_FOLDER, "profiling.enable_memory_snapshot = true")


# ---- the decisions -----------------------------------------------------------------------------

def schedule_args(freq: int, warmup: int, active: int) -> dict[str, int]:
    """torch.profiler.schedule's arguments for a schedule indexed by training step (1, 2, ...):
    each window of warmup + active steps ends at a step divisible by freq. skip_first=1 skips
    index 0, which is no step."""
    return {"wait": freq - warmup - active, "warmup": warmup, "active": active, "repeat": 0, "skip_first": 1}


def activities(device_type: str) -> list[ProfilerActivity]:
    """What the profiler records: CPU ops (and collectives) always, CUDA kernels on GPUs."""
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device_type == "cuda" else [ProfilerActivity.CPU]


def trace_path(dump: Path, folder: str, step: int, rank: int) -> Path:
    """Where rank `rank` writes the trace of the window ending at `step`."""
    return dump / folder / f"step-{step}" / f"rank-{rank}.json.gz"


def memory_history_args(max_entries: int) -> dict[str, object]:
    """torch.cuda.memory._record_memory_history's arguments: every allocation and free, with its
    Python stack only (C++ frames make a large model's dump take minutes), the latest max_entries."""
    return {"enabled": "all", "context": "all", "stacks": "python", "max_entries": max_entries}


def snapshot_path(dump: Path, step: int, rank: int, *, oom: bool = False) -> Path:
    """Where rank `rank` writes its memory snapshot after `step` (oom: as `step` ran out of memory)."""
    return dump / MEMORY_SNAPSHOT_FOLDER / f"step-{step}{'-oom' if oom else ''}" / f"rank-{rank}.pickle"


def snapshot_due(step: int, freq: int) -> bool:
    """A memory snapshot is written after every step divisible by memory_snapshot_freq."""
    return step % freq == 0


# ---- the run -----------------------------------------------------------------------------------

class MemorySnapshots:
    """The CUDA allocator's history, recorded from construction, dumped per rank as a pickle."""

    def __init__(self, dump: Path, rank: int, freq: int, max_entries: int) -> None:
        self.dump, self.rank, self.freq = dump, rank, freq
        torch.cuda.memory._record_memory_history(**memory_history_args(max_entries))

    def after_step(self, step: int) -> None:
        if snapshot_due(step, self.freq):
            path = self._write(snapshot_path(self.dump, step, self.rank))
            logger.info(f"memory snapshot: step {step} written to {path.parent} (rank-R.pickle per rank; "
                        f"open in {MEMORY_VIZ})")

    def on_oom(self, step: int) -> None:
        """A training step ran out of memory: the allocator's history up to it, and one line saying where."""
        path = snapshot_path(self.dump, step, self.rank, oom=True)
        try:
            self._write(path)
        except (OSError, RuntimeError) as e:
            logger.error(f"out of memory in step {step}; its memory snapshot could not be written to {path}: {e}")
            return
        logger.error(f"out of memory in step {step}: memory snapshot of rank {self.rank} written to {path}; "
                     f"open it in {MEMORY_VIZ}")

    def _write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def close(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


class StepProfiler:
    """[profiling] during the loop: `with profiler.step(step): train_step(..., on_phase=profiler.on_phase)`.

    metrics: the MetricsLogger whose throughput leaves out profiled steps. start_step: the last
    step already done (a resume), so windows stay at the same steps. With [profiling] off it holds
    neither a torch profiler nor a memory recording, and step / on_phase do nothing."""

    def __init__(self, cfg: Profiling, dump: Path, device_type: str, rank: int, metrics: MetricsLogger,
                 start_step: int = 0) -> None:
        self.cfg, self.dump, self.rank, self.metrics = cfg, dump, rank, metrics
        self.profiler: torch.profiler.profile | None = None
        self.memory = MemorySnapshots(dump, rank, cfg.memory_snapshot_freq, cfg.memory_snapshot_max_entries) \
            if cfg.enable_memory_snapshot else None
        self._step, self._action, self._first_recorded = start_step, ProfilerAction.NONE, 0
        self._region: contextlib.AbstractContextManager | None = None
        if cfg.enable:
            self.profiler = torch.profiler.profile(
                activities=activities(device_type), schedule=torch.profiler.schedule(
                    **schedule_args(cfg.freq, cfg.warmup, cfg.active)),
                on_trace_ready=self._write_trace, record_shapes=cfg.record_shapes, with_stack=cfg.with_stack)
            self.profiler.step_num = start_step + 1  # the schedule's index is the training step
            self.profiler.current_action = self.profiler.schedule(start_step + 1)
            self.profiler.start()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: a profiled step left out of the throughput; then the profiler's
        step (which may write a window's traces) and any memory snapshot due, untimed; a memory
        snapshot if the step runs out of memory (then the error goes on)."""
        previous, self._step = self._action, step
        self._action = self.profiler.current_action if self.profiler else ProfilerAction.NONE
        if self._action != ProfilerAction.NONE and previous in (ProfilerAction.NONE, ProfilerAction.RECORD_AND_SAVE):
            self._window_starts(step)
        recording = self._action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
        if recording and previous != ProfilerAction.RECORD:
            self._first_recorded = step
        try:
            with self.metrics.untimed_step() if self._action != ProfilerAction.NONE else contextlib.nullcontext():
                yield
        except torch.OutOfMemoryError:
            if self.memory is not None:
                self.memory.on_oom(step)
            raise
        finally:
            self._end_region()
        if self.profiler is None and self.memory is None:
            return
        with self.metrics.untimed():
            if self.profiler is not None:
                with _without_cycle_warning():
                    self.profiler.step()
            if self.memory is not None:
                self.memory.after_step(step)

    def on_phase(self, phase: str) -> None:
        """train_step's hook: in a profiled step, close the open phase's region and open this one's."""
        if self._action == ProfilerAction.NONE:
            return
        self._end_region()
        self._region = torch.profiler.record_function(PHASE_REGIONS[phase])
        self._region.__enter__()

    def close(self) -> None:
        """Stop the profiler (a window the run's end cut short after a recorded step is written, one
        whose recorded steps never ran is not) and the memory recording."""
        if self.profiler is not None:
            if self._action == ProfilerAction.WARMUP:
                logger.info(f"profiler: the run ended in the warm-up of a window, step {self._step}: no trace")
            if self._action != ProfilerAction.RECORD:
                self.profiler.on_trace_ready = None
            with _without_cycle_warning():
                self.profiler.stop()
            self.profiler = None
        if self.memory is not None:
            self.memory.close()
            self.memory = None

    def _window_starts(self, step: int) -> None:
        c = self.cfg
        last = step + (c.freq - step % c.freq) % c.freq  # the next step divisible by freq
        logger.info(f"profiler: profiling steps {step}-{last} ({c.warmup} warm-up, {c.active} recorded), "
                    f"traces to {self.dump / c.folder / f'step-{last}'}")

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        path = trace_path(self.dump, self.cfg.folder, self._step, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        logger.info(f"profiler: traces of steps {self._first_recorded}-{self._step} written to {path.parent} "
                    f"(rank-R.json.gz per rank; open in {PERFETTO} or chrome://tracing)")

    def _end_region(self) -> None:
        if self._region is not None:
            self._region.__exit__(None, None, None)
            self._region = None


@contextlib.contextmanager
def _without_cycle_warning() -> Iterator[None]:
    """torch warns as a window starts that its trace will hold that window only: what weft wants."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        yield
