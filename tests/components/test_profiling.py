"""components/observe/profiling.py: the profiler's schedule, the trace and snapshot paths, the CUDA memory
recording's calls (stubbed on this CPU machine), the out-of-memory snapshot, profiled steps left
out of the throughput, and the bad inputs [profiling] refuses at plan time."""

from __future__ import annotations

import gzip
import inspect
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerAction

from weft import train
from weft.components.config import dump_folder
from weft.components.config.schema import Profiling
from weft.components.observe import profiling
from weft.components.observe.metrics import MetricsLogger, StepStats
from weft.components.observe.profiling import (
    MEMORY_VIZ,
    StepProfiler,
    memory_history_args,
    schedule_args,
    snapshot_due,
    snapshot_path,
    trace_path,
)

from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot

# ---- the decisions ------------------------------------------------------------------------------

def expected_action(step: int, freq: int, warmup: int, active: int) -> ProfilerAction:
    """The documented window, by hand: the `active` steps up to each multiple of freq are recorded
    (the last one saves), the `warmup` steps before them warm up."""
    to_next_multiple = -step % freq  # 0 at a multiple of freq
    if to_next_multiple == 0:
        return ProfilerAction.RECORD_AND_SAVE
    if to_next_multiple < active:
        return ProfilerAction.RECORD
    if to_next_multiple < active + warmup:
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")  # torch's note on warmup 0
@pytest.mark.parametrize("freq, warmup, active", [(3, 1, 1), (10, 3, 1), (5, 0, 2), (4, 2, 2), (1, 0, 1), (6, 2, 3)])
def test_schedule_windows_end_at_multiples_of_freq(freq, warmup, active):
    schedule = torch.profiler.schedule(**schedule_args(freq, warmup, active))
    for step in range(1, 4 * freq + 1):
        assert schedule(step) == expected_action(step, freq, warmup, active), step


def test_documented_paths():
    dump = Path("/runs/a")
    assert trace_path(dump, "profile_traces", 6, 1) == Path("/runs/a/profile_traces/step-6/rank-1.json.gz")
    assert snapshot_path(dump, 200, 3) == Path("/runs/a/memory_snapshot/step-200/rank-3.pickle")
    assert snapshot_path(dump, 17, 0, oom=True) == Path("/runs/a/memory_snapshot/step-17-oom/rank-0.pickle")


def test_snapshot_due_every_freq_steps():
    assert [step for step in range(1, 11) if snapshot_due(step, 4)] == [4, 8]
    assert [step for step in range(1, 4) if snapshot_due(step, 1)] == [1, 2, 3]


def test_memory_history_args_are_torch_s_with_python_stacks():
    args = memory_history_args(1234)
    assert args["stacks"] == "python" and args["max_entries"] == 1234 and args["enabled"] == "all"
    # torch's recording function takes exactly these keywords (its implementation's signature)
    inspect.signature(torch.cuda.memory._record_memory_history_impl).bind(**args)


def test_a_gpu_run_profiles_cuda_kernels_with_the_configured_options(tmp_path, monkeypatch):
    """What StepProfiler asks torch.profiler.profile for on a GPU (the profiler itself is not built)."""
    asked = {}

    class Recorded:
        def __init__(self, **kwargs):
            asked.update(kwargs)
            self.schedule = kwargs["schedule"]

        def start(self):
            asked["started_at"] = (self.step_num, self.current_action)

    monkeypatch.setattr(torch.profiler, "profile", Recorded)
    cfg = Profiling(enable=True, freq=5, warmup=2, active=1, record_shapes=True, with_stack=True)
    StepProfiler(cfg, tmp_path, "cuda", 0, metrics_logger(), start_step=7)
    assert asked["activities"] == [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    assert asked["record_shapes"] is True and asked["with_stack"] is True
    assert asked["started_at"] == (8, ProfilerAction.WARMUP)  # step 8 warms up the window 8-10
    assert profiling.activities("cpu") == [torch.profiler.ProfilerActivity.CPU]


# ---- the run, CUDA calls stubbed -----------------------------------------------------------------

class CudaMemoryCalls:
    """torch.cuda.memory's recording and dump, replaced: each call is recorded, each dump writes a file."""

    def __init__(self, monkeypatch) -> None:
        self.history: list[dict] = []
        self.dumps: list[str] = []
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: self.history.append(kw))
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self._dump)

    def _dump(self, filename: str) -> None:
        self.dumps.append(filename)
        Path(filename).write_bytes(b"snapshot")


