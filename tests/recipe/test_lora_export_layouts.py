"""A LoRA run's end-of-run exports (recipe/export.py through components/hf/writer.py) under a
pipeline: the PEFT folder loads in PEFT onto the base exported as a plain Hugging Face folder with
the logits of the merged folder (transformers) and of weft's own LoRA forward, and both folders
equal, tensor for tensor, what `python -m weft.recipe.export` writes of the run's last checkpoint
in one process (the same weights, written from one process instead of two pipeline stages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weft import train
from weft.components.config import parse_args
from weft.components.hf import export_to_hf
from weft.recipe.export import main as export_main

from tests.support.dist_utils import run_distributed
from tests.support.hf_folders import assert_same_tensors

STEPS = 3


def lora_args(dump: Path, base: Path, *extra: str) -> list[str]:
    return ["--job.config_file", "debug_lora", "--job.dump_folder", str(dump),
            f"--checkpoint.initial_load_path={base}", "--training.steps", str(STEPS), "--training.seq_len", "32",
            "--training.local_batch_size", "4", "--no-validation.enable", "--no-metrics.enable_tensorboard",
            "--checkpoint.interval", "100", "--lora.rank", "4", "--optimizer.lr", "3e-3",
            "--export.peft_folder", "adapter", "--export.hf_folder", "merged", *extra]


def train_in(dump: str, base: str, *extra: str) -> None:
    train.train(parse_args(lora_args(Path(dump), Path(base), *extra)))


def layout_run(root: Path, seed: Path, name: str, world: int, *layout: str) -> Path:
    """The LoRA run from `seed` under `layout` on `world` ranks with its end-of-run exports in
    root/name, and its last checkpoint exported in one process in root/name/one."""
    run_distributed(train_in, world, str(root / name), str(seed), *layout, timeout=600)
    checkpoint = root / name / "checkpoint" / f"step-{STEPS}"
    assert export_main(["--checkpoint", str(checkpoint), "--peft-out", str(root / name / "one" / "adapter"),
                        "--merged-out", str(root / name / "one" / "merged")]) == 0
    return root / name


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """The seeded debug base as a DCP step-0 and, exported, as a plain HF folder."""
    root = tmp_path_factory.mktemp("lora_export")
    train.train(parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(root / "seed"),
                            "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                            "--training.seq_len", "32", "--training.local_batch_size", "4"]))
    seed = root / "seed" / "checkpoint" / "step-0"
    export_to_hf(seed, root / "base_hf", flavor="debugmodel")
    return seed, root / "base_hf"


@pytest.fixture(scope="module")
def pp2(base) -> Path:
    return layout_run(base[0].parents[2], base[0], "pp2", 2, "--parallelism.pp", "2", "--parallelism.dp_shard", "1")


def assert_exports_equal_one_process(run: Path) -> None:
    adapters = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert len(adapters) == 2 * 7 * 4  # A and B of 7 linears in each of the debug model's 4 blocks
    assert "base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight" in adapters
    for folder, file in (("adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        assert_same_tensors(run / "one" / folder / file, run / folder / file)
    assert (run / "one" / "adapter" / "adapter_config.json").read_text() == (run / "adapter" / "adapter_config.json").read_text()


def test_pp2_exports_equal_one_process_exports_of_its_checkpoint(pp2):
    assert_exports_equal_one_process(pp2)


@pytest.mark.slow
@pytest.mark.parametrize("name, world, layout", [
    ("pp2_fsdp2", 4, ["--parallelism.pp", "2", "--parallelism.dp_shard", "2"]),
    ("fsdp2", 2, ["--parallelism.dp_shard", "2"]),
    ("tp2", 2, ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"]),
])
def test_other_layouts_export_as_one_process(base, name, world, layout):
    assert_exports_equal_one_process(layout_run(base[0].parents[2], base[0], name, world, *layout))


def test_peft_on_the_base_equals_the_merged_folder_and_weft(base, pp2):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from weft.components.hf import load_hf_into_model
    from weft.components.hf.adapters import load_peft_adapter
    from weft.models.llama import LLAMA_FLAVORS, Transformer

    adapter, merged = pp2 / "adapter", pp2 / "merged"
    tokens = torch.randint(0, LLAMA_FLAVORS["debugmodel"].vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base[1]), adapter)(tokens).logits
        merged_logits = LlamaForCausalLM.from_pretrained(merged)(tokens).logits
        weft = Transformer(LLAMA_FLAVORS["debugmodel"])
        load_hf_into_model(weft, base[1])
        weft_logits = load_peft_adapter(weft, adapter)(tokens)
    base_logits = LlamaForCausalLM.from_pretrained(base[1])(tokens).logits.detach()
    assert (peft_logits - base_logits).abs().max() > 1e-3, "the adapters must have trained"
    torch.testing.assert_close(peft_logits, merged_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(weft_logits, peft_logits, rtol=0, atol=1e-5)
