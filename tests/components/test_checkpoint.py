"""Checkpoints: exact resume, resume in another layout, seed checkpoints, crashes, bad input."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from weft.components.checkpoint import checkpointer as checkpoint_module
from weft.components.checkpoint.checkpointer import COMPLETE, CheckpointError, complete_steps
from weft.components.config import ConfigError
from weft.recipe import build as recipe_build

from tests.support import REPO
from tests.support.blocks import fewer_blocks
from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run, run_args

STEPS = 20
LAYOUTS = {
    "single": [],
    "fsdp4": ["--parallelism.dp_shard", "4"],
    "fsdp2_tp2": ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"],
}


def args(dump: Path, layout: str = "single", *extra: str) -> list[str]:
    dp = {"single": 1, "fsdp4": 4, "fsdp2_tp2": 2}[layout]
    return run_args(dump, "--lr_scheduler.warmup_steps", "2", *LAYOUTS[layout], *extra, steps=STEPS, batch=8 // dp,
                    checkpoint_every=5)


def logged_losses(dump: Path) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs the steps it repeats again)."""
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records}


SHORT = ["--training.steps", "10"]  # the 4-rank runs: 10 steps, a checkpoint at 5 (4 ranks on 2 cores are slow)
# ... and the debug model cut to 2 blocks (each block is saved, split and resharded alike), also in the one
# process that resumes their checkpoint.
BLOCKS = {"debugmodel": 2}


def four_rank_runs(root: str) -> dict[str, list[float]]:
    """Worker: the fsdp4 and fsdp2 x tp2 runs of 10 steps; returns the loss history of each."""
    with fewer_blocks(BLOCKS):
        return four_rank_histories(Path(root))


def four_rank_histories(root: Path) -> dict[str, list[float]]:
    out = {
        "fsdp4_straight": run(args(root / "fsdp4_straight", "fsdp4", *SHORT)),
        "fsdp4_first_half": run(args(root / "fsdp4", "fsdp4", *SHORT), stop_after=5),
        "fsdp2_tp2_straight": run(args(root / "fsdp2_tp2_straight", "fsdp2_tp2", *SHORT)),
        "fsdp2_tp2_first_half": run(args(root / "fsdp2_tp2", "fsdp2_tp2", *SHORT), stop_after=5),
    }
    out["fsdp2_tp2_resumed"] = run(args(root / "fsdp2_tp2", "fsdp2_tp2", *SHORT))
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(root / "fsdp4", root / "fsdp4_for_single")
    dist.barrier()
    out["fsdp4_to_fsdp2_tp2"] = run(args(root / "fsdp4", "fsdp2_tp2", *SHORT))
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt4")
    return root, run_distributed(four_rank_runs, 4, str(root), timeout=900)[0]


@pytest.mark.slow
def test_exact_resume_single_device(tmp_path):
    straight = run(args(tmp_path / "straight"))
    first = run(args(tmp_path / "resumed"), stop_after=10)
    assert complete_steps(tmp_path / "resumed" / "checkpoint") == [5, 10]
    second = run(args(tmp_path / "resumed"))
    assert len(first) == 10 and len(second) == 10
    assert first + second == straight  # bit-identical


@pytest.mark.slow
def test_exact_resume_fsdp2_tp2(four_ranks):
    _, runs = four_ranks
    assert runs["fsdp2_tp2_first_half"] + runs["fsdp2_tp2_resumed"] == runs["fsdp2_tp2_straight"]


@pytest.mark.slow
def test_resume_fsdp4_checkpoint_under_fsdp2_tp2(four_ranks):
    _, runs = four_ranks
    assert runs["fsdp4_to_fsdp2_tp2"] == pytest.approx(runs["fsdp4_straight"][5:], rel=1e-4)


@pytest.mark.slow
def test_resume_fsdp4_checkpoint_on_one_device(four_ranks):
    root, runs = four_ranks
    with fewer_blocks(BLOCKS):
        resumed = run(args(root / "fsdp4_for_single", "single", *SHORT))
    assert resumed == pytest.approx(runs["fsdp4_straight"][5:], rel=1e-4)


def test_keep_latest_k(tmp_path):
    run(args(tmp_path, "single", "--training.steps", "12", "--checkpoint.interval", "3",
             "--checkpoint.keep_latest_k", "2"))
    assert complete_steps(tmp_path / "checkpoint") == [9, 12]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-12", "step-9"]


@pytest.mark.slow
def test_async_save_resumes_exactly(tmp_path):
    straight = run(args(tmp_path / "straight"))
    first = run(args(tmp_path / "async", "single", "--checkpoint.async_mode", "async"), stop_after=10)
    second = run(args(tmp_path / "async", "single", "--checkpoint.async_mode", "async"))
    assert first + second == straight


@pytest.mark.slow
def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    real_save = checkpoint_module.dcp.save

    def save_then_die(state, checkpoint_id):
        if checkpoint_id.endswith("step-10"):
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a checkpoint")
            raise KeyboardInterrupt("killed during save")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint_module.dcp, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(args(tmp_path))
    assert complete_steps(tmp_path / "checkpoint") == [5]
    assert (tmp_path / "checkpoint" / "step-10").exists()  # the half-written one is there, unmarked
    monkeypatch.setattr(checkpoint_module.dcp, "save", real_save)

    resumed = run(args(tmp_path))  # loads step 5, saves 10 afresh, ... 20
    straight = run(args(tmp_path / "straight"))
    assert resumed == straight[5:]
    assert complete_steps(tmp_path / "checkpoint") == [5, 10, 15, 20]


def test_seed_checkpoint_sets_the_starting_weights(tmp_path):
    seed_dir = tmp_path / "seed"
    run(["--job.config_file", "debug_model", "--job.dump_folder", str(seed_dir), "--training.seed", "1",
         "--training.seq_len", "32", "--checkpoint.create_seed_checkpoint"])
    assert complete_steps(seed_dir / "checkpoint") == [0]
    seeded = run(args(tmp_path / "from_seed", "single", "--checkpoint.initial_load_path",
                      str(seed_dir / "checkpoint" / "step-0"), "--training.steps", "2"))
    fresh_seed0 = run(args(tmp_path / "fresh0", "single", "--training.steps", "2"))
    fresh_seed1 = run(args(tmp_path / "fresh1", "single", "--training.steps", "2", "--training.seed", "1"))
    assert seeded[0] == fresh_seed1[0] != fresh_seed0[0]


def test_seed_checkpoint_is_built_on_the_cpu_on_a_gpu_machine(tmp_path, monkeypatch):
    """With a GPU chosen for the process, the seed checkpoint still builds the whole model on the CPU
    (a 70B model is 280 GB in fp32). This CPU build of torch fails any use of the CUDA device."""
    monkeypatch.setattr(recipe_build, "init_distributed", lambda *args, **kwargs: torch.device("cuda", 0))
    run(args(tmp_path, "single", "--checkpoint.create_seed_checkpoint"))
    assert complete_steps(tmp_path / "checkpoint") == [0]


def test_seed_checkpoint_in_dump_folder_is_picked_up(tmp_path):
    run(args(tmp_path, "single", "--checkpoint.create_seed_checkpoint"))
    assert run(args(tmp_path, "single", "--training.steps", "2"))[0] == run(
        args(tmp_path / "fresh", "single", "--training.steps", "2"))[0]


# -- bad input -------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_missing_load_step(tmp_path):
    run(args(tmp_path, "single", "--training.steps", "5"))
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint.load_step = 3: no complete checkpoint .*step-3 "
                                              r"\(complete: \[5\]\)"):
        run(args(tmp_path, "single", "--checkpoint.load_step", "3"))
    assert snapshot(tmp_path) == before


def test_corrupt_checkpoint(tmp_path):
    run(args(tmp_path, "single", "--training.steps", "5"))
    (tmp_path / "checkpoint" / "step-5" / ".metadata").write_bytes(b"garbage")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-5: cannot read its DCP metadata"):
        run(args(tmp_path))
    assert snapshot(tmp_path) == before


def test_checkpoint_of_another_model_shape(tmp_path, monkeypatch):
    from dataclasses import replace

    from weft.models.llama import LLAMA_FLAVORS

    monkeypatch.setitem(LLAMA_FLAVORS, "debugmodel", replace(LLAMA_FLAVORS["debugmodel"], dim=128))
    run(args(tmp_path / "other", "single", "--checkpoint.create_seed_checkpoint"))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"tok_embeddings.weight has shape \[2048, 128\], "
                                              r"the model expects \[2048, 256\]"):
        run(args(tmp_path / "run", "single", "--checkpoint.initial_load_path",
                 str(tmp_path / "other" / "checkpoint" / "step-0")))


def test_incomplete_initial_checkpoint(tmp_path):
    (tmp_path / "half" / "step-3").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"^checkpoint.initial_load_path: checkpoint .*step-3 has no COMPLETE"):
        run(args(tmp_path / "run", "single", "--checkpoint.initial_load_path", str(tmp_path / "half" / "step-3")))


def test_dump_folder_of_another_config_is_refused_untouched(tmp_path):
    run(args(tmp_path, "single", "--training.steps", "5"))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"config.toml is a run with training.seq_len = 32, this run has 64"):
        run(args(tmp_path, "single", "--training.seq_len", "64"))
    assert snapshot(tmp_path) == before


# -- crashes, as a user meets them -----------------------------------------------------------


def launch(dump: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "train.py", *args(dump)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_step(dump: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (dump / "metrics.jsonl").exists() and max(logged_losses(dump), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"never reached step {step}: {proc.stderr.read() if proc.poll() is not None else ''}")


@pytest.mark.slow
def test_sigkill_then_restart_resumes_to_the_same_losses(tmp_path):
    straight = run(args(tmp_path / "straight"))
    crash_at = random.Random().randint(6, 15)  # after the first checkpoint (step 5)
    proc = launch(tmp_path / "crash")
    wait_for_step(tmp_path / "crash", crash_at, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    restarted = launch(tmp_path / "crash")
    assert restarted.wait(timeout=300) == 0, restarted.stderr.read()
    losses = logged_losses(tmp_path / "crash")
    assert [losses[s] for s in range(1, STEPS + 1)] == straight, f"killed at step {crash_at}"


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    proc = launch(tmp_path)
    wait_for_step(tmp_path, 7, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    steps = complete_steps(tmp_path / "checkpoint")
    last_logged = max(logged_losses(tmp_path))
    assert steps[-1] == last_logged < STEPS  # it stopped early, with a checkpoint of its last step
    assert (tmp_path / "checkpoint" / f"step-{last_logged}" / COMPLETE).is_file()


def test_a_data_position_of_another_kind_is_refused_in_one_line(tmp_path):
    """A checkpoint of one dataset's position cannot resume a mixture run, nor the reverse: the
    refusal says which is which (DCP alone would name a missing key)."""
    import torch.distributed.checkpoint as dcp

    from weft.components.checkpoint.checkpointer import check_loader_state

    single = {"epoch": 0, "file_index": 1, "byte_offset": 0, "line_number": 0, "token_offset": 5}
    mixture = {"mixture": json.dumps({"web": {"tokens": 64, **single}})}
    for name, state in (("single", single), ("mixture", mixture)):
        dcp.save({"dataloader": state}, checkpoint_id=str(tmp_path / name), no_dist=True)
    check_loader_state(tmp_path / "single", single)
    check_loader_state(tmp_path / "mixture", mixture)
    with pytest.raises(CheckpointError, match="its data position is one dataset's .* this run's data is a "
                                              "data.mixture's"):
        check_loader_state(tmp_path / "single", mixture)
    with pytest.raises(CheckpointError, match="its data position is a data.mixture's and this run's data is one "
                                              "dataset's"):
        check_loader_state(tmp_path / "mixture", single)
