"""FSDP over 2 gloo ranks trains the debug Llama 4 MoE as one process does (fp32, 10 AdamW steps,
the routing bias balancing the experts), and splits experts over more ranks than there are experts."""

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from weft.components.training.moe_balance import balance_experts, moe_layers
from weft.models.llama4 import LLAMA4_FLAVORS, Transformer
from weft.parallelisms.fsdp import FSDPOptions, apply_fsdp
from weft.parallelisms.materialize import materialize

from tests.support.dist_utils import run_distributed

ARGS = replace(LLAMA4_FLAVORS["debugmodel_moe"], attention_chunk_size=8)  # chunks inside the 24 tokens
STEPS, BATCH, SEQ = 10, 4, 24
BIAS_RATE = 1e-2


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # 16 of the 2048 tokens: a distribution 10 steps can learn
    return [torch.randint(0, 16, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def train(model: torch.nn.Module, rows: slice, distributed: bool) -> list[float]:
    """Global-batch mean losses of STEPS AdamW steps, this process computing `rows` of each batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in batches():
        tokens = tokens[rows]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        balance_experts(model, BIAS_RATE, dist.group.WORLD if distributed else None)  # counts summed over ranks
        loss = loss.detach()
        if distributed:  # FSDP averages the ranks' gradients; the loss likewise
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def fsdp_and_one_process() -> tuple[list[float], list[float], tuple[float, str], list]:
    """Worker: (FSDP's losses, one process's losses, (the largest weight difference after training,
    its parameter), [FSDP's routing biases on each rank, one process's])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    models = []
    for sharded in (True, False):
        with torch.device("meta"):
            models.append(Transformer(ARGS))
        if sharded:
            apply_fsdp(models[-1], init_device_mesh("cpu", (world,)), FSDPOptions(param_dtype=torch.float32))
        materialize(models[-1], "cpu", seed=0)
    share = BATCH // world
    losses = train(models[0], slice(rank * share, (rank + 1) * share), distributed=True)
    reference = train(models[1], slice(None), distributed=False)
    reference_weights = dict(models[1].named_parameters())
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in models[0].named_parameters()}
    difference = max((full[n].sub(reference_weights[n]).abs().max().item(), n) for n in full)
    biases = [None] * world
    dist.all_gather_object(biases, [layer.expert_bias.tolist() for _, layer in moe_layers(models[0])])
    return losses, reference, difference, [*biases, [layer.expert_bias.tolist() for _, layer in moe_layers(models[1])]]


def test_fsdp2_trains_the_debug_moe_as_one_process_does():
    """With the routing bias moving after every step: the same biases on both ranks as in one
    process (the ranks' token counts are summed before each move), so every token routes alike."""
    losses, reference, weight_difference, biases = run_distributed(fsdp_and_one_process, 2)[0]
    assert biases[0] == biases[1] == biases[2] and any(b != 0 for layer in biases[2] for b in layer)
    assert reference[-1] < reference[0] - 0.5  # it learns
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5
    # Adam divides by the root of the squared gradients: where a gradient is near zero, the
    # rounding of a two-rank sum moves its update by a visible fraction of lr (3e-3).
    assert weight_difference[0] < 1e-4, weight_difference


def test_fsdp_on_more_ranks_than_experts_splits_each_expert():
    """8 ranks, 4 experts: every rank holds an eighth of every expert (split along the largest
    dimension), not ranks 0-3 a whole expert each and ranks 4-7 none; other weights along dim 0."""
    from torch.distributed.tensor import Shard

    from weft.components.distributed.processes import init_fake_distributed

    with torch.device("meta"):
        model = Transformer(LLAMA4_FLAVORS["debugmodel_moe"])
    init_fake_distributed(8)
    try:
        apply_fsdp(model, init_device_mesh("cpu", (8,)))
    finally:
        dist.destroy_process_group()
    experts = model.layers["1"].feed_forward.experts
    for weight in (experts.w1, experts.w2, experts.w3):
        assert weight.placements == (Shard(1),) and weight.to_local().shape[1] * 8 == weight.shape[1]
    assert model.layers["1"].attention.wq.weight.placements == (Shard(0),)
