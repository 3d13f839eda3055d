"""apply_fsdp / apply_ddp used on their own, outside train.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from weft.models.llama import LLAMA_FLAVORS, Transformer
from weft.parallelisms.fsdp import FSDPOptions, apply_ddp, apply_fsdp
from weft.parallelisms.materialize import materialize

from tests.support.dist_utils import run_distributed


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def sharded_training_state_bytes() -> tuple[int, int]:
    """Worker: one AdamW step of the FSDP debug model; (bytes held on this rank, full bytes)."""
    world = dist.get_world_size()
    with torch.device("meta"):
        model = Transformer(LLAMA_FLAVORS["debugmodel"])
    apply_fsdp(model, init_device_mesh("cpu", (world,)), FSDPOptions(param_dtype=torch.float32))
    materialize(model, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 2048, (2, 16))).float().mean().backward()
    optimizer.step()
    held = sum(local_bytes(p) + local_bytes(p.grad) for p in model.parameters())
    held += sum(local_bytes(v) for state in optimizer.state.values() for v in state.values() if v.dim() > 0)
    full = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # param, grad, exp_avg, exp_avg_sq
    return held, full


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_rank_holds_one_nth_of_training_state(world_size):
    for held, full in run_distributed(sharded_training_state_bytes, world_size):
        assert held == pytest.approx(full / world_size, rel=0.02)


def ddp_gradients_are_averaged() -> list[float]:
    """Worker: each rank sees its own input; the gradient must be the mean over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    apply_ddp(model, init_device_mesh("cpu", (world,)))
    x = torch.full((1, 4), float(rank + 1))
    model(x).sum().backward()
    grad = model.weight.grad
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).flatten().tolist()


def test_ddp_averages_gradients_across_replicas():
    # d/dw of w·x is x; ranks feed x = 1 and x = 2, so the average gradient is 1.5 everywhere.
    for grad in run_distributed(ddp_gradients_are_averaged, 2):
        assert grad == pytest.approx([1.5] * 4)


def test_unknown_reshard_policy_is_rejected():
    with pytest.raises(ValueError, match="expected one of default, always, never, got 'sometimes'"):
        # checked before the mesh is used
        apply_fsdp(torch.nn.Linear(2, 2), None, FSDPOptions(reshard_after_forward="sometimes"))

