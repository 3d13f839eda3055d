"""QLoRA on the debug MoE through train.py: the routed experts in NF4 (layers/nf4_experts.py), the
adapters learn, resume exactly, and fsdp 2 and ep 2 train as one process does.

Tolerance across layouts: every layout quantizes each expert alone from the same seeded weights
(the quantization depends on an expert's values only), so the NF4 base is bit for bit the same in
all three; what differs is only the order of fp32 reductions (FSDP's gradient reduce-scatter, EP's
token exchange and per-rank grouped multiplies), hence rel 1e-4 on the losses of 10 steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weft.components.checkpoint.checkpointer import complete_steps

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run, run_args

STEPS = 20
CROSS_LAYOUT_RTOL = 1e-4


def args(dump: Path | str, dp: int = 1, *extra: str) -> list[str]:
    """QLoRA (NF4 base and experts) on the seeded debug MoE, small and quick."""
    return run_args(dump, "--lora.enable", "--lora.quantize_base", "nf4", "--lora.rank", "4",
                    "--checkpoint.initial_load_path=", "--no-validation.enable",
                    "--optimizer.lr", "3e-3", "--training.max_norm", "0", *extra, config="debug_moe", steps=STEPS,
                    seq_len=64, batch=4 // dp, checkpoint_every=10)


EXPORTS = ("--export.hf_folder", "merged")


@pytest.fixture(scope="module")
def straight_dump(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("straight")


@pytest.fixture(scope="module")
def straight(straight_dump) -> list[float]:
    return run(args(straight_dump, 1, *EXPORTS))


def merged_experts(dump: Path) -> dict[str, torch.Tensor]:
    """The routed experts of a run's end-of-run merged folder (frozen: the same in every run)."""
    tensors = load_file(dump / "merged" / "model.safetensors")
    return {k: t for k, t in tensors.items() if ".experts." in k}


@pytest.mark.slow
def test_qlora_moe_learns_and_resumes_exactly(tmp_path, straight):
    assert straight[-1] < straight[0] - 0.2, "the adapters must learn over an NF4 base"
    first = run(args(tmp_path / "resumed"), stop_after=10)
    assert complete_steps(tmp_path / "resumed" / "checkpoint") == [10]
    second = run(args(tmp_path / "resumed"))
    assert first + second == straight  # bit for bit: the NF4 base is quantized the same at every start


# 10 of the 20 steps: the same learning rates as the first 10 of 20 (debug_moe warms up for 10 steps).
def first_half(dump: str, *layout: str) -> list[float]:
    return run([*args(Path(dump), 2, "--parallelism.dp_shard", "2", *layout, *EXPORTS), "--training.steps", "10"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), ("--parallelism.ep", "2")], ids=["fsdp2", "ep2"])
def test_fsdp2_and_ep2_train_as_one_process(tmp_path, straight, straight_dump, layout):
    losses = run_distributed(first_half, 2, str(tmp_path / "run"), *layout)[0]
    assert losses == pytest.approx(straight[:10], rel=CROSS_LAYOUT_RTOL)
    # the merged export gathers and dequantizes the spread NF4 experts: those of one process, bit for bit
    ours, one_process = merged_experts(tmp_path / "run"), merged_experts(straight_dump)
    assert ours.keys() == one_process.keys() and len(ours) == 4
    assert all(torch.equal(ours[k], one_process[k]) for k in ours)


@pytest.mark.slow
def test_full_activation_checkpointing_recomputes_the_nf4_experts_to_the_same_losses(tmp_path, straight):
    """Under full AC the block's forward, its dequantizations included, runs again in backward."""
    losses = run([*args(tmp_path / "ac"), "--activation_checkpoint.mode", "full", "--training.steps", "10"])
    assert losses == pytest.approx(straight[:10], rel=1e-6)


@pytest.mark.slow
def test_compiled_blocks_train_the_nf4_experts_as_eager(tmp_path, straight):
    """compile.enable (fullgraph blocks): the NF4 multiply and its dequantization traced, the
    experts as the masked multiply where the grouped one does not apply (fp32 under compile)."""
    losses = run([*args(tmp_path / "compiled"), "--compile.enable", "--training.steps", "4"])
    assert losses == pytest.approx(straight[:4], rel=1e-4)
