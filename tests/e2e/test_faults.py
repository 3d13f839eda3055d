"""Faults hours into a run: a non-finite step, a disk that fills during a save, a background save
that fails, a data file edited between save and resume, a rank that stops responding, a rank
that is killed under torchrun's restarts.

Each failing case is checked as every failure is (tests/support/failure_checks.py): exit status, one
`weft: error:` line naming the fault, no traceback, and the last good checkpoint byte-identical
from before the fault to after, with no partial folder left. The single-process cases run
train.py in this process and inject the fault there (a NaN loss, an ENOSPC write) at a step the
test chooses; the torchrun cases signal a real rank.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import weft.recipe.build as build_module
from weft import train
from weft.components.checkpoint import checkpointer as checkpoint_module

from tests.support.dist_utils import free_port
from tests.support.failure_checks import REPO, assert_clean_failure, python_path, run_in_process, snapshot
from tests.support.train_runs import run_args

# The injections go into the step's loss function (set up by recipe.build.build_step, which
# train.py calls) and into the data loader's prefetching (recipe.build.prefetch).


saving_args = partial(run_args, checkpoint_every=2)  # every run here saves every 2 steps (its steps in extra)


def checkpoints(dump: Path) -> dict[str, str]:
    """Every file of every step folder (complete or not), by path: what must not change."""
    return snapshot(dump / "checkpoint")


def step_folders(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


def inject_nan(monkeypatch, steps: set[int], on_inject=lambda step: None) -> None:
    """The loss of the given steps (one micro-batch each) becomes NaN, and so do their gradients."""
    real_build_step, calls = build_module.build_step, [0]

    def build_step(*args, **kwargs):
        setup = real_build_step(*args, **kwargs)
        real_loss = setup.loss_fn

        def loss_fn(*loss_args, **loss_kwargs):
            calls[0] += 1
            loss = real_loss(*loss_args, **loss_kwargs)
            if calls[0] in steps:
                on_inject(calls[0])
                return loss * float("nan")
            return loss

        setup.loss_fn = loss_fn
        return setup

    monkeypatch.setattr(build_module, "build_step", build_step)  # as build_training calls it


# -- non-finite steps -----------------------------------------------------------------------

def test_nan_with_stop_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    dump, before = tmp_path / "run", {}
    inject_nan(monkeypatch, {5}, on_inject=lambda step: before.update(checkpoints(dump)))
    outcome = run_in_process(train.main, saving_args(dump, "--training.steps", "8", "--checkpoint.keep_latest_k", "1"),
                             capsys)
    assert_clean_failure(outcome, ["step 5: loss nan", "gradient norm nan", "training.on_nonfinite = stop"])
    assert step_folders(dump) == ["step-4"]  # keep_latest_k = 1 pruned step-2 before the fault, nothing after
    assert checkpoints(dump) == before


class DropBatch:
    """A loader that silently leaves out its `index`-th batch (1-based): a run that never saw it."""

    def __init__(self, loader, index: int):
        self._loader, self._index, self._taken = loader, index, 0

    def __next__(self):
        self._taken += 1
        if self._taken == self._index:
            next(self._loader)
        return next(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def saved_state(folder: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Model, optimizer and LR-schedule state of a checkpoint, flattened (no data cursor, no step)."""
    out = tmp_path / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    state = torch.load(out, weights_only=False)
    flat: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        else:
            flat[prefix] = value
    for section in ("model", "optimizer", "lr_scheduler"):
        walk(section, state[section])
    return flat


