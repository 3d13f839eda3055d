"""The README's "Use weft's transforms on your own model" example, run as written under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from tests.support.failure_checks import python_path

from tests.support.readme import readme_example


@pytest.mark.slow
def test_readme_example_trains_hf_llama_under_fsdp_and_tp(tmp_path):
    script = tmp_path / "own_model.py"
    script.write_text(readme_example())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", run.stdout, flags=re.M)]
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 1.0, losses
