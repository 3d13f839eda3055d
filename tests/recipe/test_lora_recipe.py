"""LoRA through train.py (recipe/plan.py, recipe/build.py, components/checkpoint/checkpointer.py): adapter-only
checkpoints, exact resume (also from fsdp 2 x tp 2 into one process), the base recorded and
checked, and every bad [lora] input refused in one line before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from weft import train
from weft.components.checkpoint.checkpointer import complete_steps
from weft.components.config import ConfigError, parse_args
from weft.models.llama import LLAMA_FLAVORS
from weft.recipe.plan import RunPlan

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run, run_args

STEPS = 20


def args(dump: Path, dp: int = 1, *extra: str) -> list[str]:
    """debug_lora on the seeded base (no initial_load_path), small and quick."""
    return run_args(dump, "--checkpoint.initial_load_path=", "--no-validation.enable", "--checkpoint.interval", "10",
                    "--lora.rank", "4", "--optimizer.lr", "3e-3", *extra, config="debug_lora", steps=STEPS,
                    batch=4 // dp)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    """20 steps in one process without a stop: the reference of both resume tests."""
    return run(args(tmp_path_factory.mktemp("straight")))


@pytest.mark.slow
def test_exact_resume_and_a_small_checkpoint(tmp_path, straight):
    first = run(args(tmp_path / "resumed"), stop_after=10)
    second = run(args(tmp_path / "resumed"))
    assert first + second == straight  # bit for bit
    assert straight[-1] < straight[0] - 0.2, "the adapters must learn"
    base_bytes = 4 * 4_299_008 - 4 * 150_000  # the debug model's fp32 weights, far more than the adapters'
    assert folder_bytes(tmp_path / "resumed" / "checkpoint" / "step-10") < 0.2 * base_bytes


def fsdp2_tp2_first_half(dump: str) -> list[float]:
    return run(args(Path(dump), 2, "--parallelism.dp_shard", "2", "--parallelism.tp", "2"), stop_after=10)


@pytest.mark.slow
def test_resume_fsdp2_tp2_adapters_in_one_process(tmp_path, straight):
    first = run_distributed(fsdp2_tp2_first_half, 4, str(tmp_path / "moved"))[0]
    assert complete_steps(tmp_path / "moved" / "checkpoint") == [10]
    second = run(args(tmp_path / "moved"))
    assert first + second == pytest.approx(straight, rel=1e-5)


def test_adapters_resumed_onto_another_base_are_refused(tmp_path, capsys):
    run(args(tmp_path / "base", 1, "--checkpoint.create_seed_checkpoint", "--no-lora.enable"))
    run(args(tmp_path / "lora", 1, "--training.steps", "2", "--checkpoint.interval", "1"))
    before = sorted(p.name for p in (tmp_path / "lora" / "checkpoint").iterdir())
    other_base = args(tmp_path / "lora", 1, "--training.steps", "4",
                      f"--checkpoint.initial_load_path={tmp_path / 'base' / 'checkpoint' / 'step-0'}")
    assert train.main(other_base) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("weft: error: checkpoint ") and "holds adapters trained on base [" in line
    assert "seeded init, training.seed=0" in line and "step-0" in line
    assert sorted(p.name for p in (tmp_path / "lora" / "checkpoint").iterdir()) == before


@pytest.mark.parametrize("extra, world, message", [
    (["--lora.target_modules", "q_proj"], 1, "lora.target_modules = ['q_proj']: apply_lora: target_modules "
     "['q_proj'] matches no nn.Linear of Transformer; its linears are named output, w1, w2, w3, wk, wo, wq, wv"),
    (["--lora.rank", "0"], 1, "--lora.rank: must be >= 1, got 0"),
    (["--lora.alpha", "0"], 1, "--lora.alpha: must be > 0, got 0.0"),
    (["--lora.dropout", "1.0"], 1, "--lora.dropout: must be < 1, got 1.0"),
    (["--lora.quantize_base", "nf4", "--parallelism.dp_shard", "16"], 16,
     "lora.quantize_base = nf4: apply_lora: cannot shard NF4 layers.0.attention.wq (256, 256) over 16 FSDP ranks"),
    (["--lora.quantize_base", "nf4", "--parallelism.dp_shard", "1", "--parallelism.tp", "2"], 2,
     "parallelism.tp = 2: QLoRA (lora.quantize_base = nf4) does not support tensor parallelism"),
    (["--lora.quantize_base", "nf4", "--parallelism.dp_shard", "1", "--parallelism.pp", "2"], 2,
     "parallelism.pp = 2: QLoRA (lora.quantize_base = nf4) does not support pipeline parallelism"),
    (["--float8.enable"], 1, "float8.enable: LoRA (lora.enable) and float8 together are not supported"),
    (["--checkpoint.create_seed_checkpoint"], 1, "checkpoint.create_seed_checkpoint: a LoRA run's adapters start "
     "from PEFT's initialisation"),
])
def test_bad_lora_input_is_one_line_before_anything_exists(tmp_path, extra, world, message):
    with pytest.raises(ConfigError) as error:
        RunPlan.from_config(parse_args(args(tmp_path / "run", 1, *extra)), world, check_environment=False)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()
    assert LLAMA_FLAVORS["debugmodel"].dim == 256  # the shapes the messages name


def test_export_at_the_end_writes_peft_and_merged_folders(tmp_path):
    """export.peft_folder and export.hf_folder after a LoRA run: PEFT's own reader takes the
    adapter folder, and transformers loads the merged one."""
    from peft import LoraConfig
    from transformers import LlamaForCausalLM

    run(args(tmp_path / "run", 1, "--training.steps", "2", "--no-checkpoint.enable",
             "--export.peft_folder", "adapter", "--export.hf_folder", "merged"))
    config = LoraConfig.from_pretrained(tmp_path / "run" / "adapter")
    assert (config.r, config.lora_alpha, config.task_type) == (4, 32.0, "CAUSAL_LM")
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "run" / "merged")
    assert merged.config.hidden_size == LLAMA_FLAVORS["debugmodel"].dim
