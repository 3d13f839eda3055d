"""components/observe/metrics.py: FLOPs per token, each GPU's peak, and what the throughput and memory figures count."""

import pytest
import torch

from weft.components.observe import metrics as metrics_module
from weft.components.observe.metrics import (
    PEAK_BF16_FLOPS,
    MetricsLogger,
    StepStats,
    count_parameters,
    device_peak_flops,
    flops_per_token,
    peak_flops_for,
)
from weft.models.llama import LLAMA_FLAVORS, Transformer


def test_flops_per_token_llama3_8b_by_hand():
    args = LLAMA_FLAVORS["llama3_8b"]
    n = 8_030_261_248
    # 6 x (parameters minus the 128256 x 4096 embedding) + 12 x 32 layers x 32 heads x 128 x 8192
    want = 6 * (n - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, n, 8192) == want
    assert want == 57_914_449_920  # about 58 GFLOPs per token


def test_tied_embedding_counts_as_a_matmul():
    args = LLAMA_FLAVORS["llama3_1b"]
    with torch.device("meta"):
        n = count_parameters(Transformer(args))
    assert flops_per_token(args, n, 1) == 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim


def test_cpu_has_no_peak_flops():
    assert device_peak_flops(torch.device("cpu")) is None


# Names as torch.cuda.get_device_name() reports them, and the table entry each must select.
@pytest.mark.parametrize("name, entry", [
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H20", "H20"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"),  # not B200
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L40", "L40"),  # not L4
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10G", "A10G"),
])
def test_peak_flops_entry_by_device_name(name, entry):
    assert peak_flops_for(name) == dict(PEAK_BF16_FLOPS)[entry]


def test_unknown_gpu_has_no_peak():
    assert peak_flops_for("NVIDIA GeForce RTX 4090") is None
    assert peak_flops_for("NVIDIA L20") is None  # not L4 nor L40


def test_peak_memory_is_reset_after_start_up(monkeypatch):
    """The logger is made after start-up: the CUDA peak restarts there, so it measures training."""
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    logger = MetricsLogger(device=gpu, flops_per_token=1.0, tokens_per_step=1, world_size=1, tb_folder=None,
                           jsonl_path=None)
    assert resets == [gpu] and logger.peak_flops == 989e12


def test_throughput_window_leaves_out_validation_and_checkpoints(monkeypatch):
    # loop start (time left's), window start, untimed 10..40, log at 50 (throughput's, time left's), next window
    clock = iter([0.0, 0.0, 10.0, 40.0, 50.0, 50.0, 60.0]).__next__
    monkeypatch.setattr(metrics_module.time, "perf_counter", clock)
    logger = MetricsLogger(device=torch.device("cpu"), flops_per_token=1.0, tokens_per_step=400, world_size=2,
                           tb_folder=None, jsonl_path=None, last_step=4)
    logger.step_done()
    with logger.untimed():
        pass
    logger.step_done()
    values = logger.log(StepStats(2, 1.0, 1.0, 1e-3))
    # 2 steps x 400 tokens over 50 s, of which 30 s untimed: 800 / 20 s / 2 devices
    assert values["train/tokens_per_second"] == pytest.approx(20.0)
    # the time left counts validation and checkpoints: 50 s for 2 steps, 2 steps to go
    assert values["time/elapsed_seconds"] == 50.0 and values["time/remaining_seconds"] == 50.0
