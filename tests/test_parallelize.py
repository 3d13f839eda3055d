"""What every transform shares: finding blocks, and refusing to run after FSDP/DDP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from float8 import apply_float8
from models.llama import LLAMA_FLAVORS, Transformer
from parallelisms import TransformError, apply_cp, apply_ddp, apply_fsdp, apply_tp, transformer_blocks
from tests.test_own_model import NanoGPT, hf_llama


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
        lambda model, mesh: apply_float8(model, min_dim=16),
    ],
    ids=["apply_tp", "apply_cp", "apply_float8"],
)
def test_transforms_refuse_a_model_data_parallelism_already_wrapped(wrap, transform):
    model = Transformer(LLAMA_FLAVORS["debugmodel"])
    with one_rank_mesh() as mesh:
        apply_fsdp(model, mesh, param_dtype=torch.float32) if wrap == "fsdp" else apply_ddp(model, mesh)
        with pytest.raises(TransformError, match="already wrapped by FSDP/DDP.*apply_fsdp / apply_ddp"):
            transform(model, mesh)
