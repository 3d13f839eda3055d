"""benchmarks/moe.py compares what it says it compares (the grouped multiply and the loop on the
same routed tokens agree; both blocks see the same tokens) and prints its ratios."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import REPO
from tests.support.failure_checks import python_path


def test_moe_benchmark_prints_agreeing_paths_and_ratios():
    out = subprocess.run([sys.executable, "benchmarks/moe.py", "--tokens", "512", "--warmup", "0", "--repeats", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert "output max relative difference 0.00e+00, weight gradients 0.00e+00" in out.stdout
    ratios = re.findall(r"time (?:grouped/loop|MoE/dense) ([0-9.]+)", out.stdout)
    assert len(ratios) == 2 and all(float(r) > 0 for r in ratios), out.stdout
    # 8 experts of hidden 512 + a shared expert of 512, against one dense SwiGLU of hidden 1 × 512 + 512
    assert "parameters: MoE 3,540,992, dense 786,432" in out.stdout
