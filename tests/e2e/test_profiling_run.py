"""[profiling] in a real run: two gloo ranks train the debug model (FSDP over both) 6 steps with
a window of 1 warm-up and 1 recorded step every 3 steps. Each rank writes one gzipped Chrome
trace per window at the documented path, holding the step's forward, backward and optimizer
regions and FSDP's collectives; the log names each window and its folder; the losses equal those
of the same run without the profiler, bit for bit."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
from pathlib import Path

import pytest

from weft.components.config import parse_args

from tests.support.train_runs import run_args

PROFILE = ["--profiling.enable", "--profiling.freq", "3", "--profiling.warmup", "1", "--profiling.active", "1"]


def plain_and_profiled(root: Path) -> dict[str, object]:
    """Rank worker: the run without, then with the profiler; the losses of each and the profiled run's log."""
    import torch.distributed as dist

    from weft import train

    plain = train.train(parse_args(run_args(root / "plain", steps=6, seq_len=64)))
    dist.barrier()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # train.py's logger writes to the stdout it finds at start
        profiled = train.train(parse_args(run_args(root / "profiled", steps=6, seq_len=64) + PROFILE))
    dist.barrier()
    return {"plain": plain, "profiled": profiled, "log": log.getvalue()}


def trace_names(path: Path) -> set[str]:
    return {event.get("name", "") for event in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}


@pytest.mark.slow
def test_two_ranks_write_one_trace_per_window_and_train_the_same(tmp_path):
    from tests.support.dist_utils import run_distributed

    results = run_distributed(plain_and_profiled, 2, tmp_path)
    dump = tmp_path / "profiled"
    written = sorted(str(p.relative_to(dump)) for p in (dump / "profile_traces").rglob("*") if p.is_file())
    assert written == [f"profile_traces/step-{step}/rank-{rank}.json.gz" for step in (3, 6) for rank in (0, 1)]
    for step in (3, 6):
        for rank in (0, 1):
            names = trace_names(dump / f"profile_traces/step-{step}/rank-{rank}.json.gz")
            assert {"forward", "backward", "optimizer", f"ProfilerStep#{step}"} <= names, (step, rank)
            assert f"ProfilerStep#{step - 1}" not in names  # the warm-up step is not recorded
            # FSDP all-gathers parameters and reduce-scatters gradients; the gradient norm is all-reduced
            assert {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_"} <= names

    for rank_results in results:
        assert rank_results["profiled"] == rank_results["plain"] and len(rank_results["plain"]) == 6
    log = results[0]["log"]
    for first, last in ((2, 3), (5, 6)):
        folder = dump / f"profile_traces/step-{last}"
        assert f"profiler: profiling steps {first}-{last} (1 warm-up, 1 recorded), traces to {folder}" in log
        assert f"profiler: traces of steps {last}-{last} written to {folder}" in log

    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    untimed = [r["step"] for r in records if math.isnan(r["train/tokens_per_second"])]
    assert untimed == [2, 3, 5, 6]  # each logged alone: the profiled steps have no throughput of their own
