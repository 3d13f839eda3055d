"""Ranks sharing a GPU (parallelism.share_gpus) talk through gloo: the plan refuses TP, CP and PP
there (gloo crashed under each on an H100), and lets FSDP, DDP and every CPU layout through."""

import pytest
import torch

from weft import train
from weft.components.config import ConfigError, parse_args
from weft.recipe.plan import RunPlan


def plan(world_size: int, *options: str, device_type: str | None = None) -> RunPlan:
    cfg = parse_args(["--job.config_file", "debug_model", "--parallelism.share_gpus", *options])
    return RunPlan.from_config(cfg, world_size, device_type=device_type, check_environment=False)


@pytest.mark.parametrize("key", ["tp", "cp", "pp"])
def test_shared_gpu_refuses_tp_cp_pp(key):
    options = ["--parallelism.dp_shard", "1", f"--parallelism.{key}", "2"]
    with pytest.raises(ConfigError, match=rf"^parallelism.share_gpus: ranks sharing a GPU use gloo, .* "
                                          rf"FSDP or DDP only, not parallelism.{key} = 2$"):
        plan(2, *options, device_type="cuda")
    assert plan(2, *options, device_type="cpu").dims.world_size == 2  # gloo on CPU tensors is fine


def test_shared_gpu_allows_fsdp_and_ddp():
    assert plan(2, device_type="cuda").dims.fsdp_enabled
    assert plan(2, "--parallelism.dp_shard", "1", "--parallelism.dp_replicate", "2", device_type="cuda").dims.dp == 2


def test_train_py_exits_2_on_a_machine_with_cuda(monkeypatch, tmp_path, capsys):
    """The device the plan assumes by default is CUDA where torch sees it: faked here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--job.config_file", "debug_model", "--parallelism.share_gpus", "--parallelism.tp", "2",
            "--job.simulate_world_size", "4", "--no-checkpoint.enable", "--job.dump_folder", str(tmp_path / "run")]
    assert train.main(argv) == 2
    assert "parallelism.share_gpus: ranks sharing a GPU use gloo" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
