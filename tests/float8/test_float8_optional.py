"""torchao is needed by float8 runs only: without it (missing, or broken on import) everything
else imports and trains, and asking for float8 is a one-line error saying what to install.

Each test runs Python in a subprocess whose `import torchao` fails, in one of two ways:
missing (`sys.modules["torchao"] = None`, what Python does for a module it cannot find) or
broken (a `torchao` package earlier on the path whose import raises, as a wheel built for
another torch does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.failure_checks import python_path

BLOCK_TORCHAO = "import sys; sys.modules['torchao'] = None\n"


def run_python(code: str, tmp_path: Path, *, broken: bool = False) -> subprocess.CompletedProcess:
    """Run `code` with the repository on the path and torchao missing (or broken)."""
    path = [str(REPO)]
    if broken:
        package = tmp_path / "shadow" / "torchao"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("raise OSError('undefined symbol: _ZN3c1017RegisterOperatorsD1Ev')\n")
        path.insert(0, str(package.parent))
    else:
        code = BLOCK_TORCHAO + code
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(*path)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def train_code(dump: Path, *args: str) -> str:
    argv = ["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--training.seq_len", "64",
            "--training.steps", "2", "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", *args]
    return f"import sys\nfrom weft import train\nsys.exit(train.main({argv!r}))\n"


@pytest.mark.slow
def test_modules_import_without_torchao(tmp_path):
    code = ("import sys, weft.train, weft.float8, weft.parallelisms.tp, benchmarks.gpu_throughput\n"
            "assert not any(m.startswith('torchao') and sys.modules[m] for m in sys.modules)\n")
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


def test_float8_without_torchao_is_one_line_error(tmp_path):
    dump = tmp_path / "out"
    result = run_python(train_code(dump, "--float8.enable"), tmp_path, broken=True)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weft: error: float8.enable: torchao cannot be imported"), lines
    assert "OSError: undefined symbol" in lines[0] and "pip install torchao" in lines[0]
    assert not dump.exists()


@pytest.mark.slow
def test_bf16_training_runs_without_torchao(tmp_path):
    result = run_python(train_code(tmp_path / "out"), tmp_path, broken=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: 2 of 2 steps" in result.stdout + result.stderr
