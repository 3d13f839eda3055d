"""Expert parallelism: each rank of an EP mesh holds a share of every MoE layer's routed experts,
and tokens travel to the rank that holds their expert and back by all-to-all.

The EP ranks are data-parallel, each routing its own tokens. `apply_ep` makes `GroupedExperts`
exchange the token counts, send each token to its expert's rank, run the grouped multiply over its
own experts and send the outputs home (autograd-aware all-to-alls; nothing dropped or padded). The
experts' gradient is scaled by 1/ep (tp/ep when the EP mesh holds tp ranks) so that it is the mean
over the same tokens as the other parameters'. The steps and the reasoning: docs/moe.md.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from weft.errors import TransformError, refuse_data_parallel_model
from weft.layers import EXPERT_WEIGHTS
from weft.layers.nf4_experts import NF4Experts

logger = logging.getLogger("weft")

__all__ = ["apply_ep", "expert_modules", "expert_parameters"]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, *, sequence_shards: int = 1) -> nn.Module:
    """Spread the routed experts of every MoE layer over `ep_mesh` (each weight a Shard(0) DTensor:
    checkpoints and exports see whole tensors) and exchange tokens by all-to-all.

    Works on weft's MoE layer (stacked `w1`, `w2`, `w3` and `compute(x, counts, w1, w2, w3)`) or a module
    naming its own in `stacked_weights` and `expert_parallel_method`; the experts must divide by the
    mesh size. Apply to the plain model (meta or real, after `apply_lora`), before activation
    checkpointing, FSDP (`expert_mesh=`) and `apply_tp`; under a pipeline, per stage with the stage's
    ep mesh. Not with compile. sequence_shards: ranks of each ep group holding parts of the same
    samples (tp's sequence shards when ep borrows tp's ranks); the experts' gradient is scaled by
    sequence_shards / ep. docs/moe.md says why each of these holds.
    """
    refuse_data_parallel_model(model, "apply_ep")
    ep = ep_mesh.size()
    experts = _grouped_experts(model)
    if not experts:
        raise TransformError("apply_ep", "model", f"{type(model).__name__} has no MoE layer with stacked experts")
    for name, module in experts:
        n_experts = _n_experts(module)
        if any(isinstance(getattr(module, w), DTensor) for w in _stacked_weights(module)):
            raise TransformError("apply_ep", "model", f"{name} is already split (a DTensor); apply_ep comes first")
        if ep % sequence_shards:
            raise TransformError("apply_ep", "sequence_shards", f"sequence_shards {sequence_shards} does not divide "
                                 f"ep_mesh size {ep}")
        if n_experts % ep:
            raise TransformError("apply_ep", "ep_mesh", f"ep_mesh size {ep} does not divide {name}'s {n_experts} "
                                 "experts; each rank must hold as many experts as the others")
    for _, module in experts:  # the experts' weights and their LoRA adapters, if any, by expert
        holders = [module] + [getattr(module, f) for f in ("lora_A", "lora_B") if hasattr(module, f)]
        for holder in holders:
            for weight_name, weight in list(holder.named_parameters(recurse=False)):
                holder.register_parameter(weight_name, nn.Parameter(distribute_tensor(weight, ep_mesh, [Shard(0)]),
                                                                    requires_grad=weight.requires_grad))
        module.__class__ = _expert_parallel_class(type(module))
        module.ep_mesh, module.grad_scale = ep_mesh, sequence_shards / ep
    logger.info(f"apply_ep: the experts of {len(experts)} MoE layers over ep_mesh size {ep} "
                f"({_n_experts(experts[0][1]) // ep} experts a rank), tokens exchanged by all-to-all")
    return model


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose experts `apply_ep` spread."""
    return [module for module in model.modules() if getattr(type(module), "_expert_parallel", False)]


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters `apply_ep` spread over its mesh (the experts' weights and LoRA adapters)."""
    return [(f"{name}.{w}", p) for name, module in model.named_modules()
            if getattr(type(module), "_expert_parallel", False) for w, p in module.named_parameters()]


def _stacked_weights(module: nn.Module) -> tuple[str, ...]:
    """The names of a module's weights stacked by expert: w1, w2, w3 unless it names others."""
    return getattr(module, "stacked_weights", EXPERT_WEIGHTS)


def _n_experts(module: nn.Module) -> int:
    return getattr(module, _stacked_weights(module)[0]).shape[0]


def _grouped_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules()
            if all(isinstance(getattr(module, w, None), nn.Parameter) and getattr(module, w).ndim == 3
                   for w in _stacked_weights(module)) and callable(getattr(module, "compute", None))]


def _expert_parallel_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
    local = counts.numel() // ep
    # 1. how many tokens each rank sends to each of this rank's experts: [source rank, local expert]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    received = received.view(ep, local)
    send_sizes = counts.view(ep, local).sum(1).tolist()
    receive_sizes = received.sum(1).tolist()
    # 2. tokens to the ranks holding their experts
    arrived = funcol.all_to_all_single_autograd(x.contiguous(), receive_sizes, send_sizes, group)
    # 3. arrival order is (source rank, local expert); the grouped multiply wants (local expert, source)
    segment = torch.repeat_interleave(torch.arange(ep * local, device=x.device), received.flatten(),
                                      output_size=arrived.shape[0])
    order = ((segment % local) * ep + segment // local).argsort(stable=True)
    weights = self.weights(lambda weight: _local_weight(weight, self.grad_scale))  # adapters alike
    computed = self.compute(arrived[order], received.sum(0), *weights)
    out = torch.empty_like(computed).index_copy(0, order, computed)  # back in arrival order
    # 4. the outputs home, in the order their tokens left
    return funcol.all_to_all_single_autograd(out.contiguous(), send_sizes, receive_sizes, group)


def _local_weight(weight, grad_scale: float):
    """This rank's experts of a weight: its local shard (gradient scaled), or a frozen NF4 stack
    as it is (it dequantizes its own shard, and takes no gradient)."""
    if isinstance(weight, NF4Experts):
        return weight
    return _ScaleGradient.apply(weight.to_local(), grad_scale)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _expert_parallel_class(cls: type) -> type:
    """`cls` exchanging tokens with its EP mesh (as FSDP2 swaps a module's class for its own)."""
    if getattr(cls, "_expert_parallel", False):
        return cls
    method = getattr(cls, "expert_parallel_method", "forward")
    return type(f"ExpertParallel{cls.__name__}", (cls,), {method: _expert_parallel_forward, "_expert_parallel": True})
