"""components/model_state.full_tensors: whole tensors out of a sharded model, one at a time."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.dist_utils import run_distributed

GATHERS = 60  # rounds over the layers; gathering NF4 shards as NF4 corrupted the heap within a few


def _nf4_layers() -> nn.ModuleList:
    """Eight frozen NF4 linears, the same on every rank (seeded), as QLoRA's base holds them."""
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(256, 512, bias=False) for _ in range(8))
    for layer in layers:
        layer.weight = nn.Parameter(to_nf4(layer.weight.detach()), requires_grad=False)
    return layers


def _gathered_under_fsdp2_equal_one_process() -> dict[str, bool]:
    """On each rank: {name: the gathered weight equals one process's dequantization, bit for bit}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weft.components.checkpoint.state import full_tensors

    reference = [layer.weight.get_original_weight() for layer in _nf4_layers()]
    layers = _nf4_layers()
    mesh = init_device_mesh("cpu", (2,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    names = [f"{i}.weight" for i in range(len(layers))]
    for _ in range(GATHERS - 1):
        for _name, tensor in full_tensors(layers, names):
            tensor.sum()  # used, as the writer uses each
    return {name: torch.equal(tensor, reference[int(name.split(".")[0])]) for name, tensor in full_tensors(layers, names)}


def test_fsdp2_sharded_nf4_weights_gather_as_one_process_dequantizes_them():
    """Every rank gets each NF4 weight whole, dequantized bit for bit as one process does, gather
    after gather (a rank died of heap corruption mid-export in CI when the NF4 shards were gathered)."""
    for equal in run_distributed(_gathered_under_fsdp2_equal_one_process, 2):
        assert equal == {f"{i}.weight": True for i in range(8)}
