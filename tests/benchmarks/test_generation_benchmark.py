"""benchmarks/generation.py runs end to end on a small batch: weft's greedy tokens equal transformers'
generate on the same weights, and the ceiling it prints (the decode step's matrix products alone) is
above what either engine reaches."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from benchmarks import generation  # noqa: E402
from weft.models import flavors  # noqa: E402


def test_the_benchmark_compares_equal_tokens_and_prints_a_ceiling_above_both(capsys):
    opts = generation.parse_cli(["--prompts", "3", "--new-tokens", "6", "--repeats", "1", "--baseline-prompts", "1"])
    generation.run("debugmodel", replace(flavors()["debugmodel"], max_seq_len=256), opts)
    out = capsys.readouterr().out
    assert "same tokens as transformers: 3/3 prompts" in out, out
    rates = {name: float(rate) for name, rate in re.findall(r"(weft|transformers) generate +([\d.]+) tokens/s", out)}
    ceiling = float(re.search(r"allow ([\d.]+) tokens/s", out).group(1))
    assert ceiling > max(rates.values()) > 0, out
