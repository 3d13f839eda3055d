"""Slow ranks: the figures each rank's log gathers, the rank they name, and a 2-rank run in which
one rank's data is made slow."""

from __future__ import annotations

import io
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.slow_rank import slow_data
from weft import train
from weft.components.config import parse_args
from weft.components.observe.rank_times import gather_device, rank_scalars, slow_rank_note, slowest_rank
from weft.recipe.build import build_training

from tests.support.dist_utils import run_distributed
from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.train_runs import run_args

DELAY_S = 0.3


def test_slowest_rank_is_the_one_whose_data_wait_holds_the_others_back():
    # Two ranks whose steps both took 0.25 s: rank 1 waited 0.2 s for data, rank 0 waited 0.2 s
    # for rank 1 inside the step. Compute (rank 1's step less its wait): 0.049. Own times:
    # 0.049 + 0.001 and 0.049 + 0.201; their median 0.15.
    times = torch.tensor([[0.25, 0.001], [0.25, 0.201]], dtype=torch.float64)
    rank, ratio = slowest_rank(times)
    assert rank == 1 and ratio == pytest.approx(0.25 / 0.15)
    assert slow_rank_note(times, 1.2) == "  slowest_rank 1 x1.67"
    assert slow_rank_note(times, 0) == "" and slow_rank_note(times, 2.0) == ""  # off; under the threshold
    even = torch.tensor([[0.25, 0.001], [0.25, 0.002], [0.25, 0.0015]], dtype=torch.float64)
    assert slow_rank_note(even, 1.2) == ""


def test_large_worlds_record_only_the_summary_of_each_figure():
    step = [0.5 + 0.001 * (r % 7) for r in range(1000)]
    wait = [0.01 * (r == 613) + 0.001 for r in range(1000)]
    values = rank_scalars(torch.tensor([step, wait], dtype=torch.float64).T)
    assert not any(key.split("/")[-1].isdigit() for key in values)
    assert values["ranks/data_wait_seconds/argmax"] == 613 and values["ranks/data_wait_seconds/max"] == 0.011
    assert values["ranks/step_seconds/median"] == pytest.approx(statistics.median(step))
    assert values["ranks/step_seconds/max"] == max(step) and values["ranks/slowest_rank"] == 613
    small = rank_scalars(torch.tensor([step[:3], wait[:3]], dtype=torch.float64).T)
    assert [small[f"ranks/step_seconds/{r}"] for r in range(3)] == step[:3]


def test_the_gather_runs_on_the_device_its_backend_takes():
    gpu, cpu = torch.device("cuda", 3), torch.device("cpu")
    assert gather_device("nccl", gpu) == gpu
    assert gather_device("gloo", gpu) == cpu and gather_device("cuda:nccl,cpu:gloo", gpu) == cpu
    assert gather_device("gloo", cpu) == cpu


THRESHOLD = ("--metrics.slow_rank_threshold", "1.1")


def slow_and_even_runs(root: str) -> str:
    """Two runs in one 2-rank group, the first with rank 1's data slow (as benchmarks/slow_rank.py
    makes it); rank 0's log output."""
    import torch.distributed as dist

    out, sys.stdout = sys.stdout, io.StringIO()  # the log handler, made at build, writes here
    try:
        for name, slow in (("slow", True), ("even", False)):
            build = slow_data(build_training, DELAY_S) if slow and dist.get_rank() == 1 else build_training
            train.train(parse_args(run_args(Path(root) / name, *THRESHOLD, seq_len=64)), build_training=build)
        return sys.stdout.getvalue()
    finally:
        sys.stdout = out


@pytest.mark.slow
def test_a_rank_with_slow_data_is_named_and_its_figures_recorded(tmp_path):
    log = run_distributed(slow_and_even_runs, 2, str(tmp_path), timeout=120)[0]
    slow_lines = [line for line in log.splitlines() if " loss " in line][:4]
    even_lines = [line for line in log.splitlines() if " loss " in line][4:]
    assert len(slow_lines) == 4 and len(even_lines) == 4, log
    # the first step's window holds start-up (the first batch, warm-up), of either rank: not compared
    assert all("slowest_rank 1 x" in line for line in slow_lines[1:]), log
    assert not any("slowest_rank" in line for line in even_lines[1:]), log

    records = [json.loads(line) for line in (tmp_path / "slow" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records[1:]:  # (the first batch waits for every rank's loader: a shared start)
        # rank 1 slept DELAY_S before each batch; rank 0 waited for it inside the step, so both
        # ranks' steps took at least DELAY_S
        assert record["ranks/data_wait_seconds/1"] >= DELAY_S > record["ranks/data_wait_seconds/0"]
        assert min(record["ranks/step_seconds/0"], record["ranks/step_seconds/1"]) >= DELAY_S
        assert record["ranks/slowest_rank"] == 1 and record["ranks/data_wait_seconds/argmax"] == 1
    ratio = float(slow_lines[-1].split("slowest_rank 1 x")[1].split()[0])
    assert ratio == pytest.approx(records[-1]["ranks/slowest_ratio"], abs=0.006)


@pytest.mark.parametrize("value", ["0.5", "-1"])
def test_a_bad_threshold_exits_2_writing_nothing(tmp_path, capsys, value):
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, run_args(tmp_path / "run", "--metrics.slow_rank_threshold", value), capsys)
    assert_clean_failure(outcome, "metrics.slow_rank_threshold", before=before, root=tmp_path)
    assert "0 (off) or a ratio >= 1" in outcome.stderr
