"""benchmarks/gpu_throughput.py on CPU (--dry-run): every row kind runs end to end, each row is
written as it is measured, one failing row loses that row only, ratios stay within one run."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks import gpu_throughput as bench
from weft.models.llama import LLAMA_FLAVORS, Transformer
from tests.support.slow_scaled_mm import emulated_scaled_mm


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dry_run_measures_every_eager_kind(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)  # the row's plumbing, not the kernel
    out = tmp_path / "rows.jsonl"
    configs = ["bf16_eager", "float8_tensorwise_eager", "autocast_eager", "hf_eager"]
    bench.main(["--dry-run", "--in-process", "--configs", *configs, "--out", str(out)])
    assert not dist.is_initialized()
    *rows, summary = lines(out)
    assert [row["config"] for row in rows] == configs
    assert len({row["run_id"] for row in rows + [summary]}) == 1
    for row in rows:
        assert row["status"] == "ok", row["reason"]
        assert row["tokens_per_s"] > 0 and len(row["step_s"]) == 2 and len(row["warmup_step_s"]) == 1
        assert row["sdpa_backends"] == ["flash (cpu)"]  # the backend that ran, read from the profiler
        assert row["settings"]["layers"] == 1 and row["mfu_percent"] is None  # no known peak on CPU
    printed = capsys.readouterr().out
    assert "MFU = tokens/s x (6 N + 12 L H Q T)" in printed and "hf_eager" in printed


def test_a_failing_row_loses_that_row_only(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("transformers changed its API\nsecond line")

    monkeypatch.setattr(bench, "build_hf_model", broken)
    out = tmp_path / "rows.jsonl"
    bench.main(["--dry-run", "--in-process", "--configs", "autocast_eager", "hf_eager", "autocast_eager",
                "--out", str(out)])
    *rows, summary = lines(out)
    assert [(row["config"], row["status"]) for row in rows] == [
        ("autocast_eager", "ok"), ("hf_eager", "error"), ("autocast_eager", "ok")]
    assert rows[1]["reason"] == "RuntimeError: transformers changed its API"
    assert summary["ratios"] == {}  # neither baseline was measured


def test_ratios_use_this_runs_rows_only(tmp_path):
    def row(run_id, config, tokens_per_s, status="ok"):
        return {"run_id": run_id, "config": config, "status": status, "tokens_per_s": tokens_per_s}

    out = tmp_path / "rows.jsonl"
    old = [row("old", "bf16_compile", 50.0), row("old", "hf_compile", 10.0)]
    new = [row("new", "bf16_compile", 200.0), row("new", "hf_compile", 100.0), row("new", "bf16_compile", 180.0),
           row("new", "autocast_compile", None, status="error")]
    out.write_text("".join(json.dumps(r) + "\n" for r in old + new))
    rows = bench.read_rows(out, "new")
    assert rows == new
    got = bench.ratios(rows)
    # A repeated row counts by its first measurement; failed rows are left out.
    assert got == {"bf16_compile": {"bf16_compile": 1.0, "hf_compile": 0.5},
                   "hf_compile": {"bf16_compile": 2.0, "hf_compile": 1.0}}


def test_default_layers_is_the_most_that_fits():
    args = LLAMA_FLAVORS["llama3_8b"]
    seq, gib = 8192, 2**30
    # Independent count: parameters per block from two model sizes.
    with torch.device("meta"):
        one, two = (sum(p.numel() for p in Transformer(replace(args, n_layers=n)).parameters())
                    for n in (1, 2))
    block, other = two - one, 2 * one - two
    kv = args.kv_heads * args.head_dim

    def need(layers: int) -> float:
        per_block = 18 * block + seq * (32 * args.dim + 4 * kv + 8 * args.ffn_hidden_dim)
        return (18 * other + 10 * seq * args.vocab_size + layers * per_block) / 0.85

    for free in (78 * gib, 139 * gib):
        layers = bench.default_layers(args, seq, 1, free)
        assert need(layers) <= free < need(layers + 1)
    assert bench.default_layers(args, seq, 1, 78 * gib) == 6  # an H100 80 GB
    assert bench.default_layers(args, seq, 1, 139 * gib) == 16  # an H200 141 GB
    assert bench.default_layers(args, seq, 1, 10 * gib) == 1  # never fewer than one


@pytest.mark.slow
def test_dry_run_compiled_rows_each_in_its_own_process(tmp_path):
    out = tmp_path / "rows.jsonl"
    bench.main(["--dry-run", "--configs", "bf16_compile", "hf_compile", "--out", str(out)])
    *rows, summary = lines(out)
    assert [(row["config"], row["status"]) for row in rows] == [("bf16_compile", "ok"), ("hf_compile", "ok")]
    assert all(row["sdpa_backends"] == ["flash (cpu)"] for row in rows)
    assert set(summary["ratios"]) == {"bf16_compile", "hf_compile"}


def test_a_row_whose_process_dies_gets_an_error_line(tmp_path, monkeypatch):
    """The parent writes the line a killed row's process could not (no real process is started)."""
    out = tmp_path / "rows.jsonl"
    commands = []

    def killed(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, -9, stdout="", stderr="loading\nKilled")

    monkeypatch.setattr(bench.subprocess, "run", killed)
    opts = bench.parse_args(["--dry-run", "--configs", "bf16_eager", "hf_eager", "--out", str(out)])
    bench.run_rows_isolated(["--dry-run"], opts, "r1", layers=1)
    rows = bench.read_rows(out, "r1")
    assert [(r["config"], r["status"], r["reason"]) for r in rows] == [
        ("bf16_eager", "error", "exit code -9: Killed"), ("hf_eager", "error", "exit code -9: Killed")]
    assert all(c[c.index("--configs") + 1] in ("bf16_eager", "hf_eager") and "--child" in c for c in commands)
