"""A short AdamW training loop of a Llama 4 model on fixed batches, under expert parallelism or in one
process, with the routing bias moving every step: what the EP tests compare."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weft.components.training.moe_balance import balance_experts, ep_imbalance, moe_layers
from weft.parallelisms.ep import expert_parameters

STEPS, BATCH, SEQ, BIAS_RATE = 10, 4, 24, 1e-2


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 16, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def average_gradients(model: torch.nn.Module, ep: int) -> None:
    """What data parallelism over the EP ranks does: the mean of the ranks' gradients, for all but
    the experts, whose gradient apply_ep makes the mean over the ranks' tokens already."""
    experts = {id(p) for _, p in expert_parameters(model)}
    for param in model.parameters():
        if id(param) not in experts:
            dist.all_reduce(param.grad)
            param.grad.div_(ep)


def blocks_imbalance(model: torch.nn.Module, blocks: int) -> dict[str, float]:
    """What ep_imbalance should say, from one process's counts: each layer's tokens for each block
    of n_experts / blocks experts (the experts one EP rank holds), the largest over the mean."""
    loads = {name: layer.tokens_per_expert.view(blocks, -1).sum(-1) for name, layer in moe_layers(model)}
    return {name: (load.max() / load.mean()).item() for name, load in loads.items()}


def train(model: torch.nn.Module, rows: slice, ep: int, fsdp: bool = False,
          imbalances: list | None = None, steps: int = STEPS) -> list[float]:
    """`steps` (10) steps on `rows` of each batch; the EP imbalance of each step into `imbalances`
    (ep_imbalance under ep, else the one-process formula over 2 ranks' blocks)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    losses = []
    for tokens in batches()[:steps]:
        tokens = tokens[rows]
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if ep > 1 and not fsdp:
            average_gradients(model, ep)
        optimizer.step()
        optimizer.zero_grad()
        if imbalances is not None:
            world = dist.group.WORLD
            imbalances.append(ep_imbalance(model, world, world) if ep > 1 else blocks_imbalance(model, 2))
        balance_experts(model, BIAS_RATE, dist.group.WORLD if ep > 1 else None)
        loss = loss.detach()
        if ep > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size() if ep > 1 else loss.item())
    return losses
