"""Checkpoints under pipeline parallelism: exact resume, and resume into layouts without a pipeline.

pp 2 × fsdp 2 trains 10 steps, saving after step 5 and 10. Resumed from its step-5 checkpoint,
the same layout repeats steps 6-10 bit for bit; fsdp 4 and one process continue them within 1e-5
(only the order of reductions differs). The other direction, from a one-process checkpoint into
pp 2 × fsdp 2, too. The pipeline run's Hugging Face export at its end holds the tensors that the
offline export of its last checkpoint writes. Runs train.py's `train`, on gloo.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from weft.components.config import parse_args

from tests.support.dist_utils import run_distributed

PP2_FSDP2 = ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--training.local_batch_size", "4",
             "--parallelism.pp_schedule", "Interleaved1F1B", "--parallelism.pp_microbatches", "2"]
FSDP4 = ["--parallelism.dp_shard", "4", "--training.local_batch_size", "2"]
STEPS, HALF = 10, 5  # a checkpoint after HALF and STEPS; the resumed runs repeat the steps after HALF


def args(dump: Path, extra: list[str]) -> list[str]:
    return ["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--training.steps", str(STEPS),
            "--training.seq_len", "32", "--training.local_batch_size", "8",
            "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
            "--checkpoint.enable", "--checkpoint.interval", str(HALF), *extra]


def resume_copy(source: Path, dump: Path, step: int) -> Path:
    """A fresh dump folder holding only `source`'s checkpoint of `step`."""
    target = dump / "checkpoint" / f"step-{step}"
    shutil.copytree(source / "checkpoint" / f"step-{step}", target)
    return dump


def four_ranks(root: str, single_dump: str) -> dict[str, list[float]]:
    import torch.distributed as dist

    from weft import train

    root_path, runs = Path(root), {}
    runs["straight"] = train.train(parse_args(args(root_path / "pp", PP2_FSDP2 + ["--export.hf_folder", "hf"])))
    dist.barrier()
    if dist.get_rank() == 0:
        resume_copy(root_path / "pp", root_path / "pp_resumed", HALF)
        resume_copy(root_path / "pp", root_path / "fsdp4", HALF)
        resume_copy(Path(single_dump), root_path / "from_single", HALF)
    dist.barrier()
    runs["resumed"] = train.train(parse_args(args(root_path / "pp_resumed", PP2_FSDP2)))
    dist.barrier()
    runs["fsdp4"] = train.train(parse_args(args(root_path / "fsdp4", FSDP4)))
    dist.barrier()
    runs["from_single"] = train.train(parse_args(args(root_path / "from_single", PP2_FSDP2)))
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[float]]:
    from weft import train

    root = tmp_path_factory.mktemp("pp_checkpoint")
    single = train.train(parse_args(args(root / "single", [])))
    runs = run_distributed(four_ranks, 4, str(root), str(root / "single"), timeout=1200)[0]
    runs["single"] = single
    resume_copy(root / "pp", root / "single_resumed", HALF)
    runs["single_resumed"] = train.train(parse_args(args(root / "single_resumed", [])))
    runs["root"] = root
    return runs


@pytest.mark.slow
def test_pp_fsdp_resumes_bit_for_bit(runs):
    assert len(runs["straight"]) == STEPS and runs["resumed"] == runs["straight"][HALF:]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp4", "single_resumed"])
def test_pp_checkpoint_resumes_in_another_layout(runs, layout):
    assert runs[layout] == pytest.approx(runs["straight"][HALF:], rel=1e-5)


@pytest.mark.slow
def test_pp_run_exports_what_its_checkpoint_holds(runs, tmp_path):
    from safetensors.torch import load_file

    from weft.components.hf import export_to_hf

    root = runs["root"]
    export_to_hf(root / "pp" / "checkpoint" / f"step-{STEPS}", tmp_path / "offline", flavor="debugmodel")
    live, offline = load_file(root / "pp" / "hf" / "model.safetensors"), load_file(tmp_path / "offline" / "model.safetensors")
    assert sorted(live) == sorted(offline) and len(live) == 2 + 9 * 4 + 1
    for name, tensor in offline.items():
        assert torch.equal(live[name], tensor), name


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_pp(runs):
    assert runs["straight"] == pytest.approx(runs["single"], rel=1e-5)  # the two layouts train alike
    assert runs["from_single"] == pytest.approx(runs["single"][HALF:], rel=1e-5)
