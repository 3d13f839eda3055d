"""The transformers backend's model: built by transformers' code from `HFModelArgs`, called with
positions that keep packed documents apart, its buffers as a folder holds them, named in the
start-up line, and its routed experts swapped for weft's where a run needs them."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from weft.models.transformers.args import HFModelArgs, transformers_config
from weft.models.transformers.experts import clamped_experts, grouped_experts_refusal, swap_in_grouped_experts

# Families whose transformers code builds its attention masks without the positions, so without the
# packed-sequence mask: their decoder accepts the masks by layer type instead (`attention_mask` a dict).
_MASKS_WITHOUT_POSITIONS = ("gpt_oss",)


def build(args: HFModelArgs) -> nn.Module:
    """The transformers causal LM of `args` on the current default device (meta included), in
    float32, with `args` as its `.args`."""
    from transformers import AutoModelForCausalLM

    hf_config = transformers_config(args.config, args.trust_remote_code, args.folder)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, trust_remote_code=args.trust_remote_code)
    model.args = args
    return model


def forward(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None = None,
            document_ids: torch.Tensor | None = None, **options) -> torch.Tensor:
    """Logits of a transformers causal LM. Packed documents are told apart by their positions, which
    restart at each document (transformers' packed-sequence mask); document_ids add nothing. For a
    family whose code builds its masks without the positions (`_MASKS_WITHOUT_POSITIONS`), the masks
    are built from them here and handed in by layer type (`_packed_masks`). `options` go to the model's call."""
    if positions is not None and positions.ndim == 1:
        positions = positions.expand(inputs.shape[0], -1)
    if positions is None or model.config.model_type not in _MASKS_WITHOUT_POSITIONS:
        return model(input_ids=inputs, position_ids=positions, use_cache=False, **options).logits
    hook = model.get_decoder().register_forward_pre_hook(_packed_masks, with_kwargs=True)
    try:
        return model(input_ids=inputs, position_ids=positions, use_cache=False, **options).logits
    finally:
        hook.remove()


def _packed_masks(decoder: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pre-hook of the decoder: its embeddings computed here (inside the whole model's call, so under
    FSDP and tp as there), and each layer type's mask built from them and the positions by
    transformers' own mask functions (block-diagonal causal, windowed for sliding layers)."""
    from transformers.masking_utils import create_masks_for_generate

    embeds = decoder.get_input_embeddings()(kwargs.pop("input_ids"))
    masks = create_masks_for_generate(decoder.config, embeds, attention_mask=None, cache=None,
                                      position_ids=kwargs["position_ids"])
    return args, kwargs | {"inputs_embeds": embeds, "attention_mask": masks}


@functools.lru_cache(maxsize=8)
def meta_model(args: HFModelArgs) -> nn.Module:
    """The model on the meta device, built once per args for what is read off its shape (counts,
    experts, names, convolutions); never changed: the recipe builds its own to transform."""
    with torch.device("meta"):
        return build(args)


def prepare_expert_parallel(model: nn.Module) -> None:
    """Swap the model's routed experts for weft's where weft computes them: plain SwiGLU ones, which
    `apply_ep` spreads and `apply_tp` splits by expert (its `moe_tp_experts` style), and gpt-oss's,
    which take LoRA's adapters. Others stay transformers' (expert parallelism and LoRA on experts
    refuse them before the model is built)."""
    if clamped_experts(model) or grouped_experts_refusal(model) is None:
        swap_in_grouped_experts(model)


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of `model` its state dict holds, by name: what a folder may hold beside the
    parameters (DeepSeek V3's router bias), read on load and written on export."""
    return [(f"{path}.{name}" if path else name, buffer) for path, module in model.named_modules()
            for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set]


def built_by_transformers(spec: Any, args: HFModelArgs, model: nn.Module) -> str:
    """The start-up line's "built by": transformers' version and the class it built (of a
    multimodal folder, its text model's)."""
    import transformers

    built = args.architecture if args.multimodal else type(model).__name__
    return f"built by transformers {transformers.__version__} ({built})"
