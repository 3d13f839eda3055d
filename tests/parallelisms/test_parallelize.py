"""What every transform shares: finding blocks, and refusing to run after FSDP/DDP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from weft.float8 import Float8Options, apply_float8
from weft.models.llama import LLAMA_FLAVORS, Transformer
from weft.parallelisms import FSDPOptions, TransformError, apply_cp, apply_ddp, apply_fsdp, apply_tp, transformer_blocks

from tests.support.own_models import NanoGPT, hf_llama


@contextlib.contextmanager
def one_rank_mesh() -> Iterator:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "build, container",
    [
        (lambda: Transformer(LLAMA_FLAVORS["debugmodel"]), lambda m: list(m.layers.values())),
        (hf_llama, lambda m: list(m.model.layers)),
        (NanoGPT, lambda m: list(m.transformer.h)),
    ],
)
def test_blocks_are_found_in_common_layouts(build, container):
    with torch.device("meta"):
        model = build()
    assert transformer_blocks(model, "apply_ac") == container(model)


def test_a_model_without_known_blocks_is_asked_for_them():
    with pytest.raises(TransformError, match=r"^apply_fsdp: found no transformer blocks in Sequential .*pass blocks="):
        transformer_blocks(nn.Sequential(nn.Linear(2, 2)), "apply_fsdp")


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
@pytest.mark.parametrize(
    "transform",
    [
        lambda model, mesh: apply_tp(model, mesh),
        lambda model, mesh: apply_cp(model, mesh),
        lambda model, mesh: apply_float8(model, Float8Options(min_dim=16)),
    ],
    ids=["apply_tp", "apply_cp", "apply_float8"],
)
def test_transforms_refuse_a_model_data_parallelism_already_wrapped(wrap, transform):
    model = Transformer(LLAMA_FLAVORS["debugmodel"])
    with one_rank_mesh() as mesh:
        apply_fsdp(model, mesh, FSDPOptions(param_dtype=torch.float32)) if wrap == "fsdp" else apply_ddp(model, mesh)
        with pytest.raises(TransformError, match="already wrapped by FSDP/DDP.*apply_fsdp / apply_ddp"):
            transform(model, mesh)


def _tp_compiled_losses() -> dict[bool, list[float]]:
    """Worker (tp 2): three AdamW steps of a 2-block debug model, eager and compiled by parallelize."""
    from dataclasses import replace

    from weft.parallelisms.compile import CompileOptions
    from weft.parallelisms.fsdp import FSDPOptions
    from weft.parallelisms.materialize import materialize
    from weft.parallelisms.parallel_dims import ParallelDims
    from weft.parallelisms.parallelize import ParallelizeOptions, parallelize

    losses = {}
    for compile in (False, True):
        meshes = ParallelDims.resolve(dp_replicate=1, dp_shard=1, cp=1, tp=2, world_size=2).build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(replace(LLAMA_FLAVORS["debugmodel"], n_layers=2))
        parallelize(model, meshes, ParallelizeOptions(compile=CompileOptions("aot_eager") if compile else None,
                                                      fsdp=FSDPOptions(param_dtype=torch.float32)))
        materialize(model, "cpu", seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator, losses[compile] = torch.Generator().manual_seed(0), []
        for _ in range(3):
            tokens = torch.randint(0, 2048, (2, 33), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[compile].append(loss.item())
        torch._dynamo.reset()
    return losses


@pytest.mark.slow
def test_tensor_parallel_blocks_compile_behind_an_input_copy():
    """torch 2.13 fails the backward of a compiled tensor-parallel block (tests/parallelisms/test_own_model.py);
    parallelize compiles each behind a copy of its input, and trains as the eager TP model does."""
    from tests.support.dist_utils import run_distributed

    for losses in run_distributed(_tp_compiled_losses, 2):
        assert losses[True] == pytest.approx(losses[False], rel=1e-6)