class NoMetrics:
    """A MetricsLogger no one may touch: with [profiling] off, nothing is left out of the throughput."""

    def __getattr__(self, name):
        raise AssertionError(f"metrics.{name} used")


def metrics_logger() -> MetricsLogger:
    return MetricsLogger(device=torch.device("cpu"), flops_per_token=1.0, tokens_per_step=100, world_size=1,
                         tb_folder=None, jsonl_path=None)


def test_memory_snapshots_every_freq_steps_and_on_out_of_memory(tmp_path, monkeypatch, caplog):
    cuda = CudaMemoryCalls(monkeypatch)
    cfg = Profiling(enable_memory_snapshot=True, memory_snapshot_freq=2, memory_snapshot_max_entries=500)
    profiler = StepProfiler(cfg, tmp_path, "cuda", 3, metrics_logger())
    assert cuda.history == [{"enabled": "all", "context": "all", "stacks": "python", "max_entries": 500}]
    for step in range(1, 5):
        with profiler.step(step):
            pass
    assert cuda.dumps == [str(tmp_path / "memory_snapshot/step-2/rank-3.pickle"),
                          str(tmp_path / "memory_snapshot/step-4/rank-3.pickle")]
    with caplog.at_level(logging.INFO, logger="weft"), pytest.raises(torch.OutOfMemoryError):
        with profiler.step(5):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    oom_file = tmp_path / "memory_snapshot/step-5-oom/rank-3.pickle"
    assert cuda.dumps[-1] == str(oom_file) and oom_file.read_bytes() == b"snapshot"
    lines = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(lines) == 1 and str(oom_file) in lines[0] and MEMORY_VIZ in lines[0]
    profiler.close()
    assert cuda.history[-1] == {"enabled": None}


