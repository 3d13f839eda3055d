"""What a hung job leaves behind: the flight recorder's environment and paths ([comm] trace_buf_size,
trace_folder), the bad values refused at plan time, and the gloo record of each rank's last phase
that the timeout line reads. (A rank really stopped by SIGSTOP: tests/e2e/test_faults.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from weft import train
from weft.components.config import parse_args
from weft.components.distributed import timeouts as timeouts_module
from weft.components.distributed.cpu_ranks import run_distributed
from weft.components.distributed.flight_recorder import (
    PhaseRecord,
    flight_recorder_env,
    start_flight_recorder,
    trace_prefix,
)
from weft.components.distributed.timeouts import CommTimeouts

from tests.support.failure_checks import assert_clean_failure, python_path, run_in_process, snapshot


def config(*extra: str):
    return parse_args(["--job.config_file", "debug_model", "--job.dump_folder", "/runs/a", *extra])


def test_the_flight_recorder_environment_names_what_torch_reads():
    # The names torch 2.13 reads (FlightRecorder.cpp: TORCH_FR_* first, the older TORCH_NCCL_* as
    # fallback; ProcessGroupNCCL: TORCH_NCCL_DUMP_ON_TIMEOUT), each rank's file <prefix><rank>.
    assert flight_recorder_env(0, "/runs/a/comm_traces/rank_") == {}
    assert flight_recorder_env(2000, "/runs/a/comm_traces/rank_") == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/comm_traces/rank_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/a/comm_traces/rank_"}
    assert trace_prefix(config()) == Path("/runs/a/comm_traces/rank_")
    assert trace_prefix(config("--comm.trace_folder", "hangs/fr")) == Path("/runs/a/hangs/fr/rank_")


RECORD_LAST = """
import pickle, torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(5):
    dist.all_reduce(torch.ones(1))
print(len(pickle.loads(_dump_fr_trace())["entries"]))
"""


@pytest.mark.slow  # ~3-4 s: a fresh interpreter imports torch
def test_torch_keeps_as_many_collectives_as_the_environment_says():
    """The buffer size set is the one torch's recorder honours (its gloo side, the one a CPU build
    has: the same FlightRecorder class NCCL's uses): 3 entries kept of 5 all-reduces."""
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1",
           **flight_recorder_env(3, "/nonexistent/rank_")}
    out = subprocess.run([sys.executable, "-c", RECORD_LAST], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3"]


def test_starting_the_recorder_sets_the_environment_and_creates_the_folder(tmp_path, monkeypatch):
    for name in flight_recorder_env(1, ""):
        monkeypatch.delenv(name, raising=False)
    off = parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "off")])
    start_flight_recorder(off)
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and not (tmp_path / "off").exists()
    on = parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "on"),
                     "--comm.trace_buf_size", "2000"])
    start_flight_recorder(on)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "on/comm_traces/rank_")
    assert (tmp_path / "on/comm_traces").is_dir()


def test_a_negative_buffer_size_is_refused(tmp_path, capsys):
    dump = tmp_path / "run"
    outcome = run_in_process(train.main, ["--job.config_file", "debug_model", "--job.dump_folder", str(dump),
                                          "--comm.trace_buf_size", "-1"], capsys)
    assert_clean_failure(outcome, "comm.trace_buf_size")
    assert not dump.exists()


def test_a_trace_folder_that_cannot_be_created_is_refused_before_writing(tmp_path, capsys):
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "traces").write_text("a file where the folder would go")
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, ["--job.config_file", "debug_model", "--job.dump_folder", str(dump),
                                          "--comm.trace_buf_size", "100", "--comm.trace_folder", "traces/nccl"], capsys)
    assert_clean_failure(outcome, f"comm.trace_folder = 'traces/nccl': {dump / 'traces/nccl'} is below "
                                  f"{dump / 'traces'}, a file; expected a folder",
                         before=before, root=tmp_path)


def silent_rank_in_forward() -> str | None:
    """Rank 1 publishes step 2's phases up to backward, then never joins step 2's all-reduce;
    rank 0's all-reduce times out and becomes the timeout line, which rank 0 returns."""
    timeouts_module.CHECK_IN_S = 0.5  # rank 1 never checks in: do not wait the full 3 s for it
    rank = dist.get_rank()
    timeouts = CommTimeouts(60, 1, phases=PhaseRecord.for_job())
    timeouts.at_step(1)
    timeouts.at_step(2)  # the short limit from here
    store = dist.distributed_c10d._get_default_store()
    for phase in ("forward", "backward", "forward", "step"):  # train_step's calls, one micro-batch
        if rank == 1 and phase == "step":
            store.wait(["rank 0 done"])  # silent: never reaches the optimizer's all-reduce
            return None
        timeouts.phase(phase)
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:
        line = str(timeouts.translate(error))
    store.set("rank 0 done", "1")
    time.sleep(0.5)  # rank 1 reads the key before the store's host (rank 0) goes
    return line


@pytest.mark.slow  # ~4 s: two processes start
def test_a_silent_ranks_last_phase_is_named():
    line = run_distributed(silent_rank_in_forward, 2, timeout=60)[0]
    assert line.startswith("step 2: a collective waited longer than comm.train_timeout_seconds = 1 s ("), line
    # the second "forward" of train_step (after the last backward) is not published again
    assert line.endswith("); rank 1 did not respond; last seen: step 2 backward"), line

