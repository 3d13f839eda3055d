"""benchmarks/profiling.py's kernel_breakdown: a real CPU profile of the debug model's training step
adds up as torch.profiler's own per-op self times do, and a GPU trace's kernels are categorised by
their names and by what launched them."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from benchmarks.profiling import (
    CATEGORIES,
    LOSS,
    PhaseRegions,
    build_setup,
    category,
    format_breakdown,
    kernel_breakdown,
)
from weft.components.data import Batch
from weft.recipe.step import train_step

VOCAB = 2048  # debugmodel's (the Shakespeare tokenizer's); no other dimension of it is 2048


@pytest.fixture(scope="module")
def profiled_step():
    """One debug-model train_step under torch.profiler (CPU), its phases marked as train.py marks them."""
    setup, plan = build_setup("debugmodel", 32, 2, torch.device("cpu"))
    tokens = torch.randint(0, plan.model_args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    train_step(setup, [batch])  # optimizer state exists before the profiled step
    regions = PhaseRegions()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        train_step(setup, [batch], on_phase=regions)
        regions.close()
    return prof


def test_cpu_profile_adds_up_as_the_profilers_self_times(profiled_step):
    got = kernel_breakdown(profiled_step)
    assert got["source"] == "cpu ops" and list(got["ms"]) == list(CATEGORIES)
    assert sum(got["ms"].values()) == pytest.approx(got["total_ms"])
    # The profiler's own self time per op (key_averages), summed over ops: the same total.
    self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in profiled_step.key_averages()}
    regions = {"forward", "backward", "optimizer"} | {k for k in self_ms if k.startswith(("Optimizer.", "ProfilerStep"))}
    assert got["total_ms"] == pytest.approx(sum(v for k, v in self_ms.items() if k not in regions), rel=1e-6)
    gemm = sum(self_ms.get(op, 0.0) for op in ("aten::mm", "aten::addmm", "aten::bmm"))
    assert gemm > 0 and got["ms"]["GEMM"] == pytest.approx(gemm, rel=1e-6)
    # Given the vocabulary, the output projection's GEMMs (forward, both gradients) move to the loss.
    by_shape = profiled_step.key_averages(group_by_input_shape=True)
    output_gemms = sum(e.self_cpu_time_total / 1e3 for e in by_shape if e.key == "aten::mm"
                       and any(VOCAB in dims for dims in e.input_shapes if isinstance(dims, list)))
    with_vocab = kernel_breakdown(profiled_step, vocab_size=VOCAB)
    assert output_gemms > 0 and with_vocab["ms"]["GEMM"] == pytest.approx(gemm - output_gemms, rel=1e-6)
    assert with_vocab["ms"][LOSS] == pytest.approx(got["ms"][LOSS] + output_gemms, rel=1e-6)
    assert got["ms"]["optimizer"] >= self_ms["aten::_fused_adamw_"] > 0  # the fused AdamW of the optimizer phase
    assert got["ms"]["attention"] > 0 and got["ms"][LOSS] > 0
    assert got["ms"]["float8 amax/scale/cast"] == 0  # no float8 here (the logsumexp's amax is the loss's)
    assert got["span_ms"] >= got["total_ms"] * 0.5 and "GEMM" in format_breakdown(got)


def test_gpu_trace_kernels_by_name_and_launch(tmp_path):
    """A hand-written trace of the shape torch.profiler writes on CUDA: kernels linked to their
    launches by correlation id, launches nested in ops and phase regions on the host thread."""
    host, kernels = [], []

    def launch(ts, name, kernel, us, *outer):
        corr = len(kernels) + 1
        for i, (op, cat, *shapes) in enumerate(outer):  # enclosing, outermost first, each 1 us inside the last
            host.append({"ph": "X", "cat": cat, "name": op, "ts": ts + i, "dur": 10 - 2 * i, "pid": 1, "tid": 1,
                         "args": {"Input Dims": shapes[0]} if shapes else {}})
        host.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts + len(outer), "dur": 1,
                     "pid": 1, "tid": 1, "args": {"correlation": corr}})
        kernels.append({"ph": "X", "cat": "kernel", "name": kernel, "ts": 1000 + ts, "dur": us, "pid": 0, "tid": 7,
                        "args": {"correlation": corr}})

    launch(0, "gemm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 100, ("aten::mm", "cpu_op"))
    launch(20, "fp8 gemm", "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n", 50, ("aten::_scaled_mm", "cpu_op"))
    launch(40, "amax", "triton_red_fused_abs_max_0", 7, ("CompiledFunction", "cpu_op"))
    launch(60, "cast", "triton_poi_fused__to_copy_clamp_mul_1", 5, ("CompiledFunction", "cpu_op"))
    launch(80, "sdpa", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 30,
           ("aten::_scaled_dot_product_cudnn_attention", "cpu_op"))
    launch(100, "loss", "triton_red_fused__log_softmax_nll_loss_forward_2", 9, ("CompiledFunction", "cpu_op"))
    launch(120, "max in the loss", "reduce_kernel<MaxOps>", 2, ("aten::logsumexp", "cpu_op"), ("aten::amax", "cpu_op"))
    launch(140, "adam", "multi_tensor_apply_kernel<FusedAdamMathFunctor>", 20, ("optimizer", "user_annotation"),
           ("aten::_fused_adamw_", "cpu_op"))
    launch(160, "norm", "multi_tensor_apply_kernel<NormFunctor>", 3, ("optimizer", "user_annotation"))
    launch(180, "silu", "triton_poi_fused_mul_silu_3", 11, ("CompiledFunction", "cpu_op"))
    launch(200, "output projection", "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", 40,
           ("aten::linear", "cpu_op"), ("aten::mm", "cpu_op", [[8192, 4096], [4096, 128256]]))
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": host + kernels}, f)
    got = kernel_breakdown(path)
    assert got["source"] == "kernels"
    assert got["ms"] == pytest.approx({"GEMM": 0.190, "float8 amax/scale/cast": 0.012, "attention": 0.030,
                                       LOSS: 0.011, "optimizer": 0.023, "elementwise/other": 0.011})
    assert got["total_ms"] == pytest.approx(0.277) and got["span_ms"] == pytest.approx((200 + 40) / 1e3)
    by_vocab = kernel_breakdown(path, vocab_size=128256)["ms"]  # the 4096 -> 128,256 GEMM is the output's
    assert by_vocab["GEMM"] == pytest.approx(0.150) and by_vocab[LOSS] == pytest.approx(0.051)


def test_category_rules():
    assert category("aten::mm", []) == "GEMM" and category("aten::_grouped_mm", []) == "GEMM"
    assert category("aten::mul", ["aten::linear"]) == "elementwise/other"  # autocast's cast in a linear
    assert category("aten::mm", ["optimizer"]) == "optimizer"
    assert category("aten::summary", []) == "elementwise/other"
