"""How tensor parallelism splits weft's Llama 4: the decoder plan for attention and the dense
feed-forwards (the attention's third input, the NoPE temperature, passes through whole), and
the MoE layer's own entries for each MoE feed-forward (models/common/moe_tp.py: the router
replicated, the routed and shared experts split by their hidden dimension, which says why).
The model file knows nothing of it."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from weft.models.common.moe_tp import moe_tp_plan
from weft.models.common.tp_plan import decoder_tp_plan

Plan = dict[str, ParallelStyle]


def tp_plan(model: nn.Module, *, loss_parallel: bool = False, float8_linears: Collection[str] = (),
            float8_styles: dict[str, type[ParallelStyle]] | None = None) -> Plan:
    """An entry per block: the decoder's for a dense block, its attention and the MoE's for an MoE block."""
    plan = decoder_tp_plan(loss_parallel=loss_parallel, float8_linears=float8_linears, float8_styles=float8_styles,
                           blocks=[f"layers.{name}" for name in model.layers], attention_inputs=3)
    for name, block in model.layers.items():
        if block.moe:
            path = f"layers.{name}.feed_forward"
            plan = {key: style for key, style in plan.items() if key != path and not key.startswith(f"{path}.")}
            plan.update(moe_tp_plan(path, block.feed_forward))
    return plan
