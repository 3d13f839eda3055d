"""How tensor parallelism splits weft's gpt-oss: the decoder plan for attention (q/k/v biases split
with their heads' rows, o's bias added once after the reduction), each head's sink on the rank of
its head, and the MoE layer's own entries (models/common/moe_tp.py: the experts and their biases
split by hidden dimension, or whole under expert parallelism). The model file knows nothing of it."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from weft.models.common.moe_tp import moe_tp_plan
from weft.models.common.tp_plan import decoder_tp_plan

Plan = dict[str, ParallelStyle]


class SinksByHead(ParallelStyle):
    """A sink attention core's `sinks` [n_heads] split as its heads are (Shard(0)); the core then
    computes with its rank's part."""

    weight_split_dims = {"sinks": 0}

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        sinks = module.sinks
        module.register_parameter("sinks", nn.Parameter(distribute_tensor(sinks, device_mesh, [Shard(0)]),
                                                        requires_grad=sinks.requires_grad))
        module.__class__ = _heads_split_class(type(module))
        return module


def _heads_split_class(cls: type) -> type:
    if getattr(cls, "_heads_split", False):
        return cls
    return type(f"HeadsSplit{cls.__name__}", (cls,), {"local_sinks": lambda self: self.sinks.to_local(),
                                                       "_heads_split": True})


def tp_plan(model: nn.Module, *, loss_parallel: bool = False, float8_linears: Collection[str] = (),
            float8_styles: dict[str, type[ParallelStyle]] | None = None) -> Plan:
    """An entry per block: the decoder's, the sinks', the MoE's."""
    plan = decoder_tp_plan(loss_parallel=loss_parallel, float8_linears=float8_linears, float8_styles=float8_styles,
                           blocks=[f"layers.{name}" for name in model.layers], attention_inputs=3)
    for name, block in model.layers.items():
        path = f"layers.{name}.feed_forward"
        plan = {key: style for key, style in plan.items() if key != path and not key.startswith(f"{path}.")}
        plan.update(moe_tp_plan(path, block.feed_forward))
        plan[f"layers.{name}.attention.core"] = SinksByHead()
    return plan
