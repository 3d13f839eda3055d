"""weft installed as a user installs it (`pip install <checkout>`, not editable) into a fresh venv
serves a project that has its own `models/` and `components/` packages: `weft.parallelisms.apply_tp`
and `weft.models.llama` import from the install, the project's own packages from the project, and
the README's "own model" example trains there under torchrun."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.readme import readme_example

REPO = Path(__file__).resolve().parents[2]

PRELUDE = '''\
import os
import components, models  # the project's own packages, next to this script
import weft
import weft.models.llama
from weft.parallelisms import apply_tp

here, venv = os.path.dirname(os.path.abspath(__file__)), os.environ["VENV"]
assert models.__file__.startswith(here) and components.__file__.startswith(here), (models, components)
assert weft.__file__.startswith(venv) and weft.models.llama.__file__.startswith(venv), weft.__file__
assert callable(apply_tp) and hasattr(weft.models.llama, "Transformer")
'''


def install_copy(tmp_path: Path) -> Path:
    """A venv (seeing the system's torch, transformers, setuptools) with a plain install of the
    checkout's tracked files; returns its python."""
    source = tmp_path / "weft-src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():  # a file deleted in the work tree but not yet in git's index is skipped
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    # --without-pip: the venv's pip and setuptools are the system's (a venv's own bundled setuptools
    # may be too old to build a wheel without the `wheel` package, which needs the network).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "venv")],
                   check=True)
    python = tmp_path / "venv" / "bin" / "python"
    run = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          str(source)], capture_output=True, text=True, env=clean_env(tmp_path))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return python


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No PYTHONPATH: weft must come from the venv, not from a checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1", "VENV": str(tmp_path / "venv")}


@pytest.mark.slow
def test_installed_weft_serves_a_project_with_its_own_models_and_components(tmp_path):
    python = install_copy(tmp_path)
    project = tmp_path / "project"
    for package in ("models", "components"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f'"""The project\'s own {package}."""\n')
    (project / "own_model.py").write_text(PRELUDE + readme_example())
    run = subprocess.run([str(python), "-m", "torch.distributed.run", "--nproc_per_node", "4", "own_model.py"],
                         cwd=project, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", run.stdout, flags=re.M)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses
