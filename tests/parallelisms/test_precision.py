"""One mixed-precision policy for every layout (parallelisms/precision.py): with
mixed_precision_param = bfloat16 the matmuls run in bf16 and the rotary embedding in fp32,
whether the run is on one device, DDP, TP or FSDP. bf16 runs on CPU, so this is checked here by
recording, during one real training step, the dtype each Linear produces and the dtype of the
rotary tables (cos/sin, or complex rotations) the rotary embedding receives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from weft import train
from weft.components.config import parse_args
from weft.models.common import gqa as llama_model  # where the attention calls the rotary

from tests.support.dist_utils import run_distributed

# The rotary tables are real fp32 cos/sin or complex64 rotations, depending on the model version.
FULL_PRECISION = {torch.float32: "full precision", torch.complex64: "full precision"}

LAYOUTS = {
    "single": [],
    "ddp": ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"],
    "tp": ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"],
    "fsdp": ["--parallelism.dp_shard", "2"],
}


def dtypes_in_one_step(dump: str, layout: str) -> dict[str, set[str]]:
    """Train one bf16 step in `layout`; the dtypes seen by the matmuls and by the rotary."""
    seen: dict[str, set[str]] = {"matmul": set(), "rotary_tables": set()}

    def on_forward(module, inputs, output):
        if isinstance(module, nn.Linear):
            seen["matmul"].add(str(output.dtype))

    real_rotary = llama_model.apply_rotary_emb

    def recording_rotary(x, *tables):
        seen["rotary_tables"].update(FULL_PRECISION.get(t.dtype, str(t.dtype)) for t in tables)
        return real_rotary(x, *tables)

    hook = nn.modules.module.register_module_forward_hook(on_forward)
    llama_model.apply_rotary_emb = recording_rotary
    try:
        train.train(parse_args([
            "--job.config_file", "debug_model", "--job.dump_folder", str(Path(dump) / layout),
            "--training.steps", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--no-metrics.enable_tensorboard", "--training.mixed_precision_param", "bfloat16",
            *LAYOUTS[layout]]))
    finally:
        hook.remove()
        llama_model.apply_rotary_emb = real_rotary
    return seen


def distributed_layouts(dump: str) -> dict[str, dict[str, set[str]]]:
    return {layout: dtypes_in_one_step(dump, layout) for layout in ("ddp", "tp", "fsdp")}


EXPECTED = {"matmul": {"torch.bfloat16"}, "rotary_tables": {"full precision"}}


def test_single_device_computes_in_bf16_with_fp32_rotary(tmp_path):
    assert dtypes_in_one_step(str(tmp_path), "single") == EXPECTED


@pytest.mark.slow
def test_every_layout_computes_in_bf16_with_fp32_rotary(tmp_path):
    """DDP and TP computed in fp32 (no policy reached them); FSDP cast the rotary tables to bf16."""
    results = run_distributed(distributed_layouts, 2, str(tmp_path))
    for rank_result in results:
        assert rank_result == {layout: EXPECTED for layout in ("ddp", "tp", "fsdp")}


def test_policy_is_stated_at_startup(tmp_path, capsys):
    train.main(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path), "--training.steps", "1",
                "--training.seq_len", "32", "--training.local_batch_size", "2", "--no-metrics.enable_tensorboard",
                "--training.mixed_precision_param", "bfloat16"])
    out = capsys.readouterr().out
    assert "precision: matmuls in bfloat16 (autocast); rotary, norms and loss in float32" in out


def test_float32_with_grouped_query_attention_on_a_gpu_is_announced():
    """SDPA's fused kernels take grouped-query heads in 16-bit only: fp32 on a GPU means the math kernel."""
    from weft.parallelisms.precision import attention_kernel_warning

    line = attention_kernel_warning("cuda", torch.float32, n_heads=8, n_kv_heads=4)
    assert line.startswith("training.mixed_precision_param = float32 with grouped-query attention")
    assert attention_kernel_warning("cuda", torch.bfloat16, n_heads=8, n_kv_heads=4) is None
    assert attention_kernel_warning("cuda", torch.float32, n_heads=8, n_kv_heads=8) is None
    assert attention_kernel_warning("cpu", torch.float32, n_heads=8, n_kv_heads=4) is None
