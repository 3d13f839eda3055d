"""Adversarial checkpoints, and the commands that read them: resume, initial_load_path,
generate.py and `weft export`.

One short run (two checkpoints) and one exported Hugging Face folder are made once; every case
damages its own copy. The contract is tests/support/failure_checks.py's: exit 2, one `weft: error:` line
naming the folder or key, no traceback, under 60 s, every pre-existing file unchanged (a failed
export leaves no --out folder).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from weft import generate, train
from weft.components import hf
from weft.recipe import export as export_command

from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.train_runs import run_args

TOKENIZER = "assets/tokenizer/shakespeare.model"


saving_args = partial(run_args, steps=2, checkpoint_every=1)  # 2 steps, a checkpoint after each


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """run/ (checkpoints step-1 and step-2) and hf/ (step-2 exported)."""
    root = tmp_path_factory.mktemp("made")
    assert train.main(saving_args(root / "run")) == 0
    hf.export_to_hf(root / "run" / "checkpoint" / "step-2", root / "hf", flavor="debugmodel")
    return root


# -- damage ---------------------------------------------------------------------------------
# Copies share the made tensor files by hard link (fast), so damage replaces a file, never
# writes into it; small files are copied, so even a run that wrongly went on could not reach the
# shared originals through config.toml or metrics.jsonl.

def share_or_copy(source: str, target: str) -> None:
    if os.path.getsize(source) > 2**20:
        os.link(source, target)
    else:
        shutil.copy2(source, target)


def replace_file(path: Path, content: bytes) -> None:
    path.unlink()
    path.write_bytes(content)


def truncate(path: Path) -> None:
    """Keep the first tenth (a model-only read stops within the first third of a .distcp)."""
    with path.open("rb") as f:
        head = f.read(path.stat().st_size // 10)
    replace_file(path, head)


def garble(path: Path) -> None:
    replace_file(path, b"\x80\x04this is not what DCP wrote" * 3)


def empty(path: Path) -> None:
    replace_file(path, b"")


def remove(path: Path) -> None:
    path.unlink()


DISTCP, METADATA = "__0_0.distcp", ".metadata"


def damaged_run(tmp: Path, made: Path, damage: Callable[[Path], None] | None, name: str = DISTCP,
                step: int = 2) -> Path:
    """A copy of the made run with one file of step-`step` damaged; returns the run folder."""
    run = tmp / "run"
    shutil.copytree(made / "run", run, copy_function=share_or_copy)
    if damage is not None:
        damage(run / "checkpoint" / f"step-{step}" / name)
    return run


def damaged_hf(tmp: Path, made: Path, damage: Callable[[Path], None], name: str) -> Path:
    folder = tmp / "hf"
    shutil.copytree(made / "hf", folder, copy_function=share_or_copy)
    damage(folder / name)
    return folder


# -- resume (train.py) ----------------------------------------------------------------------

def resume(damage, name=DISTCP, *extra):
    def setup(tmp, made):
        run = damaged_run(tmp, made, damage, name)
        return saving_args(run, "--training.steps", "3", *extra)
    return setup


def state(change: Callable[[Path], None], *extra: str):
    """A run folder whose checkpoint state `change` alters (no file is damaged)."""
    def setup(tmp, made):
        run = damaged_run(tmp, made, None)
        change(run)
        return saving_args(run, *extra)
    return setup


def unmark_all(run: Path) -> None:
    for marker in (run / "checkpoint").glob("step-*/COMPLETE"):
        marker.unlink()


RESUME_CASES = [
    ("resume-truncated-distcp", resume(truncate), "step-2: cannot load it"),
    ("resume-garbled-distcp", resume(garble), "cannot load it"),
    ("resume-empty-distcp", resume(empty), "cannot load it"),
    ("resume-missing-distcp", resume(remove), "cannot load it"),
    ("resume-truncated-metadata", resume(truncate, METADATA), "cannot read its DCP metadata"),
    ("resume-garbled-metadata", resume(garble, METADATA), "cannot read its DCP metadata"),
    ("resume-missing-metadata", resume(remove, METADATA), "cannot read its DCP metadata"),
    ("resume-all-saves-unfinished", state(unmark_all, "--training.steps", "3"),
     "no complete checkpoint, only unfinished saves (step-1, step-2"),
    ("resume-finished-run-fewer-steps", state(lambda run: None, "--training.steps", "1"),
     "training.steps = 1: the checkpoint"),
    ("resume-load-step-before-later", state(lambda run: None, "--checkpoint.load_step", "1"),
     "checkpoint.load_step = 1: later checkpoints exist (2)"),
    ("resume-load-step-missing", state(lambda run: None, "--checkpoint.load_step", "7", "--training.steps", "9"),
     "checkpoint.load_step = 7: no complete checkpoint"),
    ("resume-other-seq-len", state(lambda run: None, "--training.seq_len", "64"), "training.seq_len = 32"),
    ("resume-other-flavor", state(lambda run: None, "--model.flavor", "llama3_8b"), "model.flavor"),
]


def initial(target: Callable[[Path, Path], Path]):
    """A fresh dump folder whose checkpoint.initial_load_path is target(tmp, made)."""
    def setup(tmp, made):
        return saving_args(tmp / "new", "--checkpoint.initial_load_path", str(target(tmp, made)))
    return setup


def step2(damage, name=DISTCP):
    return lambda tmp, made: damaged_run(tmp, made, damage, name) / "checkpoint" / "step-2"


INITIAL_CASES = [
    ("initial-truncated-distcp", initial(step2(truncate)), "checkpoint.initial_load_path: checkpoint"),
    ("initial-garbled-metadata", initial(step2(garble, METADATA)), "cannot read its DCP metadata"),
    ("initial-checkpoint-root", initial(lambda tmp, made: damaged_run(tmp, made, None) / "checkpoint"),
     "is a checkpoint root, not a step folder; name one of its step folders, e.g."),
    ("initial-missing", initial(lambda tmp, made: tmp / "nowhere"), "does not exist"),
    ("initial-dump-folder", initial(lambda tmp, made: damaged_run(tmp, made, None)),
     "is a dump folder, not a checkpoint step folder"),
    ("initial-unfinished", initial(step2(remove, "COMPLETE")), "has no COMPLETE file"),
    ("initial-a-file", initial(lambda tmp, made: damaged_run(tmp, made, None) / "config.toml"), "it is a file"),
    ("initial-hf-bad-config", initial(lambda tmp, made: damaged_hf(tmp, made, garble, "config.json")),
     "config.json is not valid JSON"),
    ("initial-hf-truncated-safetensors",
     initial(lambda tmp, made: damaged_hf(tmp, made, truncate, "model.safetensors")), "cannot read it as safetensors"),
]


@pytest.mark.parametrize("name, setup, expected", RESUME_CASES + INITIAL_CASES,
                         ids=[c[0] for c in RESUME_CASES + INITIAL_CASES])
def test_bad_checkpoint_for_train(tmp_path, capsys, made, name, setup, expected):
    argv = setup(tmp_path, made)
    before = snapshot(tmp_path)
    assert_clean_failure(run_in_process(train.main, argv, capsys), expected, before=before, root=tmp_path)


# -- generate.py ----------------------------------------------------------------------------

def gen(target: Callable[[Path, Path], Path], *extra: str, flag: str = "--checkpoint"):
    def setup(tmp, made):
        return [flag, str(target(tmp, made)), "--tokenizer", TOKENIZER, "--prompt", "ROMEO:", "--max-new-tokens", "2",
                *extra]
    return setup


def good_step(tmp, made):
    return damaged_run(tmp, made, None) / "checkpoint" / "step-2"


GENERATE_CASES = [
    ("generate-truncated-distcp", gen(step2(truncate)), "cannot load it"),
    ("generate-garbled-metadata", gen(step2(garble, METADATA)), "cannot read its DCP metadata"),
    ("generate-checkpoint-root", gen(lambda tmp, made: damaged_run(tmp, made, None) / "checkpoint"),
     "is a checkpoint root"),
    ("generate-unfinished", gen(step2(remove, "COMPLETE")), "has no COMPLETE file"),
    ("generate-flavor-mismatch", gen(good_step, "--flavor", "llama3_405b"), "--flavor llama3_405b expects"),
    ("generate-temperature-nan", gen(good_step, "--temperature", "nan"), "--temperature"),
    ("generate-temperature-inf", gen(good_step, "--temperature", "inf"), "--temperature"),
    ("generate-temperature-negative", gen(good_step, "--temperature", "-1"), "--temperature"),
    ("generate-seed-huge", gen(good_step, "--seed", str(2**64)), "--seed"),
    ("generate-top-k-negative", gen(good_step, "--top-k", "-1"), "--top-k"),
    ("generate-hf-truncated-safetensors",
     gen(lambda tmp, made: damaged_hf(tmp, made, truncate, "model.safetensors"), flag="--hf"),
     "cannot read it as safetensors"),
    ("generate-hf-missing-config", gen(lambda tmp, made: damaged_hf(tmp, made, remove, "config.json"), flag="--hf"),
     "has no config.json"),
    ("generate-bad-tokenizer", gen(good_step, "--tokenizer", "README.md"), "README.md"),
]


@pytest.mark.parametrize("name, setup, expected", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_bad_input_for_generate(tmp_path, capsys, made, name, setup, expected):
    argv = setup(tmp_path, made)
    before = snapshot(tmp_path)
    assert_clean_failure(run_in_process(generate.main, argv, capsys), expected, before=before, root=tmp_path)


# -- weft export ------------------------------------------------------------------------------------

def export(target: Callable[[Path, Path], Path], *extra: str, out: Callable[[Path], Path] = lambda t: t / "out",
           flavor: str = "debugmodel"):
    def setup(tmp, made):
        return ["--checkpoint", str(target(tmp, made)), "--flavor", flavor,
                "--out", str(out(tmp)), *extra]
    return setup


def file_at(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("a file")
    return path


EXPORT_CASES = [
    ("export-truncated-distcp", export(step2(truncate)), "cannot load it"),
    ("export-garbled-distcp", export(step2(garble)), "cannot load it"),
    ("export-garbled-metadata", export(step2(garble, METADATA)), "cannot read its DCP metadata"),
    ("export-checkpoint-root", export(lambda tmp, made: damaged_run(tmp, made, None) / "checkpoint"),
     "is a checkpoint root"),
    ("export-missing", export(lambda tmp, made: tmp / "nowhere"), "no checkpoint folder"),
    ("export-out-below-a-file", export(good_step, out=lambda t: file_at(t / "taken") / "out"), "is a file"),
    ("export-out-not-empty", export(good_step, out=lambda t: file_at(t / "full" / "x").parent), "not empty"),
    ("export-out-is-a-file", export(good_step, out=lambda t: file_at(t / "taken")), "not empty"),
    ("export-shard-nan", export(good_step, "--max-shard-gb", "nan"), "--max-shard-gb"),
    ("export-shard-inf", export(good_step, "--max-shard-gb", "inf"), "--max-shard-gb"),
    ("export-shard-zero", export(good_step, "--max-shard-gb", "0"), "--max-shard-gb"),
    ("export-flavor-mismatch", export(good_step, flavor="llama3_8b"), "flavor llama3_8b expects"),
    ("export-bad-dtype", export(good_step, "--dtype", "float8"), "--dtype"),
]


@pytest.mark.parametrize("name, setup, expected", EXPORT_CASES, ids=[c[0] for c in EXPORT_CASES])
def test_bad_input_for_export(tmp_path, capsys, made, name, setup, expected):
    argv = setup(tmp_path, made)
    before = snapshot(tmp_path)
    assert_clean_failure(run_in_process(export_command.main, argv, capsys), expected, before=before, root=tmp_path)
