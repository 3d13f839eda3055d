"""How tensor parallelism splits weft's Qwen3: the decoder plan for attention and the dense
feed-forwards, the per-head q/k norms (whose input is this rank's heads: their weights stay whole,
their gradient summed over the ranks), and the MoE layer's own entries for each MoE feed-forward
(models/common/moe_tp.py, which refuses Qwen3-MoE's score-after-experts layer unless expert
parallelism holds its experts). The model file knows nothing of it."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from weft.models.common.moe_tp import moe_tp_plan
from weft.models.common.tp_plan import decoder_tp_plan

Plan = dict[str, ParallelStyle]


def tp_plan(model: nn.Module, *, loss_parallel: bool = False, float8_linears: Collection[str] = (),
            float8_styles: dict[str, type[ParallelStyle]] | None = None) -> Plan:
    """An entry per block: the decoder's, the q/k norms', and for an MoE block the MoE's."""
    plan = decoder_tp_plan(loss_parallel=loss_parallel, float8_linears=float8_linears, float8_styles=float8_styles,
                           blocks=[f"layers.{name}" for name in model.layers])
    for name, block in model.layers.items():
        for norm in ("q_norm", "k_norm"):  # [batch, seq, local heads, head_dim]: split by heads (dim 2)
            plan[f"layers.{name}.attention.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if block.moe:
            path = f"layers.{name}.feed_forward"
            plan = {key: style for key, style in plan.items() if key != path and not key.startswith(f"{path}.")}
            plan.update(moe_tp_plan(path, block.feed_forward))
    return plan
