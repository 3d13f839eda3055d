"""QLoRA from weft's own DCP checkpoints: a base trained with checkpoint.enable (in one process or under
fsdp 2) fine-tunes with an NF4 base, dense and MoE (the routed experts in NF4), with exactly the losses
of the same QLoRA run from that checkpoint's Hugging Face export (`weft export`), in one process and
under fsdp 2. A QLoRA run's output carries none of torchao's start-up noise."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from weft.layers.torchao_import import quiet_torchao_import
from weft.recipe.export import main as export_main

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run, run_args

ROOT = Path(__file__).resolve().parents[2]
# name -> (train_configs/ name, extra arguments): the debug MoE (Llama 4), Qwen3-MoE and the dense debug model
MODELS = {"debug_moe": ("debug_moe", ()), "qwen3_moe": ("debug_model", ("--model.flavor", "debugmodel_qwen3_moe")),
          "dense": ("debug_model", ())}
BASE_STEPS, QLORA_STEPS, GLOBAL_BATCH = 2, 3, 2


def base_args(dump: Path, model: str, ranks: int) -> list[str]:
    config, extra = MODELS[model]
    return run_args(dump, *extra, config=config, steps=BASE_STEPS, batch=GLOBAL_BATCH // ranks,
                    checkpoint_every=BASE_STEPS)


def qlora_args(dump: Path, model: str, base: Path, ranks: int, *more: str) -> list[str]:
    config, extra = MODELS[model]
    return run_args(dump, *extra, "--lora.enable", "--lora.quantize_base", "nf4", "--lora.rank", "4",
                    "--checkpoint.initial_load_path", str(base), "--no-validation.enable", "--no-checkpoint.enable",
                    *more, config=config, steps=QLORA_STEPS, batch=GLOBAL_BATCH // ranks)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """base(model, ranks) -> (its DCP step folder, its Hugging Face export), each trained once."""
    root, made = tmp_path_factory.mktemp("bases"), {}

    def base(model: str, ranks: int) -> tuple[Path, Path]:
        if (model, ranks) not in made:
            dump = root / f"{model}_{ranks}"
            args = base_args(dump, model, ranks)
            if ranks == 1:
                run(args)
            else:
                run_distributed(run, ranks, args)
            step = dump / "checkpoint" / f"step-{BASE_STEPS}"
            assert export_main(["--checkpoint", str(step), "--out", str(dump / "hf")]) == 0
            made[model, ranks] = step, dump / "hf"
        return made[model, ranks]

    return base


def qlora_losses(dump: Path, model: str, base: Path, ranks: int) -> list[float]:
    args = qlora_args(dump, model, base, ranks)
    losses = run(args) if ranks == 1 else run_distributed(run, ranks, args)[0]
    assert len(losses) == QLORA_STEPS
    return losses


@pytest.mark.slow
def test_qlora_from_a_dcp_checkpoint_in_a_fresh_process_is_quiet(bases, tmp_path):
    """The documented command, as a user runs it: no torchao noise, the Hugging Face path's losses."""
    step, hf = bases("debug_moe", 1)
    cmd = [sys.executable, "train.py", *qlora_args(tmp_path / "dcp", "debug_moe", step, 1)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Failed to load" not in output and "register_constant" not in output, output
    records = [json.loads(line) for line in (tmp_path / "dcp" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses == qlora_losses(tmp_path / "hf", "debug_moe", hf, 1)


@pytest.mark.parametrize("model", ["qwen3_moe", "dense"])
def test_qlora_from_a_one_process_checkpoint(bases, tmp_path, model):
    step, hf = bases(model, 1)
    assert qlora_losses(tmp_path / "dcp", model, step, 1) == qlora_losses(tmp_path / "hf", model, hf, 1)


def fsdp2_qlora(runs: list[tuple[Path, str, Path, tuple[str, ...]]]) -> list[list[float]]:
    """QLoRA runs (dump, model, base, more arguments) one after the other in one group of two ranks."""
    return [run(qlora_args(dump, model, base, 2, *more)) for dump, model, base, more in runs]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["debug_moe", "qwen3_moe"])
def test_qlora_from_a_checkpoint_under_fsdp(bases, tmp_path, model):
    """Checkpoints saved in one process and under fsdp 2, each fine-tuned in one process, under
    fsdp 2 and under ep 2 (each rank loading and quantizing its own experts). The dense model's
    QLoRA from a checkpoint is the one-process case above; its FSDP start is the MoE's without experts."""
    (one_step, one_hf), (fsdp_step, fsdp_hf) = bases(model, 1), bases(model, 2)
    assert qlora_losses(tmp_path / "dcp", model, fsdp_step, 1) == qlora_losses(tmp_path / "hf", model, fsdp_hf, 1)
    layouts = {"fsdp": (), "ep": ("--parallelism.ep", "2")}
    runs = [(tmp_path / f"{saved}_{layout}_{kind}", model, base, more)
            for layout, more in layouts.items()
            for saved, (step, hf) in (("one", (one_step, one_hf)), ("fsdp", (fsdp_step, fsdp_hf)))
            for kind, base in (("dcp", step), ("hf", hf))]
    losses = run_distributed(fsdp2_qlora, 2, runs)[0]
    for dcp, hf in zip(losses[::2], losses[1::2]):
        assert len(dcp) == QLORA_STEPS and dcp == hf


class Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_torchao_import_drops_only_the_start_up_noise():
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    kept = Kept()  # on the loggers themselves: torch's do not propagate to the root
    for log in (torchao, pytree):
        log.addHandler(kept)
    try:
        with quiet_torchao_import():
            torchao.warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
            pytree.warning("<enum 'X'> is an Enum subclass and is now natively supported by torch.compile ...")
            torchao.warning("a genuine torchao warning")
            pytree.warning("a genuine pytree warning")
        torchao.warning("Failed to load /x/_C_cutlass_90a.abi3.so")  # outside the import: shown as it is
    finally:
        for log in (torchao, pytree):
            log.removeHandler(kept)
    assert kept.messages == ["a genuine torchao warning", "a genuine pytree warning",
                             "Failed to load /x/_C_cutlass_90a.abi3.so"]
