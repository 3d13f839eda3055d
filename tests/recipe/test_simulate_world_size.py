"""job.simulate_world_size: rank 0 of a bigger layout, trained in this one process with a fake
process group. What is checked: the run completes, and the rank holds exactly its share of the
parameters (what decides its memory), computed here from the model's shapes alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import weft.recipe.build as build_module
from weft import train
from weft.components.config import ConfigError, parse_args
from weft.components.distributed.processes import init_fake_distributed, is_fake_distributed
from weft.models.llama import LLAMA_FLAVORS, Transformer
from weft.parallelisms.fsdp import apply_fsdp
from weft.parallelisms.parallel_dims import ParallelDims
from weft.recipe.checks.launch import check_launch


def expected_local_numel(world_size: int, tp: int) -> dict[str, int]:
    """Parameters one rank holds: FSDP shards every parameter over world / tp ranks; TP splits
    every matrix over tp ranks but keeps the RMSNorm weights whole (sequence parallel)."""
    with torch.device("meta"):
        model = Transformer(LLAMA_FLAVORS["debugmodel"])
    return {name: p.numel() // (world_size // tp if name.endswith("norm.weight") else world_size)
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("world_size, tp", [(8, 1), (4, 2)], ids=["fsdp8", "fsdp2_tp2"])
def test_rank0_of_a_layout_runs_and_holds_its_share(tmp_path, monkeypatch, world_size, tp):
    built = {}
    build_optimizer = build_module.build_optimizer

    def spy(model, cfg):  # the model train.py built, after every transform and materialisation
        built["model"], built["fake"] = model, is_fake_distributed()
        return build_optimizer(model, cfg)

    monkeypatch.setattr(build_module, "build_optimizer", spy)
    argv = ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path), "--training.seq_len", "64",
            "--training.steps", "2", "--no-metrics.enable_tensorboard",
            "--job.simulate_world_size", str(world_size), "--parallelism.tp", str(tp)]
    assert train.main(argv) == 0
    assert built["fake"] and not dist.is_initialized()

    local = {name: (p.to_local() if isinstance(p, DTensor) else p).numel()
             for name, p in built["model"].named_parameters()}
    assert local == expected_local_numel(world_size, tp)
    total = sum(p.numel() for p in Transformer(LLAMA_FLAVORS["debugmodel"]).parameters())
    assert sum(local.values()) == pytest.approx(total / world_size, rel=1e-3)


def test_fake_group_with_meta_model_sizes_a_big_layout_without_memory():
    """The reusable part (a dry run builds on it): llama3_8b as rank 0 of FSDP 8 on the meta device."""
    init_fake_distributed(8)
    try:
        dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, cp=1, tp=1, world_size=8)
        with torch.device("meta"):
            model = Transformer(LLAMA_FLAVORS["llama3_8b"])
        apply_fsdp(model, dims.build_mesh("cpu").fsdp)
        local = sum(p.to_local().numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert local * 8 == 8_030_261_248  # the published parameter count, an eighth on each rank


def test_fake_group_is_rank0_of_n_and_collectives_do_nothing():
    init_fake_distributed(8)
    try:
        assert (dist.get_rank(), dist.get_world_size(), is_fake_distributed()) == (0, 8, True)
        x = torch.ones(3)
        dist.all_reduce(x)
        assert x.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert not is_fake_distributed()


@pytest.mark.parametrize("extra, message", [
    (["--checkpoint.enable"], "job.simulate_world_size: checkpoints need real ranks"),
    (["--checkpoint.initial_load_path", "somewhere"], "job.simulate_world_size: checkpoints need real ranks"),
])
def test_simulation_refuses_checkpoints(extra, message):
    cfg = parse_args(["--job.config_file", "debug_model", "--job.simulate_world_size", "8", *extra])
    with pytest.raises(ConfigError, match=message):
        check_launch(cfg)


def test_simulation_refuses_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse_args(["--job.config_file", "debug_model", "--job.simulate_world_size", "8"])
    with pytest.raises(ConfigError, match="run it as python train.py, not 2 processes"):
        check_launch(cfg)


def test_a_nan_neither_stops_nor_skips_a_simulated_step(tmp_path, monkeypatch):
    """Fake collectives leave garbage where a real rank has data (on an H100, TP's made step 1's
    loss NaN): a simulated run measures memory and time, so it trains on instead of stopping."""
    import json

    real_build_step = build_module.build_step

    def build_step(*args, **kwargs):  # every loss NaN, as garbage from a fake all-gather would make it
        setup = real_build_step(*args, **kwargs)
        real_loss = setup.loss_fn
        setup.loss_fn = lambda *a, **k: real_loss(*a, **k) * float("nan")
        return setup

    monkeypatch.setattr(build_module, "build_step", build_step)
    argv = ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path), "--training.seq_len", "64",
            "--training.steps", "2", "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
            "--job.simulate_world_size", "2"]
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["train/skipped_steps"] == 0 for r in records)
    assert all(r["train/loss"] != r["train/loss"] for r in records)  # NaN, logged as it was
