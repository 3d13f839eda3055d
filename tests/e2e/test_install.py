"""weft installed as a user installs it (a wheel of the checkout, not editable) into a fresh venv:
the `weft` command trains a shipped config from any folder exactly as the checkout's train.py does
and samples from its checkpoint; and the install serves a project that has its own `models/` and
`components/` packages: `weft.parallelisms.apply_tp` and `weft.models.llama` import from the
install, the project's own packages from the project, and the README's "own model" example trains
there under torchrun.

The wheel is built and installed by the interpreter running the tests (the system's, or a user's
fresh venv), and the venv sees that interpreter's packages (torch, ...), not its base
interpreter's: a venv made from a venv would otherwise see the base's site-packages alone."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from weft.components.config.parser import read_toml

from tests.support.dist_utils import free_port
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


@dataclass(frozen=True)
class Install:
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def weft(self) -> Path:
        return self.venv / "bin" / "weft"

    def env(self) -> dict[str, str]:
        """No PYTHONPATH: weft must come from the venv, not from a checkout."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return {**env, "OMP_NUM_THREADS": "1", "VENV": str(self.venv)}


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> Install:
    """A venv holding a wheel of the checkout, installed without its dependencies (this
    interpreter's torch, transformers, ... serve it)."""
    root = tmp_path_factory.mktemp("install")
    wheel = build_wheel(copy_checkout(root / "weft-src"), root / "dist")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True,
                             check=True).stdout.strip()
    # This interpreter's site folders, after the venv's own (which holds weft), their .pth files read.
    outer = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    (Path(purelib) / "outer_site.pth").write_text("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in outer))
    installed = Install(venv)
    run = subprocess.run([str(installed.python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, env=installed.env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return installed


def copy_checkout(source: Path) -> Path:
    """The checkout's files that git tracks or would track (untracked, not ignored), copied to `source`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (REPO / name).is_file():  # a file deleted in the work tree but not yet in git's index is skipped
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    return source


def builds_wheels_offline() -> bool:
    """Whether this interpreter's setuptools builds weft's wheel as it is: pyproject.toml asks for
    >= 64, and before 70.1 bdist_wheel came from the separate `wheel` package (a fresh venv's
    bundled setuptools 65.5 has neither)."""
    try:
        release = tuple(int(part) for part in re.findall(r"\d+", version("setuptools"))[:2])
    except PackageNotFoundError:
        return False
    return release >= (70, 1) or (release >= (64, 0) and importlib.util.find_spec("wheel") is not None)


def build_wheel(source: Path, dist: Path) -> Path:
    """The wheel of `source`, built by this interpreter's pip: with its own setuptools where they
    can, else in an isolated build environment from the configured index."""
    local = ["--no-build-isolation", "--no-index"] if builds_wheels_offline() else []
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *local, "-w", str(dist), str(source)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (wheel,) = dist.glob("weft-*.whl")
    return wheel


def together(*commands: tuple[list[str], dict]) -> list[subprocess.CompletedProcess]:
    """Each (argv, Popen keywords) started at once, then all waited for (600 s): an install's command
    and the checkout's reference are independent processes, so their start-ups overlap."""
    started = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
               for argv, kw in commands]
    try:
        outputs = [p.communicate(timeout=600) for p in started]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(started, outputs)]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.communicate()


def files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def run_losses(dump: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_weft_trains_samples_and_exports_from_any_folder_as_the_checkout_does(install, tmp_path):
    elsewhere = tmp_path / "elsewhere"  # no assets/, no train_configs/: only the install has them
    elsewhere.mkdir()
    steps = ["--training.steps", "3", "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "3"]
    # The reference, run beside it: the checkout's train.py (the fork path), run from the checkout.
    checkout = tmp_path / "checkout-run"
    run, reference = together(
        ([str(install.weft), "train", "--job.config_file", "debug_model", *steps], dict(cwd=elsewhere, env=install.env())),
        ([sys.executable, "train.py", "--job.config_file", "debug_model", *steps, "--job.dump_folder", str(checkout)],
         dict(cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})))
    assert run.returncode == 0, run.stderr[-3000:]
    dump = elsewhere / "outputs" / "debug_model"  # the config's dump_folder, relative to where it ran
    recorded = read_toml(dump / "config.toml")
    for used, shipped in ((recorded["model"]["tokenizer_path"], "assets/tokenizer/shakespeare.model"),
                          (recorded["data"]["dataset_path"], "assets/data/shakespeare")):
        assert Path(used).is_relative_to(install.venv.resolve()) and used.endswith(f"/weft/{shipped}"), used
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert len(run_losses(dump)) == 3 and run_losses(dump) == run_losses(checkout)

    prompt = ["--checkpoint", str(dump / "checkpoint" / "step-3"), "--flavor", "debugmodel", "--prompt", "ROMEO:",
              "--max-new-tokens", "12"]
    step = ["--checkpoint", str(dump / "checkpoint" / "step-3")]
    # Sampling and export read the same finished checkpoint: all four commands at once.
    sampled, expected, exported, reference = together(
        ([str(install.weft), "generate", *prompt], dict(cwd=elsewhere, env=install.env())),
        ([sys.executable, "generate.py", *prompt], dict(cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})),
        ([str(install.weft), "export", *step, "--out", "hf"], dict(cwd=elsewhere, env=install.env())),
        ([sys.executable, "-m", "weft.recipe.export", *step, "--out", str(tmp_path / "hf")],
         dict(cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})))
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert expected.returncode == 0, expected.stderr[-3000:]
    assert sampled.stdout == expected.stdout and sampled.stdout.startswith("ROMEO:") and len(sampled.stdout) > 8

    assert exported.returncode == 0, exported.stderr[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert files(elsewhere / "hf") == files(tmp_path / "hf") and "model.safetensors" in files(tmp_path / "hf")


@pytest.mark.slow
def test_weft_prepare_tokenizes_shipped_assets_from_any_folder_as_the_checkout_does(install, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = ["--source", "assets/data/shakespeare/hamlet.txt", "--tokenizer", "assets/tokenizer/shakespeare.model"]
    run, reference = together(
        ([str(install.weft), "prepare", *argv, "--out", "shards"], dict(cwd=elsewhere, env=install.env())),
        ([sys.executable, "-m", "weft.components.data.prepare", *argv, "--out", str(tmp_path / "shards")],
         dict(cwd=REPO)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert files(elsewhere / "shards") == files(tmp_path / "shards") and len(files(tmp_path / "shards")) == 3


@pytest.mark.slow
def test_installed_weft_serves_a_project_with_its_own_models_and_components(install, tmp_path):
    project = tmp_path / "project"
    for package in ("models", "components"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f'"""The project\'s own {package}."""\n')
    (project / "own_model.py").write_text(PRELUDE + readme_example())
    run = subprocess.run([str(install.python), "-m", "torch.distributed.run", "--nproc_per_node", "4",
                          "--master_port", str(free_port()), "own_model.py"],
                         cwd=project, env=install.env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", run.stdout, flags=re.M)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses
