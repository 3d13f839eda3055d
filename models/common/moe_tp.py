"""Tensor parallelism for the Mixture-of-Experts layer (models/common/moe.py): the plan entries of one
`MoE` module, which a model's tensor-parallel plan adds for each of its MoE layers.

The routed experts are split by their hidden dimension (w1, w3: [experts, hidden/tp, dim]; w2:
[experts, dim, hidden/tp]; their LoRA adapters and gpt-oss's b1, b3 alike, its output bias b2 added
by the first rank), as Megatron splits a dense SwiGLU: the input is all-gathered along the sequence,
every tp rank routes every token alike and the partial outputs are reduce-scattered back; scores
weighing the outputs get their gradient summed over the ranks. Under expert parallelism the experts
stay whole and only the shared expert splits. Why, and the backward: docs/moe.md.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

# Which dimension of each stacked expert weight is the hidden one.
EXPERT_HIDDEN_DIMS = {"w1": 1, "w3": 1, "w2": 2}
# The biases of `ClampedSwiGLUExperts` ([experts, hidden]) split with w1's and w3's rows; b2 ([experts,
# dim]), added after w2's partial sums, stays whole and only the first rank adds it.
BIAS_HIDDEN_DIMS = {"b1": 1, "b3": 1}
OUTPUT_BIAS = "b2"
# And of their LoRA adapters (parallelisms/lora.py): B of w1, w3 [experts, hidden, rank] by rows, A of
# w2 [experts, rank, hidden] by columns; the other factor whole on every rank.
ADAPTER_HIDDEN_DIMS = {("lora_B", "w1"): 1, ("lora_B", "w3"): 1, ("lora_A", "w2"): 2,
                       ("lora_A", "w1"): None, ("lora_A", "w3"): None, ("lora_B", "w2"): None}


def moe_tp_plan(path: str, module: nn.Module) -> dict[str, ParallelStyle]:
    """The plan entries for the `MoE` at `path`, whose input and output are sequence-sharded
    (Shard(1)) as the rest of a sequence-parallel block's are."""
    if getattr(type(module.experts), "_expert_parallel", False):
        return _tokens_sharded_plan(path, module)
    plan: dict[str, ParallelStyle] = {
        path: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Partial(),), desired_output_layouts=(Shard(1),), use_local_output=True),
        f"{path}.router": ReplicatedParallel(),
        f"{path}.experts": ExpertHiddenParallel(),
    }
    if module.shared_expert is not None:
        plan[f"{path}.shared_expert.w1"] = ColwiseParallel()
        plan[f"{path}.shared_expert.w3"] = ColwiseParallel()
        plan[f"{path}.shared_expert.w2"] = RowwiseParallel(output_layouts=Partial())
    return plan


def _tokens_sharded_plan(path: str, module: nn.Module) -> dict[str, ParallelStyle]:
    """The entries for an MoE whose experts `apply_ep` spread: its tokens stay this tp rank's own
    sequence shard (flattened to [tokens, dim] inside the layer: Shard(0) there)."""
    plan: dict[str, ParallelStyle] = {
        path: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True),
        f"{path}.router": SequenceParallel(sequence_dim=0, use_local_output=True),
    }
    if module.shared_expert is not None:
        plan[f"{path}.shared_expert"] = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
        plan[f"{path}.shared_expert.w1"] = ColwiseParallel()
        plan[f"{path}.shared_expert.w3"] = ColwiseParallel()
        plan[f"{path}.shared_expert.w2"] = RowwiseParallel(output_layouts=Shard(0))
    return plan


class ReplicatedParallel(ParallelStyle):
    """A module whose parameters are whole on every rank (Replicate DTensors, so that FSDP and the
    gradient norm see them as the mesh's) and which computes on plain, replicated tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            input_fn=lambda _mod, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False) for x in inputs),
            output_fn=lambda _mod, output, _mesh: output.to_local(),
        )


class ExpertHiddenParallel(ParallelStyle):
    """`GroupedExperts` split by hidden dimension (`EXPERT_HIDDEN_DIMS`): each rank computes its
    slice of every expert for all the tokens it is given, whole on every rank, and returns its
    partial sum of the output; the incoming gradient of those tokens is all-reduced."""

    weight_split_dims = EXPERT_HIDDEN_DIMS  # what it splits, which `apply_tp` checks the mesh size divides

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in (EXPERT_HIDDEN_DIMS | BIAS_HIDDEN_DIMS | {OUTPUT_BIAS: None}).items():
            weight = getattr(module, name, None)
            if weight is not None:
                split = distribute_tensor(weight, device_mesh, [Shard(dim) if dim else Replicate()])
                module.register_parameter(name, nn.Parameter(split, requires_grad=weight.requires_grad))
        for (factor, name), dim in ADAPTER_HIDDEN_DIMS.items():  # LoRA's, where it adapted the experts
            holder = getattr(module, factor, None)
            if holder is not None and hasattr(holder, name):
                weight = getattr(holder, name)
                split = distribute_tensor(weight, device_mesh, [Shard(dim) if dim else Replicate()])
                holder.register_parameter(name, nn.Parameter(split, requires_grad=weight.requires_grad))
        module.__class__ = _hidden_split_class(type(module))
        module.tp_mesh = device_mesh
        return module


def _hidden_split_forward(self, x, counts):
    # The tokens are the same on every rank; each rank's slice of the experts gives part of the
    # gradient of its input, summed over the ranks in backward (grad placement Partial). So does
    # a whole adapter factor's gradient: each rank's comes through its slice of the hidden dimension.
    x = DTensor.from_local(x, self.tp_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
    # The output bias is added once to the partial sums: by rank 0 (zero elsewhere, its gradient summed).
    group, bias, first = self.tp_mesh.get_group(), getattr(self, OUTPUT_BIAS, None), self.tp_mesh.get_local_rank() == 0

    def local(w):
        if not w.placements[0].is_replicate():
            return w.to_local()
        whole = _SumGradient.apply(w.to_local(), group)
        return whole * 0 if w is bias and not first else whole

    return self.compute(x, counts, *self.weights(local))


def _hidden_split_weigh(self, out, scores):
    # Each rank's out is a partial sum: so is its gradient of the scores, summed over the ranks.
    return out * _SumGradient.apply(scores, self.tp_mesh.get_group())


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (a whole weight used with each
    rank's hidden slice: each rank's gradient is a part of it)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


def _hidden_split_class(cls: type) -> type:
    """`cls` computing on its rank's slices (as FSDP2 swaps a module's class for its own)."""
    if getattr(cls, "_hidden_split", False):
        return cls
    return type(f"HiddenSplit{cls.__name__}", (cls,), {"forward": _hidden_split_forward, "weigh": _hidden_split_weigh,
                                                    "_hidden_split": True})
