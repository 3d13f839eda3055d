"""apply_ep (parallelisms/ep.py): over 2 gloo ranks, each holding 2 of the debug MoE's 4 experts and
half of every batch, 10 AdamW steps train the debug Llama 4 as one process does on the whole
batches (fp32, the routing bias moving), and the transform refuses what it cannot split."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from weft.components.training.moe_balance import ep_imbalance, moe_layers
from weft.models.llama4 import LLAMA4_FLAVORS, Transformer
from weft.parallelisms.common import TransformError
from weft.parallelisms.ep import apply_ep, expert_parameters
from weft.parallelisms.materialize import materialize

from tests.support.dist_utils import run_distributed
from tests.support.ep_training import BATCH, STEPS, train

ARGS = replace(LLAMA4_FLAVORS["debugmodel_moe"], attention_chunk_size=8)


def ep_and_one_process() -> tuple[list[float], list[float], tuple[float, str], list]:
    """Worker: (EP's losses, one process's, (the largest weight difference, its name), the biases
    of EP's rank and of one process)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    models = []
    for split in (True, False):
        with torch.device("meta"):
            models.append(Transformer(ARGS))
        if split:
            apply_ep(models[-1], init_device_mesh("cpu", (world,)))
        materialize(models[-1], "cpu", seed=0)
    assert all(p.to_local().shape[0] == ARGS.n_experts // world for _, p in expert_parameters(models[0]))
    share = BATCH // world
    imbalances, expected = [], []
    losses = train(models[0], slice(rank * share, (rank + 1) * share), world, imbalances=imbalances)
    reference = train(models[1], slice(None), 1, imbalances=expected)
    whole = dict(models[1].named_parameters())
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in models[0].named_parameters()}
    difference = max((full[n].sub(whole[n]).abs().max().item(), n) for n in full)
    biases = [[layer.expert_bias.tolist() for _, layer in moe_layers(m)] for m in models]
    return losses, reference, difference, biases, (imbalances, expected)


def test_ep2_trains_the_debug_moe_as_one_process_does():
    """... and each step's EP imbalance (the tokens each rank's experts received, busiest over the
    mean) equals the one computed from one process's counts of the same routing."""
    for losses, reference, difference, biases, (imbalances, expected) in run_distributed(ep_and_one_process, 2):
        assert reference[-1] < reference[0] - 0.5  # it learns
        assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5
        assert difference[0] < 1e-4, difference
        assert biases[0] == biases[1] and any(b != 0 for layer in biases[1] for b in layer)  # routed alike
        assert len(imbalances) == len(expected) == STEPS  # pytest 9.2's approx takes no list of dicts
        assert all(got == pytest.approx(want, rel=1e-6) for got, want in zip(imbalances, expected))
        assert any(v > 1.01 for step in expected for v in step.values())  # uneven somewhere: not a tautology


def skewed_routing() -> dict[str, float]:
    """Worker: an MoE layer (top 1) whose bias sends every token to expert 0 (on rank 0), so the
    other experts, rank 1's among them, receive nothing: outputs, input gradients and expert
    gradients against the whole layer on both ranks' tokens. Returns the largest difference of each."""
    from weft.models.common.moe import MoE

    rank = dist.get_rank()
    torch.manual_seed(0)
    whole = MoE(16, 32, 4, 1, shared_hidden_dim=32)
    for param in whole.parameters():
        torch.nn.init.normal_(param, std=0.3)
    whole.expert_bias.copy_(torch.tensor([100.0, 0.0, 0.0, 0.0]))
    split = MoE(16, 32, 4, 1, shared_hidden_dim=32)
    split.load_state_dict(whole.state_dict())
    holder = torch.nn.ModuleDict({"moe": split})
    apply_ep(holder, init_device_mesh("cpu", (2,)))
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))  # both ranks' tokens
    mine, every = x[rank].clone().requires_grad_(), x.clone().requires_grad_()
    out, reference = split(mine), whole(every)
    out.square().sum().backward()
    reference.square().sum().backward()
    world = dist.group.WORLD
    return {
        "ep_imbalance": ep_imbalance(holder, world, world)["moe"],  # every token on rank 0's experts: ep = 2
        "out": (out - reference[rank]).abs().max().item(),
        "x.grad": (mine.grad - every.grad[rank]).abs().max().item(),
        # the whole layer's gradient sums both ranks' tokens; apply_ep's is their mean
        **{name: (p.grad.full_tensor() * 2 - getattr(whole.experts, name).grad).abs().max().item()
           for name, p in split.experts.named_parameters()},
        "tokens on experts 1-3": whole.tokens_per_expert[1:].sum().item(),
    }


def test_a_rank_whose_experts_receive_no_tokens_neither_hangs_nor_errs():
    for result in run_distributed(skewed_routing, 2):
        assert result.pop("tokens on experts 1-3") == 0
        assert result.pop("ep_imbalance") == 2.0
        assert max(result.values()) < 1e-5, result


TWO_EXPERTS = replace(ARGS, n_experts=2, top_k=1)


def ep2_over_fsdp4() -> tuple[list[float], list[float], list[str]]:
    """Worker: 4 ranks, ep 2 borrowed from fsdp 4 through parallelize: each rank holds 1 of the 2
    experts, and FSDP splits it over the 2 ranks holding the same one along its largest dim (one
    expert cannot split by dim 0). (losses, one process's losses, the experts' placements)."""
    from weft.parallelisms.fsdp import FSDPOptions
    from weft.parallelisms.parallel_dims import ParallelDims
    from weft.parallelisms.parallelize import ParallelizeOptions, parallelize

    rank = dist.get_rank()
    models = []
    for split in (True, False):
        with torch.device("meta"):
            models.append(Transformer(TWO_EXPERTS))
        if split:
            meshes = ParallelDims.resolve(world_size=4, dp_shard=4, ep=2).build_mesh("cpu")
            parallelize(models[-1], meshes, ParallelizeOptions(fsdp=FSDPOptions(param_dtype=torch.float32)))
        materialize(models[-1], "cpu", seed=0)
    placements = sorted({str(p.placements) for _, p in expert_parameters(models[0])})
    losses = train(models[0], slice(rank, rank + 1), 4, fsdp=True)
    return losses, train(models[1], slice(None), 1), placements


@pytest.mark.slow
def test_ep2_borrowed_from_fsdp4_splits_a_lone_expert_and_trains_as_one_process():
    for losses, reference, placements in run_distributed(ep2_over_fsdp4, 4):
        assert placements == ["(Shard(dim=1), Shard(dim=0))"], placements  # (dp_shard_mod_ep, ep)
        assert reference[-1] < reference[0] - 0.5
        assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5


class MeshOfSize:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def test_experts_that_do_not_divide_and_models_without_experts_are_refused():
    with torch.device("meta"):
        model = Transformer(ARGS)
    with pytest.raises(TransformError, match="ep_mesh size 3 does not divide layers.1.feed_forward.experts's 4 experts"):
        apply_ep(model, MeshOfSize(3))
    with pytest.raises(TransformError, match="Linear has no MoE layer"):
        apply_ep(torch.nn.Linear(4, 4), MeshOfSize(2))
