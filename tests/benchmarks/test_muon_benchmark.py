"""benchmarks/muon.py times AdamW and Muon and trains both over its lr grids, here at its smallest."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.failure_checks import python_path


@pytest.mark.slow
def test_muon_benchmark_times_both_optimizers_and_reports_their_losses():
    out = subprocess.run([sys.executable, "benchmarks/muon.py", "--layouts", "one process", "--steps", "1",
                          "--warmup", "0", "--loss-steps", "2", "--lrs", "1", "--seq-len", "16"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", "PATH": ""})
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "one process" in out.stdout and "best AdamW: loss" in out.stdout and "best Muon: loss" in out.stdout
