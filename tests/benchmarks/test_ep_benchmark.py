"""benchmarks/ep.py counts what the step's all-to-alls move and finds the theory: the ranks
together move ranks · 4 · tokens · top_k · dim · 4 bytes per MoE layer, and the counts exchange
n_experts integers per layer on each rank."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.failure_checks import python_path


@pytest.mark.slow
def test_ep_benchmark_measures_the_theory_and_prints_the_ratio():
    out = subprocess.run([sys.executable, "benchmarks/ep.py", "--steps", "1", "--warmup", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", "PATH": ""})
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    # 2 MoE layers x 4 x (4 x 128 tokens x top 2) x dim 256 x 4 bytes, on each of 2 ranks
    assert "ep 2 over fsdp 2  ranks together: tokens 16,777,216 B, theory 16,777,216 B (equal)" in out.stdout
    assert float(re.search(r"step time ep 2 / fsdp 2: ([0-9.]+)", out.stdout).group(1)) > 0
