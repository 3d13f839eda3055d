"""recipe/summary.py: the global-batch line a run and its dry run print, against the arithmetic
of the batch (local batch x accumulation x data-parallel ranks)."""

from __future__ import annotations

from weft import train
from weft.components.config import parse_args
from weft.recipe.plan import RunPlan
from weft.recipe.summary import global_batch_line

ARGV = ["--job.config_file", "debug_model", "--job.dump_folder", "/nonexistent/weft-summary", "--parallelism.tp", "2",
        "--training.local_batch_size", "3", "--training.seq_len", "64", "--training.gradient_accumulation_steps", "2"]


def test_the_line_counts_samples_pairs_and_tokens_and_the_dry_run_prints_it(capsys):
    plan = RunPlan.from_config(parse_args(ARGV), 8, device_type="cpu", check_environment=False)
    rows = 3 * 2 * 4  # dp = 8 ranks / tp 2
    assert global_batch_line(plan) == (f"global batch 3 x 2 accumulation x 4 dp = {rows} samples = "
                                       f"{rows * 64:,} tokens per step (seq_len 64)")
    pairs = RunPlan.from_config(parse_args([*ARGV, "--data.format", "preference"]), 8, device_type="cpu",
                                check_environment=False)  # a pair is two rows of the batch
    assert f"= {rows} pairs ({2 * rows} rows) = {2 * rows * 64:,} tokens per step" in global_batch_line(pairs)
    assert train.main([*ARGV, "--job.dry_run", "--job.dry_run_world_size", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.endswith(f"] {global_batch_line(plan)}") for line in out) == 1, out
