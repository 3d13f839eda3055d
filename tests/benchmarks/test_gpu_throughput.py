"""benchmarks/gpu_throughput.py on CPU (--dry-run): every row kind runs end to end, each row is
written as it is measured, one failing row loses that row only, ratios stay within one run."""

from __future__ import annotations

import json
import math
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_candidate_variants_beside_their_baselines_with_losses_and_profiles(tmp_path, capsys, monkeypatch):
    """Issue 40's candidates as row variants in one run: each trains the same batches from the same
    weights as the row it changes (FSDP's reshard policy: the same losses exactly; the output
    projection in float8: within float8's distance), each profiled step is broken down by category,
    and a variant the backend cannot run is skipped with its reason."""
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    out, traces = tmp_path / "rows.jsonl", tmp_path / "traces"
    configs = ["bf16_eager", "bf16_eager+reshard_never", "float8_tensorwise_eager",
               "float8_tensorwise_eager+float8_output", "float8_rowwise_eager+auto_filter+reshard_never",
               "float8_tensorwise_eager+fsdp_float8"]
    bench.main(["--dry-run", "--in-process", "--configs", *configs, "--out", str(out), "--profile-dir", str(traces)])
    rows = {row["config"]: row for row in lines(out)[:-1]}
    assert [rows[c]["status"] for c in configs] == ["ok"] * 5 + ["skipped"]
    assert "gloo" in rows["float8_tensorwise_eager+fsdp_float8"]["reason"]  # float8 all-gather needs NCCL
    bf16, float8 = rows["bf16_eager"]["losses"], rows["float8_tensorwise_eager"]["losses"]
    assert len(bf16) == 3 and rows["bf16_eager+reshard_never"]["losses"] == bf16
    # debugmodel with --float8-min-dim 16: the output (256 -> 2048) is the one layer +float8_output adds
    for config in ("float8_tensorwise_eager", "float8_tensorwise_eager+float8_output"):
        assert rows[config]["losses"] == pytest.approx(bf16, rel=0.02) and rows[config]["losses"] != bf16
    assert rows["float8_tensorwise_eager+float8_output"]["losses"] != float8
    # torchao's auto filter keeps every linear of the debug model: rowwise + auto_filter trains as bf16
    assert rows["float8_rowwise_eager+auto_filter+reshard_never"]["losses"] == bf16
    for config in configs[:5]:
        ms = rows[config]["breakdown_ms"]
        assert ms["GEMM"] > 0 and sum(ms[c] for c in bench.CATEGORIES) == pytest.approx(ms["total"])
        assert (traces / f"{config}.json.gz").exists()
    printed = capsys.readouterr().out
    assert "time of one profiled step by category" in printed and "/without variant" in printed


def test_config_names_and_variants_are_checked_when_parsed():
    assert bench.parse_args(["--configs", "float8_rowwise_compile+auto_filter"]).configs == [
        "float8_rowwise_compile+auto_filter"]
    for bad in ("bf16_compile+float8_output", "hf_compile+reshard_never", "bf16_compile+nope", "bf17_compile"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--configs", bad])


def test_qwen3_rows_against_transformers_qwen3(tmp_path):
    """Issue 37's comparison: a Qwen3 flavor's weft rows and transformers' Qwen3ForCausalLM of the
    same shape (the parameter counts are checked when it is built), at the flavor's own depth."""
    out = tmp_path / "rows.jsonl"
    bench.main(["--dry-run", "--in-process", "--flavor", "debugmodel_qwen3", "--layers", "1",
                "--configs", "bf16_eager", "hf_eager", "--out", str(out)])
    rows = lines(out)[:-1]
    assert [(row["config"], row["status"]) for row in rows] == [("bf16_eager", "ok"), ("hf_eager", "ok")], rows
    assert all(len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"]) for row in rows)
