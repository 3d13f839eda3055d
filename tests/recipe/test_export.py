"""recipe/export.py: a checkpoint exported after the fact (`weft export`, `python -m weft.recipe.export`).

The reference is the run's own end-of-run export ([export] peft_folder / hf_folder) of the same
adapters, itself checked against PEFT and transformers in tests/recipe/test_lora_recipe.py: the folders
written from the checkpoint alone must hold the same tensors, bit for bit, and the same files."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weft import train
from weft.cli import main as weft
from weft.components.config import parse_args
from weft.recipe.export import main as export_main

STEPS = 3


def lora_args(dump: Path, *extra: str) -> list[str]:
    return ["--job.config_file", "debug_lora", "--job.dump_folder", str(dump), "--checkpoint.initial_load_path", "",
            "--training.steps", str(STEPS), "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--checkpoint.enable", "--checkpoint.interval", str(STEPS), "--validation.enable", "false",
            "--no-metrics.enable_tensorboard", *extra]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("lora_run")
    train.train(parse_args(lora_args(dump, "--export.peft_folder", "adapter", "--export.hf_folder", "merged")))
    return dump


def same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_checkpoint_exports_what_the_run_exported_at_its_end(lora_run, tmp_path):
    checkpoint = lora_run / "checkpoint" / f"step-{STEPS}"
    assert export_main(["--checkpoint", str(checkpoint), "--peft-out", str(tmp_path / "adapter")]) == 0
    assert same_tensors(lora_run / "adapter" / "adapter_model.safetensors", tmp_path / "adapter" / "adapter_model.safetensors")
    assert filecmp.cmp(lora_run / "adapter" / "adapter_config.json", tmp_path / "adapter" / "adapter_config.json", shallow=False)
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "merged")]) == 0
    assert same_tensors(lora_run / "merged" / "model.safetensors", tmp_path / "merged" / "model.safetensors")
    assert export_main(["--checkpoint", str(checkpoint), "--merged-out", str(tmp_path / "again")]) == 0  # the old name
    assert same_tensors(tmp_path / "merged" / "model.safetensors", tmp_path / "again" / "model.safetensors")


def test_the_merged_folder_carries_the_runs_tokenizer_and_generation_config(lora_run):
    """Every file the run recorded for export but config.json (the base's tokenizer, generation
    config) is in the merged folder, and the tokenizer is made loadable by AutoTokenizer there."""
    merged, recorded = lora_run / "merged", lora_run / "hf_files"
    names = {p.name for p in recorded.iterdir()} - {"config.json"}
    assert {"tokenizer.model", "generation_config.json"} <= names
    for name in names:
        assert filecmp.cmp(recorded / name, merged / name, shallow=False), name
    assert (merged / "tokenizer.json").is_file()


def test_bad_exports_are_one_line_and_write_nothing(lora_run, tmp_path, capsys):
    plain = tmp_path / "plain"
    train.train(parse_args(lora_args(plain, "--no-lora.enable")))
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "mine.txt").write_text("mine")
    checkpoint = str(lora_run / "checkpoint" / f"step-{STEPS}")
    cases = [
        (["--checkpoint", str(plain / "checkpoint" / f"step-{STEPS}"), "--peft-out", str(tmp_path / "a")],
         "is not a LoRA run's checkpoint"),
        (["--checkpoint", str(tmp_path / "missing"), "--peft-out", str(tmp_path / "b")], "missing"),
        (["--checkpoint", checkpoint, "--peft-out", str(existing)], f"output folder {existing} exists"),
        (["--checkpoint", checkpoint], "give --out (alias --merged-out), --peft-out or both"),
        (["--checkpoint", checkpoint, "--out", str(tmp_path / "c"), "--base", str(plain)],
         "--base: the run of"),  # it trained on the seeded initialisation
    ]
    for argv, message in cases:
        assert export_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("weft: error: ") and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "plain"]
    assert [p.name for p in existing.iterdir()] == ["mine.txt"] and (existing / "mine.txt").read_text() == "mine"


def test_a_whole_models_checkpoint_exports_what_the_run_exported_at_its_end(lora_run, tmp_path):
    """`weft export` of a run without LoRA: the live model's end-of-run export, from the checkpoint."""
    plain = tmp_path / "plain"
    train.train(parse_args(lora_args(plain, "--no-lora.enable", "--export.hf_folder", "at_end")))
    checkpoint = str(plain / "checkpoint" / f"step-{STEPS}")
    assert weft(["export", "--checkpoint", checkpoint, "--out", str(tmp_path / "ours")]) == 0
    assert same_tensors(tmp_path / "ours" / "model.safetensors", plain / "at_end" / "model.safetensors")
    assert filecmp.cmp(tmp_path / "ours" / "config.json", plain / "at_end" / "config.json", shallow=False)
