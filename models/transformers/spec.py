"""transformers as a model backend: a Hugging Face folder's model built by transformers' own modeling
code from its config.json, as the rest of weft sees a model (models/common/spec.py).

Its hyper-parameters (`HFModelArgs`, args.py) are the config.json itself plus the shape fields the
recipe reads; its parameter names are transformers' own, so the folder's tensor names, PEFT's module
names and the export's names are one and the same (hf_mapping.py), but where transformers stacks a
folder's per-expert tensors on load (conversions.py). Counts come from the model built on the meta
device (counts.py); what it cannot train, and why, from refusals.py.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from weft.models.common.spec import Backend, ModelSpec, Refusals
from weft.models.transformers.args import HFModelArgs
from weft.models.transformers.counts import block_numel, experts, flops_per_token, lora_block_numel
from weft.models.transformers.decoding import TRANSFORMERS_DECODING
from weft.models.transformers.head import forward_head
from weft.models.transformers.hf_mapping import TRANSFORMERS_HF, hf_mapping
from weft.models.transformers.model import (
    build,
    built_by_transformers,
    forward,
    persistent_buffers,
    prepare_expert_parallel,
)
from weft.models.transformers.refusals import layout_refusal, packed_documents_refusal, peft_refusal
from weft.models.transformers.routing import count_routed_tokens


def _unsupported(model, **_) -> Any:
    raise NotImplementedError("the transformers backend's own plans are the model's (parallelisms/tp.py, hf_stages.py)")


class _NoWeftModel(nn.Module):
    """No module is one: `spec_for_model` leaves a transformers model to the parallelisms' own paths
    for transformers models (its `_tp_plan`, its pipeline stage, its `_init_weights`)."""


TRANSFORMERS_BACKEND = Backend(name="transformers", forward=forward, forward_head=forward_head,
                               folder_buffers=persistent_buffers,
                               describe=built_by_transformers, count_routing=count_routed_tokens,
                               decoding=TRANSFORMERS_DECODING)

TRANSFORMERS_SPEC = ModelSpec(
    name="transformers", flavors={}, args_type=HFModelArgs, model_type=_NoWeftModel, build=build,
    tp_plan=_unsupported, pipeline_units=_unsupported, hf=TRANSFORMERS_HF, flops_per_token=flops_per_token,
    block_numel=block_numel, lora_block_numel=lora_block_numel, experts=experts,
    refusals=Refusals(peft=peft_refusal, packed_documents=packed_documents_refusal, layout=layout_refusal),
    backend=TRANSFORMERS_BACKEND, hf_for_args=hf_mapping, prepare_expert_parallel=prepare_expert_parallel)