def test_skip_a_bad_batch_ends_where_a_run_without_it_ends(tmp_path, monkeypatch, capsys):
    """Step 3's loss is NaN: `skip` leaves weights, optimizer state and LR schedule untouched, so
    the run's 6 steps end exactly where 5 steps that never saw batch 3 end (warmup-only schedule,
    so the rate of each update does not depend on the total step count)."""
    common = ("--lr_scheduler.warmup_steps", "100", "--checkpoint.interval", "100")
    inject_nan(monkeypatch, {3})
    skipping = run_in_process(train.main, saving_args(tmp_path / "skip", "--training.steps", "6", *common,
                                                      "--training.on_nonfinite", "skip"), capsys)
    assert skipping.code == 0, skipping.stderr
    assert "step 3: loss nan (this rank), gradient norm nan: not finite; optimizer step skipped" in skipping.stdout
    monkeypatch.undo()

    real_prefetch = build_module.prefetch
    monkeypatch.setattr(build_module, "prefetch", lambda *a, **k: DropBatch(real_prefetch(*a, **k), index=3))
    without = run_in_process(train.main, saving_args(tmp_path / "without", "--training.steps", "5", *common), capsys)
    assert without.code == 0, without.stderr

    skipped = saved_state(tmp_path / "skip/checkpoint/step-6", tmp_path)
    reference = saved_state(tmp_path / "without/checkpoint/step-5", tmp_path)
    assert skipped.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(skipped[key], value) if isinstance(value, torch.Tensor) else skipped[key] == value, key
    records = [json.loads(line) for line in (tmp_path / "skip/metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
    expected = [json.loads(line)["train/loss"] for line in (tmp_path / "without/metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in records[3:]] == expected[2:]  # steps 4-6 are the other run's 3-5


def test_too_many_skips_in_a_row_stop_the_run(tmp_path, monkeypatch, capsys):
    dump, before = tmp_path / "run", {}
    inject_nan(monkeypatch, {3, 4}, on_inject=lambda step: before.update(checkpoints(dump)) if step == 3 else None)
    outcome = run_in_process(train.main, saving_args(dump, "--training.steps", "8", "--training.on_nonfinite", "skip",
                                                     "--training.max_skipped_steps", "2"), capsys)
    assert_clean_failure(outcome, ["step 4:", "not finite for 2 steps in a row (training.max_skipped_steps = 2)"])
    assert step_folders(dump) == ["step-2"] and checkpoints(dump) == before


def test_keep_latest_k_spares_the_last_checkpoint_before_a_skipped_step(tmp_path, monkeypatch, capsys):
    """Step 5 is skipped: step-4 (the newest checkpoint before it) outlives keep_latest_k = 1."""
    dump = tmp_path / "run"
    inject_nan(monkeypatch, {5})
    outcome = run_in_process(train.main, saving_args(dump, "--training.steps", "8", "--checkpoint.keep_latest_k", "1",
                                                     "--training.on_nonfinite", "skip"), capsys)
    assert outcome.code == 0, outcome.stderr
    assert step_folders(dump) == ["step-4", "step-8"]


# -- save errors ----------------------------------------------------------------------------

class FillingDisk:
    """DCP's file streams, on a disk that fills during the save of `step`: a write fails with
    ENOSPC after `room` bytes. Records the checkpoints as they were when it filled."""

    def __init__(self, monkeypatch, dump: Path, step: int, room: int = 4096):
        self.dump, self.step, self.room, self.before = dump, step, room, None
        real = dcp_filesystem.FileSystem.create_stream
        disk = self

        def create_stream(fs, path, mode):
            stream = real(fs, path, mode)
            if "w" in mode and Path(path).parent.name == f"step-{disk.step}":
                return disk.wrap(stream)
            return stream

        monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", create_stream)

    def wrap(self, context):
        disk = self

        class Full:
            def __enter__(self):
                self.inner = context.__enter__()
                return self

            def __exit__(self, *exc):
                return context.__exit__(*exc)

            def write(self, data):
                if disk.room < len(data):
                    if disk.before is None:
                        disk.before = {k: v for k, v in checkpoints(disk.dump).items()
                                       if not k.startswith(f"step-{disk.step}")}
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.room -= len(data)
                return self.inner.write(data)

            def __getattr__(self, name):
                return getattr(self.inner, name)

        return Full()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_disk_fills_during_a_save(tmp_path, monkeypatch, capsys, mode):
    """The step-4 save fails with ENOSPC (in the background with async, reported at a later step,
    before the next save): one line with the folder, bytes needed and free; step-4 removed;
    step-2 untouched; no later checkpoint."""
    dump = tmp_path / "run"
    disk = FillingDisk(monkeypatch, dump, step=4)
    outcome = run_in_process(train.main, saving_args(dump, "--training.steps", "6", "--checkpoint.async_mode", mode),
                             capsys)
    folder = dump / "checkpoint" / "step-4"
    assert_clean_failure(outcome, [f"checkpoint {folder}: the disk filled while saving step 4 (ENOSPC",
                                   " free; the partial folder was removed"])
    assert re.search(r"needs about [\d,]+ bytes, [\d,]+ free", outcome.stderr)
    assert step_folders(dump) == ["step-2"] and checkpoints(dump) == disk.before


def test_save_error_continue_trains_on_and_saves_at_the_next_interval(tmp_path, monkeypatch, capsys):
    dump = tmp_path / "run"
    FillingDisk(monkeypatch, dump, step=4)
    outcome = run_in_process(train.main, saving_args(dump, "--training.steps", "6", "--checkpoint.on_save_error",
                                                     "continue"), capsys)
    assert outcome.code == 0, outcome.stderr
    assert "the disk filled while saving step 4" in outcome.stdout and "training on" in outcome.stdout
    assert step_folders(dump) == ["step-2", "step-6"]


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    """Before each save, free space is compared with the previous checkpoint's size."""
    dump, before = tmp_path / "run", {}
    real_free = checkpoint_module.free_bytes

    def free_bytes(path):
        if (dump / "checkpoint" / "step-2" / "COMPLETE").exists():
            before.update(before or checkpoints(dump))
            return 1000
        return real_free(path)

    monkeypatch.setattr(checkpoint_module, "free_bytes", free_bytes)
    outcome = run_in_process(train.main, saving_args(dump, "--training.steps", "6"), capsys)
    size = sum(p.stat().st_size for p in (dump / "checkpoint" / "step-2").iterdir())
    assert_clean_failure(outcome, f"not enough free space to save step 4: needs about {size:,} bytes (the size of "
                                  f"step-2), 1,000 free; nothing was written")
    assert step_folders(dump) == ["step-2"] and checkpoints(dump) == before


# -- data that changed ----------------------------------------------------------------------

def test_data_file_edited_between_save_and_resume(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("hamlet.txt", "macbeth.txt"):
        shutil.copy(REPO / "assets/data/shakespeare" / name, data / name)
    dump = tmp_path / "run"
    first = run_in_process(train.main, saving_args(dump, "--training.steps", "2", "--data.dataset_path", str(data)),
                           capsys)
    assert first.code == 0, first.stderr
    with (data / "macbeth.txt").open("a") as f:
        f.write("\nEnter a new witch.\n")
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, saving_args(dump, "--training.steps", "4", "--data.dataset_path", str(data)),
                             capsys)
    assert_clean_failure(outcome, ["file macbeth.txt changed", "data.allow_changed_data"], before=before, root=tmp_path)

    allowed = run_in_process(train.main, saving_args(dump, "--training.steps", "4", "--data.dataset_path", str(data),
                                                     "--data.allow_changed_data"), capsys)
    assert allowed.code == 0, allowed.stderr
    assert "file macbeth.txt changed" in allowed.stdout and "resuming anyway" in allowed.stdout
    assert step_folders(dump) == ["step-2", "step-4"]


# -- ranks under torchrun ---------------------------------------------------------------------

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
# torchrun 2.13 shares its rendezvous store with the workers, and a restarted round then reads the
# dead round's gloo addresses (pytorch/pytorch#135712); the README says to set this for restarts.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch(dump: Path, *extra: str, max_restarts: int = 0) -> subprocess.Popen:
    """train.py under torchrun: on a free port, or, for a job that restarts, on torchrun's default
    (given --master_port, its restarted ranks hung)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **RESTARTABLE}
    port = [] if max_restarts else ["--master_port", str(free_port())]
    return subprocess.Popen([*TORCHRUN, *port, "--max-restarts", str(max_restarts),
                             "train.py", *saving_args(dump, *extra)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def logged_steps(dump: Path) -> list[int]:
    path = dump / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    """The training process of `rank` (torchrun's child whose environment says RANK=rank)."""
    for child in psutil.Process(launcher.pid).children():
        if child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no worker of rank {rank}")


def wait_for_step(launcher: subprocess.Popen, dump: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not logged_steps(dump) or logged_steps(dump)[-1] < step:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach step {step}"
        time.sleep(0.05)


def losses(dump: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_timeout(tmp_path):
    """SIGSTOP rank 1 mid-run: rank 0's collective times out after comm.train_timeout_seconds and
    it exits in one line naming the step, rank 1 and the phase rank 1 last entered (published
    before it was stopped). (torchrun would SIGKILL the stopped rank 30 s later; the test resumes
    it instead, to save the wait, and it then fails on its lost peer.)"""
    timeout_s = 5
    dump = tmp_path / "run"
    run = launch(dump, "--training.steps", "10000", "--checkpoint.interval", "5",
                 "--comm.train_timeout_seconds", str(timeout_s))
    try:
        wait_for_step(run, dump, 6)
        survivor, stopped = worker(run, 0), worker(run, 1)
        stopped.suspend()  # SIGSTOP
        start = time.monotonic()
        before = {k: v for k, v in checkpoints(dump).items()
                  if (dump / "checkpoint" / k.split("/")[0] / "COMPLETE").exists()}
        survivor.wait(timeout=timeout_s + 30)
        survived_s = time.monotonic() - start
        stopped.resume()
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert survived_s < timeout_s + 30, survived_s
    assert run.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("weft: error:")]
    found = re.search(rf"^weft: error: step (\d+): a collective waited longer than comm.train_timeout_seconds = "
                      rf"{timeout_s} s \(.*\); rank 1 did not respond; last seen: step (\d+) "
                      rf"(forward|backward|optimizer|checkpoint)$", lines[0])
    assert found, err[-3000:]
    # Rank 0 waits in a collective of its step that rank 1 did not finish: rank 1 stopped in that
    # step, or at the end of the step before (after its last collective), or just into the next
    # (a rank may finish its side of a collective, sends buffered, before the other's ends).
    waiting, seen = int(found[1]), int(found[2])
    assert abs(seen - waiting) <= 1, lines[0]
    assert all("step" in line for line in lines[1:]) and len(lines) <= 2, err[-3000:]  # rank 1: its lost peer
    assert checkpoints(dump) == before  # complete checkpoints untouched, no partial folder


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_newest_checkpoint(tmp_path):
    """SIGKILL rank 1 under --max-restarts 1: the job restarts, resumes from the newest complete
    checkpoint, and logs the same losses, bit for bit, as a run never interrupted."""
    steps = ("--training.steps", "10")
    dump = tmp_path / "killed"
    # The two jobs are independent (own dump folders; the reference on a port of its own, the job
    # that restarts on torchrun's default): they run at the same time.
    uninterrupted = launch(tmp_path / "whole", *steps)
    run = launch(dump, *steps, max_restarts=1)
    try:
        wait_for_step(run, dump, 5)
        worker(run, 1).kill()  # SIGKILL
        out, err = run.communicate(timeout=300)
        _, whole_err = uninterrupted.communicate(timeout=300)
    finally:
        for job in (run, uninterrupted):
            if job.poll() is None:
                job.kill()
    assert uninterrupted.returncode == 0, whole_err[-3000:]
    assert run.returncode == 0, err[-3000:]
    assert "checkpoint: resumed from step" in out + err  # torchrun restarted the job, which resumed
    assert losses(dump) == losses(tmp_path / "whole")
    assert len(losses(dump)) == 10