def test_off_creates_nothing_and_touches_nothing(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("created while [profiling] is off")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    profiler = StepProfiler(Profiling(), tmp_path / "dump", "cpu", 0, NoMetrics())
    for step in range(1, 4):
        with profiler.step(step):
            for phase in ("forward", "backward", "step"):
                profiler.on_phase(phase)
    profiler.close()
    assert not (tmp_path / "dump").exists()


def test_profiled_steps_are_left_out_of_the_throughput(tmp_path):
    """freq 3, warmup 1, active 1: steps 2-3 and 5-6 run under the profiler and are untimed; a log
    after each step shows them as nan tokens/s, the others measured; one trace per window."""
    metrics = metrics_logger()
    cfg = Profiling(enable=True, freq=3, warmup=1, active=1)
    profiler = StepProfiler(cfg, tmp_path, "cpu", 0, metrics)
    weights = torch.randn(64, 64, requires_grad=True)
    rates = {}
    for step in range(1, 7):
        with profiler.step(step):
            profiler.on_phase("forward")
            loss = (weights @ weights).sum()
            profiler.on_phase("backward")
            loss.backward()
            profiler.on_phase("step")
        metrics.step_done()
        rates[step] = metrics.log(StepStats(step, 0.0, 0.0, 0.0))["train/tokens_per_second"]
    profiler.close()
    assert [step for step, rate in rates.items() if math.isnan(rate)] == [2, 3, 5, 6]
    assert all(rates[step] > 0 for step in (1, 4))
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json.gz"))
    assert written == ["profile_traces/step-3/rank-0.json.gz", "profile_traces/step-6/rank-0.json.gz"]
    events = json.loads(gzip.decompress((tmp_path / written[1]).read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer", "ProfilerStep#6"} <= names and "ProfilerStep#5" not in names


def test_a_run_ending_inside_a_window_writes_its_recorded_steps(tmp_path, caplog):
    """freq 4, warmup 1, active 2: a run of 3 steps ends after step 3, recorded, of the window
    3-4: its trace is written as step-3; a run of 2 steps (warm-up only) writes none, and says so."""
    caplog.set_level(logging.INFO, logger="weft")
    for steps, expected in [(3, ["step-3"]), (2, [])]:
        dump = tmp_path / str(steps)
        profiler = StepProfiler(Profiling(enable=True, freq=4, warmup=1, active=2), dump, "cpu", 0, metrics_logger())
        for step in range(1, steps + 1):
            with profiler.step(step):
                torch.ones(8).sum()
        profiler.close()
        assert sorted(p.name for p in (dump / "profile_traces").glob("*")) == expected
    assert [r.getMessage() for r in caplog.records if "no trace" in r.getMessage()] == [
        "profiler: the run ended in the warm-up of a window, step 2: no trace"]


# ---- bad inputs ----------------------------------------------------------------------------------

def base(tmp: Path) -> list[str]:
    return ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp / "out"), "--training.steps", "2",
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--no-metrics.enable_tensorboard"]


def a_file_in_place(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    (tmp / "out/profile_traces").write_text("not a folder")
    return ["--profiling.enable"]


def below_a_file(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    (tmp / "out/traces").write_text("not a folder")
    return ["--profiling.enable", "--profiling.folder", "traces/run1"]


def snapshot_folder_a_file(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    (tmp / "out/memory_snapshot").write_text("not a folder")
    return ["--profiling.enable_memory_snapshot"]


@pytest.mark.parametrize("setup, expected", [
    (lambda tmp: ["--profiling.enable", "--profiling.freq", "3", "--profiling.warmup", "2", "--profiling.active", "2"],
     ["profiling.freq = 3", "profiling.warmup + profiling.active = 4"]),
    (lambda tmp: ["--profiling.enable_memory_snapshot"], ["profiling.enable_memory_snapshot", "needs CUDA"]),
    (a_file_in_place, ["profiling.folder = 'profile_traces'", "is a file"]),
    (below_a_file, ["profiling.folder = 'traces/run1'", "a file"]),
    (lambda tmp: ["--profiling.enable", "--profiling.freq", "0"], "profiling.freq"),
    (lambda tmp: ["--profiling.enable", "--profiling.active", "0"], "profiling.active"),
    (lambda tmp: ["--profiling.enable", "--profiling.warmup", "-1"], "profiling.warmup"),
    (lambda tmp: ["--profiling.memory_snapshot_freq", "0"], "profiling.memory_snapshot_freq"),
    (lambda tmp: ["--profiling.memory_snapshot_max_entries", "0"], "profiling.memory_snapshot_max_entries"),
    (lambda tmp: ["--profiling.freq", "5"], "profiling.enable"),  # a key of the section while it is off
], ids=["window-over-freq", "snapshot-on-cpu", "file-in-place", "below-a-file", "freq-0", "active-0", "warmup-neg",
        "snapshot-freq-0", "max-entries-0", "off"])
def test_bad_input(tmp_path, capsys, setup, expected):
    argv = base(tmp_path) + setup(tmp_path)
    before = snapshot(tmp_path)
    assert_clean_failure(run_in_process(train.main, argv, capsys), expected, before=before, root=tmp_path)


def test_unwritable_folder_is_refused(tmp_path, capsys, monkeypatch):
    """A parent this process may not write in (os.access says no: as root every folder is writable,
    so the answer is stubbed for that one folder)."""
    (tmp_path / "out/locked").mkdir(parents=True)
    real_access = dump_folder.os.access
    monkeypatch.setattr(dump_folder.os, "access",
                        lambda path, mode: Path(path) != tmp_path / "out/locked" and real_access(path, mode))
    argv = base(tmp_path) + ["--profiling.enable", "--profiling.folder", "locked/traces"]
    before = snapshot(tmp_path)
    assert_clean_failure(run_in_process(train.main, argv, capsys), ["profiling.folder = 'locked/traces'",
                         "is not writable"], before=before, root=tmp_path)
