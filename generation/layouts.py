"""What `generate` does for the layout the training model is in: FSDP2's weights gathered once per
call, not once per forward (unshard with reshard-after-forward off, then reshard and put back);
every rank taking the same number of batches and forwards (an all-reduce of "any row still
running"), so the collectives inside a forward (TP, EP, DDP's buffers) match when one rank's
sequences stop sooner; pipeline stages and context parallelism refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

from weft.generation.errors import GenerationError
from weft.parallelisms.cp import ContextParallelAttention
from weft.parallelisms.hf_stages import HFCausalLMStage


def refuse_layout(model: nn.Module) -> None:
    """GenerationError for a pipeline stage (pp) or context-parallel attention (cp)."""
    stage = any(getattr(model, name, False) is None for name in ("tok_embeddings", "norm", "output"))
    if stage or isinstance(model, HFCausalLMStage):
        raise GenerationError(f"generate cannot run a pipeline stage ({type(model).__name__} lacks the modules other "
                              "stages hold): generation under pp (pipeline parallelism) is not supported; use pp 1")
    for name, module in model.named_modules():
        if isinstance(module, ContextParallelAttention) or hasattr(module, "context_parallel_core"):
            raise GenerationError(f"generate cannot run {name or 'the model'} across context shards: generation "
                                  "under cp (context parallelism) is not supported; use cp 1")


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """FSDP2's weights unsharded for the whole block, not resharded after each forward; on leaving,
    resharded and each unit's reshard-after-forward as it was. Nothing for a model without FSDP."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)  # not DDP's (replicate's)
             and all(isinstance(group.mesh_info, FSDPMeshInfo) for group in module._get_fsdp_state()._fsdp_param_groups)]
    # set_reshard_after_forward has no getter: each unit's setting is read (and put back) from its state
    saved = [(state, state._auto_reshard_after_forward, [(group, group.post_forward_mesh_info)
                                                          for group in state._fsdp_param_groups])
             for state in (unit._get_fsdp_state() for unit in units)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, info in groups:
                group.post_forward_mesh_info = info


def distributed() -> bool:
    """Whether this process is one of several ranks that call `generate` together."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def most(value: int, device: torch.device) -> int:
    """The largest `value` over every rank (the value itself in one process)."""
    if not distributed():
        return value
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def sequence_multiple(model: nn.Module) -> int:
    """What each forward's tokens per row must be a multiple of: the tensor-parallel degree (the mesh
    dimension named "tp" of its split parameters), whose sequence-parallel norms split the sequence
    evenly over the ranks; 1 without tensor parallelism."""
    for param in model.parameters():
        names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
        if "tp" in names:
            return param.device_mesh.size(names.index("tp"))
    return 1
