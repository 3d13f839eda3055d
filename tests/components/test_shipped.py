"""components/config/shipped.py: a shipped config's `assets/...` paths mean the current folder's where it
has them (a checkout, a project with its own assets/) and weft's own copy elsewhere; and
pyproject.toml's package data holds every file a shipped config names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from weft.components.config import parse_args
from weft.components.config.shipped import shipped_path

from tests.support import ASSETS, REPO

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def test_an_assets_path_missing_here_is_the_checkouts_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Path(shipped_path("assets/data/shakespeare")) == ASSETS / "data" / "shakespeare"
    assert Path(shipped_path("./assets/tokenizer/shakespeare.model")) == ASSETS / "tokenizer" / "shakespeare.model"


@pytest.mark.parametrize("path", ["assets/data/shakespeare", "assets/data/not-shipped", "data/shakespeare", "", None])
def test_other_paths_are_kept(tmp_path, monkeypatch, path):
    """The project's own assets/ wins; an asset weft does not ship, a path outside assets/ and an
    absolute path are left for the loaders to refuse or read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets" / "data" / "shakespeare").mkdir(parents=True)
    path = str(ASSETS / "data" / "shakespeare") if path is None else path
    assert shipped_path(path) == path


def test_a_shipped_config_reads_the_same_files_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    here = parse_args(["--job.config_file", "debug_model"])
    assert (here.model.tokenizer_path, here.data.dataset_path) == ("assets/tokenizer/shakespeare.model",
                                                                   "assets/data/shakespeare")  # as the TOML says
    monkeypatch.chdir(tmp_path)
    elsewhere = parse_args(["--job.config_file", "debug_model", "--validation.enable",
                            "--validation.dataset_path", "assets/data/shakespeare/hamlet.txt"])
    assert Path(elsewhere.model.tokenizer_path) == REPO / here.model.tokenizer_path
    assert Path(elsewhere.data.dataset_path) == REPO / here.data.dataset_path
    assert Path(elsewhere.validation.dataset_path) == ASSETS / "data" / "shakespeare" / "hamlet.txt"


def test_package_data_holds_every_shipped_config_and_the_tracked_assets_they_name():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["weft"]
    packaged = {path for pattern in globs for path in REPO.glob(pattern) if path.is_file()}
    tracked = {REPO / name for name in subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                                                      check=True).stdout.split()}
    configs = sorted((REPO / "train_configs").glob("*.toml"))
    assert configs and set(configs) <= packaged
    named = {config.get(section, {}).get(key, "") for config in map(lambda p: tomllib.loads(p.read_text()), configs)
             for section, key in (("model", "tokenizer_path"), ("data", "dataset_path"), ("validation", "dataset_path"))}
    files = {f for name in named if name.startswith("assets/") for f in tracked if f.is_relative_to(REPO / name)}
    assert {"hamlet.txt", "shakespeare.model"} <= {f.name for f in files}  # what debug_model and debug_lora read
    assert files <= packaged, sorted(str(f.relative_to(REPO)) for f in files - packaged)


def test_pyproject_lists_every_package_of_the_checkout():
    """setuptools installs only the packages pyproject.toml names (the repository root is the package
    weft, so none are found by themselves): a package folder missing there would be missing from
    every wheel, which only the slow install test would otherwise see."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    skipped = {"tests", "benchmarks", "assets"}
    found = {".".join(("weft", *init.parent.relative_to(REPO).parts)) for init in REPO.rglob("__init__.py")
             if not (set(init.relative_to(REPO).parts) & skipped) and not any(
                 part.startswith(".") for part in init.relative_to(REPO).parts)}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
