"""train.py launched the way users launch it: torchrun, on one "node" or two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.dist_utils import free_port
from tests.support.failure_checks import every_rank_failed_or_was_stopped

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def train_args(dump: Path, *extra: str) -> list[str]:
    return ["train.py", "--job.config_file", "debug_model", "--job.dump_folder", str(dump),
            "--training.steps", "5", "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", *extra]


def launch(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*TORCHRUN, *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def losses(dump: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_node_hsdp_matches_single_node(tmp_path):
    """Two launchers meet through a c10d rendezvous on loopback; HSDP replicates across them."""
    hsdp = ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2")
    # The one-node reference and the two nodes are independent jobs (own ports, own dump folders):
    # they start together, so their start-ups and rendezvous overlap.
    single = launch("--nproc_per_node", "4", "--master_port", str(free_port()), *train_args(tmp_path / "single", *hsdp))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        launch("--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", endpoint, "--rdzv_id", "weft-test", *train_args(tmp_path / "multi", *hsdp))
        for node in (0, 1)
    ]
    try:
        for job in (single, *nodes):
            out, err = job.communicate(timeout=600)
            assert job.returncode == 0, err[-3000:]
    finally:
        for job in (single, *nodes):
            if job.poll() is None:
                job.kill()
    assert losses(tmp_path / "multi") == pytest.approx(losses(tmp_path / "single"), rel=1e-6)
    assert len(losses(tmp_path / "multi")) == 5


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout, message",
    [
        # seq_len 48: divisible by tp 3, so the head count is what stops it
        (3, ["--parallelism.tp", "3", "--training.seq_len", "48"],
         "parallelism.tp = 3: apply_tp: tp_mesh size 3 does not divide n_heads 8"),
        (2, ["--parallelism.cp", "2", "--training.seq_len", "30"], "divisible by 2·cp = 4, got 30"),
    ],  # (a world the layout does not divide, and a bad choice, fail the same way before any
        # process group: tests/e2e/test_train.py's bad-input cases cover their lines)
)
def test_bad_layout_fails_on_every_rank_without_hanging(tmp_path, nproc, layout, message):
    run = launch("--nproc_per_node", str(nproc), *train_args(tmp_path / "out", *layout))
    _, err = run.communicate(timeout=120)  # a rank stuck in a collective would time out here
    assert run.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("weft: error:")]
    assert every_rank_failed_or_was_stopped(err, nproc), err[-3000:]
    assert all(message in line for line in errors), err[-3000:]
    assert not (tmp_path / "out").exists()
