"""A decoder family's `ModelSpec` with what decoders share filled in: built by its model class,
cut into pipeline units at its blocks, split by the dense TP plan, its FLOPs counted by the
decoder formula. A family passes what is its own, and overrides what differs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from weft.models.common.counts import decoder_flops_per_token
from weft.models.common.pipeline import decoder_units
from weft.models.common.spec import HFMapping, ModelSpec
from weft.models.common.tp_plan import dense_tp_plan


def decoder_spec(name: str, flavors: Mapping[str, Any], args_type: type, model: type[nn.Module], hf: HFMapping,
                 **fields: Any) -> ModelSpec:
    """The ModelSpec of a family whose `model(args)` builds a `Decoder`, set as that class's `spec`;
    `fields`: the other ModelSpec fields (block_numel, ...) and any of tp_plan, pipeline_units,
    flops_per_token that differ from the decoder's."""
    shared = {"build": model, "tp_plan": dense_tp_plan, "pipeline_units": decoder_units,
              "flops_per_token": decoder_flops_per_token}
    spec = ModelSpec(name=name, flavors=flavors, args_type=args_type, model_type=model, hf=hf, **(shared | fields))
    model.spec = spec  # the model hands transforms its plan and units (`Decoder.tensor_parallel_plan`)
    return spec
