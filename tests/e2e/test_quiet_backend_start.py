"""A transformers-backend run's output carries none of torchao's start-up noise, as a QLoRA run's
does not (layers/torchao_import.py): transformers' quantizers import torchao with its modeling code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.failure_checks import python_path
from tests.support.hf_folders import tiny_qwen3_hf_folder
from tests.support.train_runs import run_args

NOISE = ("Failed to load", "register_constant")


def output_of(*args: str) -> str:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), "PATH": ""}
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_a_transformers_backend_run_is_quiet(tmp_path):
    pytest.importorskip("transformers")
    bare = output_of("-c", "import transformers.modeling_utils")
    if not any(noise in bare for noise in NOISE):
        pytest.skip("torchao loads quietly on this host: nothing to silence")
    tiny_qwen3_hf_folder(tmp_path / "hf")
    args = run_args(tmp_path / "out", "--model.flavor", "from_hf_config", "--model.backend", "transformers",
                    "--checkpoint.initial_load_path", str(tmp_path / "hf"), steps=1, seq_len=16, batch=1)
    output = output_of("train.py", *args)
    assert not [noise for noise in NOISE if noise in output], output
    assert "done: 1 of 1 steps" in output
