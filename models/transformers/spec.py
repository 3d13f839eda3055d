"""transformers as a model backend: a Hugging Face folder's model built by transformers' own modeling
code from its config.json, as the rest of weft sees a model (models/common/spec.py).

Its hyper-parameters (`HFModelArgs`) are the config.json itself plus the shape fields the recipe
reads; its parameter names are transformers' own, so the folder's tensor names, PEFT's module names
and the export's names are one and the same (`SameNames`), but where transformers stacks a folder's
per-expert tensors on load (conversions.py). Counts (block parameters, adapters) come
from the model built on the meta device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weft.models.common.hf_names import ExpertParameters
from weft.models.common.spec import Experts, HFConfigError, HFMapping, ModelSpec
from weft.models.transformers.conversions import converted_names
from weft.models.transformers.experts import (
    TransformersRoutedExperts,
    clamped_experts,
    grouped_experts_refusal,
    routed_experts,
    swap_in_grouped_experts,
)
from weft.models.transformers.family_refusals import refuse_family
from weft.models.transformers.multimodal import multimodal_class, multimodal_names
from weft.models.transformers.routing import count_routed_tokens

BACKEND = "transformers"
_DTYPE_KEYS = ("torch_dtype", "dtype")


@dataclass(frozen=True)
class HFModelArgs:
    """A transformers model's config.json (`config_json`, as JSON text) and the fields weft reads of
    its shape. `folder`: where its custom modeling code lives, with trust_remote_code."""

    config_json: str
    model_type: str
    architecture: str
    n_layers: int
    dim: int
    n_heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden_dim: int  # the feed-forward's width (intermediate_size), for the memory estimate
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    declares_tp_plan: bool  # whether transformers declares a tensor-parallel plan for it (base_model_tp_plan)
    trust_remote_code: bool = False
    folder: str = ""
    text_config_json: str = ""  # a multimodal folder's text model's config (transformers' full one); "" otherwise
    output_weight: str = "lm_head.weight"  # the output projection's weight (not written where tied)

    @property
    def config(self) -> dict[str, Any]:
        """The config of the model built: the folder's, or its text model's in a multimodal folder."""
        return json.loads(self.text_config_json or self.config_json)

    @property
    def folder_config(self) -> dict[str, Any]:
        """The folder's config.json, as the export writes it."""
        return json.loads(self.config_json)

    @property
    def multimodal(self) -> bool:
        return bool(self.text_config_json)


def args_from_hf_config(config: dict[str, Any], *, trust_remote_code: bool = False, folder: str = "") -> HFModelArgs:
    """The HFModelArgs of a config.json transformers can build a causal LM of (HFConfigError, one
    line naming the field, otherwise)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise HFConfigError("config.json has no model_type")
    if "auto_map" in config and not trust_remote_code:
        raise HFConfigError(f"config.json has auto_map (the model's own code, model_type {model_type}), which the "
                            "transformers backend runs only when trusted: model.trust_remote_code = true "
                            "(generate.py --trust-remote-code)")
    text_config_json = ""
    hf_config = _transformers_config(config, trust_remote_code, folder)
    refuse_family(hf_config)  # HFConfigError where transformers computes the family two ways
    architecture = (config.get("architectures") or [None])[0] or _causal_lm_class(hf_config).__name__
    if "text_config" in config:  # the text model of a multimodal folder, as transformers' causal LM of its text config
        hf_config = _multimodal_text_config(config, hf_config, folder)
        text_config_json = json.dumps(hf_config.to_dict(), sort_keys=True)
        architecture = f"{_causal_lm_class(hf_config).__name__}, the text model of {architecture}"
    else:
        converted_names(model_type, architecture)  # HFConfigError where transformers converts its folders otherwise
    output_weight, tied = _output_weight(hf_config)
    n_heads = _field(hf_config, "num_attention_heads")
    dim = _field(hf_config, "hidden_size")
    return HFModelArgs(
        config_json=json.dumps(config, sort_keys=True), model_type=model_type, architecture=architecture,
        n_layers=_field(hf_config, "num_hidden_layers"), dim=dim, n_heads=n_heads,
        kv_heads=_attribute(hf_config, "num_key_value_heads") or n_heads,
        head_dim=_attribute(hf_config, "head_dim") or dim // n_heads,
        ffn_hidden_dim=_attribute(hf_config, "intermediate_size") or 4 * dim,
        vocab_size=_field(hf_config, "vocab_size"),
        max_seq_len=_attribute(hf_config, "max_position_embeddings") or 2**31 - 1,
        tie_embeddings=tied,
        declares_tp_plan=bool(_attribute(hf_config, "base_model_tp_plan")),
        trust_remote_code=trust_remote_code, folder=folder, output_weight=output_weight,
        text_config_json=text_config_json)


def _multimodal_text_config(config: dict[str, Any], hf_config, folder: str):
    """The text model's config of a multimodal folder (transformers' `get_text_config`), refused in
    one line where its tensors could not be read: no folder, or a text family whose tensors
    transformers converts on load (stacked experts)."""
    if not folder or not (Path(folder) / "config.json").is_file():
        raise HFConfigError(f"model_type {config['model_type']} is multimodal (config.json has text_config): its text "
                            f"model's tensors are named by its folder, which is not there ({folder!r})")
    multimodal_class(config)  # HFConfigError where transformers has no class of its architectures
    text = hf_config.get_text_config(decoder=True)
    if text is hf_config:
        raise HFConfigError(f"model_type {config['model_type']}: transformers finds no text model's config in "
                            "its config.json")
    _causal_lm_class(text)
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))  # as the multimodal model ties
    if converted_names(text.model_type) is not None:
        raise HFConfigError(f"model_type {config['model_type']}: transformers converts its text model's "
                            f"({text.model_type}) tensors on load, which the transformers backend does not make "
                            "for a multimodal folder yet")
    return text


def _output_weight(hf_config) -> tuple[str, bool]:
    """(the output projection's weight, whether it is the token embedding's), by the tie transformers
    makes: the class's `_tied_weights_keys` where config.tie_word_embeddings is set (BioGPT's
    `output_projection.weight`; CPM-Ant's flag ties nothing). A folder's own code: lm_head, tied as flagged."""
    flagged = bool(_attribute(hf_config, "tie_word_embeddings"))
    try:
        tied = getattr(_causal_lm_class(hf_config), "_tied_weights_keys", None) or {}
    except HFConfigError:
        return "lm_head.weight", flagged
    names = list(tied) if isinstance(tied, (dict, list, tuple)) else []
    if flagged and len(names) > 1:  # BERT-style heads: the decoder's bias too
        raise HFConfigError(f"model_type {hf_config.model_type}: transformers ties {len(names)} tensors to others "
                            f"({', '.join(names)}); the transformers backend ties the output projection only")
    output = next((name for name in names if name.endswith(".weight")), "lm_head.weight")
    return output, flagged and bool(names)


def _attribute(hf_config, name: str) -> Any:
    """A config attribute, None where it is missing; where it varies by layer (Gemma 4's head_dim, which
    transformers refuses to read as one value: AmbiguousGlobalPerLayerAttributeError, a RuntimeError),
    its global value."""
    try:
        return getattr(hf_config, name, None)
    except RuntimeError:
        return vars(hf_config).get(name)


def _field(hf_config, name: str) -> int:
    value = _attribute(hf_config, name)
    if not isinstance(value, int):
        raise HFConfigError(f"config.json of model_type {hf_config.model_type} has no integer {name}")
    return value


def _transformers_config(config: dict[str, Any], trust_remote_code: bool, folder: str):
    """transformers' config object of a config.json."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        if trust_remote_code and "auto_map" in config:
            return AutoConfig.from_pretrained(folder, trust_remote_code=True)
        fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
        # as transformers reads config.json: floats JSON cannot hold ({"__float__": "Infinity"}) decoded
        return AutoConfig.for_model(config["model_type"], **PretrainedConfig._decode_special_floats(fields))
    except (ValueError, KeyError, OSError) as e:
        import transformers

        raise HFConfigError(f"transformers {transformers.__version__} cannot read config.json of model_type "
                            f"{config['model_type']} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _causal_lm_class(hf_config) -> type[nn.Module]:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError:
        raise HFConfigError(f"transformers has no causal language model for model_type {hf_config.model_type}") from None


def build(args: HFModelArgs) -> nn.Module:
    """The transformers causal LM of `args` on the current default device (meta included), in
    float32, with `args` as its `.args`."""
    from transformers import AutoModelForCausalLM

    hf_config = _transformers_config(args.config, args.trust_remote_code, args.folder)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, trust_remote_code=args.trust_remote_code)
    model.args = args
    return model


def forward(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None = None,
            document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a transformers causal LM. Packed documents are told apart by their positions, which
    restart at each document (transformers' packed-sequence mask); document_ids add nothing. For a
    family whose code builds its masks without the positions (`_MASKS_WITHOUT_POSITIONS`), the masks
    are built from them here and handed in by layer type (`_packed_masks`)."""
    if positions is not None and positions.ndim == 1:
        positions = positions.expand(inputs.shape[0], -1)
    if positions is None or model.config.model_type not in _MASKS_WITHOUT_POSITIONS:
        return model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    hook = model.get_decoder().register_forward_pre_hook(_packed_masks, with_kwargs=True)
    try:
        return model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    finally:
        hook.remove()


# Families whose transformers code builds its attention masks without the positions, so without the
# packed-sequence mask: their decoder accepts the masks by layer type instead (`attention_mask` a dict).
_MASKS_WITHOUT_POSITIONS = ("gpt_oss",)


def _packed_masks(decoder: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pre-hook of the decoder: its embeddings computed here (inside the whole model's call, so under
    FSDP and tp as there), and each layer type's mask built from them and the positions by
    transformers' own mask functions (block-diagonal causal, windowed for sliding layers)."""
    from transformers.masking_utils import create_masks_for_generate

    embeds = decoder.get_input_embeddings()(kwargs.pop("input_ids"))
    masks = create_masks_for_generate(decoder.config, embeds, attention_mask=None, cache=None,
                                      position_ids=kwargs["position_ids"])
    return args, kwargs | {"inputs_embeds": embeds, "attention_mask": masks}


# A linear-attention layer carries its state across a document's end: transformers' torch path (its
# chunked gated delta rule and causal convolution) takes no document boundaries. Measured: a packed
# row's later documents get other logits than each alone (tests/recipe/test_hf_backend.py).


def packed_documents_refusal(args: HFModelArgs) -> str | None:
    """Why documents packed into one row (positions restarting at each) would see each other in this
    model; None where transformers' packed-sequence mask keeps them apart."""
    if "linear_attention" in (args.config.get("layer_types") or ()):
        return f"{args.model_type}'s linear-attention layers carry their state from one document into the next"
    if _sequence_convolution(args):
        return (f"{args.model_type}'s layers mix tokens along the sequence outside attention (a causal convolution, "
                f"{_sequence_convolution(args)}), across a document's end")
    return None


@functools.lru_cache(maxsize=8)
def _meta_model(args: HFModelArgs) -> nn.Module:
    """The model on the meta device, built once per args for what is read off its shape (counts,
    experts, names, convolutions); never changed: the recipe builds its own to transform."""
    with torch.device("meta"):
        return build(args)


@functools.lru_cache(maxsize=8)
def _sequence_convolution(args: HFModelArgs) -> str | None:
    """The first convolution along the sequence in the model on meta (the `conv1d` of a Mamba,
    gated-delta or short-convolution layer: Granite 4 hybrid, Bamba, LFM2, ...); None where there is none."""
    model = _meta_model(args)
    return next((name for name, m in model.named_modules() if isinstance(m, nn.Conv1d) and m.kernel_size[0] > 1), None)


def uncommon_attention(args: HFModelArgs) -> str | None:
    """What, in this model's attention, one plain causal mask over the whole sequence does not
    compute (sliding windows, sinks, linear attention, convolutions along the sequence), as context
    parallelism's core and a pipeline stage (parallelisms/cp.py, hf_stages.py) give every layer; None
    where every layer is plain causal softmax attention."""
    config = args.config
    layer_types = set(config.get("layer_types") or ())
    if "linear_attention" in layer_types:
        return "its linear-attention layers run a recurrence along the sequence"
    if _sequence_convolution(args):
        return f"its layers mix tokens along the sequence outside attention ({_sequence_convolution(args)})"
    if args.model_type in _ATTENTION_SINKS:
        return "its attention adds learned sinks to the softmax"
    if config.get("sliding_window") or layer_types - {"full_attention"}:
        return f"its attention has sliding-window layers (sliding_window {config.get('sliding_window')})"
    return None


_ATTENTION_SINKS = ("gpt_oss",)


def peft_refusal(args: HFModelArgs, adapted: list[str]) -> str | None:
    """PEFT (0.21, with transformers 5) reads the adapters of a family whose experts transformers stacks
    on load by the experts' old names: an adapter on a linear of that name (`gate_proj` of a shared
    expert or a dense layer) would be loaded as the routed experts', so it is refused."""
    names = converted_names(args.model_type, args.architecture)
    fused = {source.rsplit(".", 2)[-2] for stack in (names.stacks if names else ()) for source in stack.sources}
    clash = [name for name in adapted if name.rsplit(".", 1)[-1] in fused]
    if not clash:
        return None
    return (f"PEFT reads a {args.model_type} adapter's {'/'.join(sorted(fused))} as its stacked experts', so the "
            f"adapter on {clash[0]} would not load there; set lora.target_modules to the attention's linears")


def hf_config(args: HFModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """config.json: the folder's own (a multimodal folder's whole), its dtype that of the export."""
    name = str(dtype).removeprefix("torch.")
    config = {k: v for k, v in args.folder_config.items() if k not in _DTYPE_KEYS}
    if isinstance(config.get("text_config"), dict):  # the text model's tensors are the export's dtype too
        text = config["text_config"]
        config["text_config"] = {k: name if k in _DTYPE_KEYS else v for k, v in text.items()}
    return config | {"dtype": name}


def architecture_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Every field of config.json but its dtype and the version that wrote it."""
    return {k: v for k, v in config.items() if k not in (*_DTYPE_KEYS, "transformers_version")}


class SameNames:
    """`HFNames` where weft's names are transformers' (models/common/hf_names.py): every tensor its own,
    under its own name, rows as they are."""

    def to_hf(self, name: str) -> str:
        return name

    def to_weft(self, hf_name: str) -> str:
        return hf_name

    def hf_parts(self, name: str, count: int) -> list[str]:
        return [name]

    def stacked(self, name: str) -> bool:
        return False

    def groups(self, weft_names) -> dict[str, list[str]]:
        return {name: [name] for name in weft_names}

    def to_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor

    def from_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor


@functools.lru_cache(maxsize=8)
def _meta_counts(args: HFModelArgs) -> tuple[int, int, int]:
    """(parameters of the blocks, their linears' inputs + outputs, those of the blocks' linears),
    from the model on meta: per block, averaged."""
    model = _meta_model(args)
    blocks = _blocks(model)
    numel = sum(p.numel() for block in blocks for p in block.parameters())
    widths = sum(m.in_features + m.out_features for block in blocks for m in block.modules() if isinstance(m, nn.Linear))
    return numel // len(blocks), widths // len(blocks), len(blocks)


@functools.lru_cache(maxsize=8)
def _meta_experts(args: HFModelArgs) -> tuple[int, int, int, str | None]:
    """(routed experts per MoE layer, their hidden width, MoE layers, why weft's grouped experts cannot
    take their place or None), from the model on meta."""
    model = _meta_model(args)
    found = routed_experts(model)
    refusal = grouped_experts_refusal(model)
    names = converted_names(args.model_type, args.architecture)
    if found and refusal is None and (names is None or not names.holds_grouped_experts()):
        refusal = "its folder does not hold its experts one tensor per expert (gate, up and down)"
    if not found:
        return 0, 0, 0, "it has no routed experts"
    experts, rows, _ = found[0][1].gate_up_proj.shape
    return experts, rows // 2, len(found), refusal


@functools.lru_cache(maxsize=8)
def _meta_matmul_numel(args: HFModelArgs) -> float:
    """Weights a token multiplies by, from the model on meta: every parameter of two or more
    dimensions but the token embedding (a lookup; counted once more where the output projection is
    tied to it), the routed experts' at the share of them a token is sent to (top_k of n)."""
    model = _meta_model(args)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    routed = {id(p): module for _, module in routed_experts(model) for p in module.parameters(recurse=False)}
    top_k = _top_k(args.config) or 0
    numel = 0.0
    for p in model.parameters():
        if p.ndim < 2 or id(p) in embeddings:
            continue
        numel += p.numel() * (top_k / p.shape[0] if id(p) in routed else 1)
    return numel + (args.vocab_size * args.dim if args.tie_embeddings else 0)


# The config.json key of the experts a token is sent to, family by family (the first one present).
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")


def _top_k(config: dict[str, Any]) -> int | None:
    """How many routed experts each token is sent to (Kimi Linear's num_experts_per_token, Hunyuan's
    moe_topk, ERNIE 4.5's moe_k, ...); None where config.json names none."""
    return next((config[key] for key in _TOP_K_KEYS if isinstance(config.get(key), int)), None)


def flops_per_token(args: HFModelArgs, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token of the built model (forward and backward): 6 x the weights a token
    multiplies by (`_meta_matmul_numel`; n_params, the parameter count, is not used) plus attention's
    score and value products, 6 x H x (Q_k + Q_v) x T in each softmax-attention layer (its H heads of
    key width Q_k, value width Q_v; MLA's differ; a layer's own head_dim where per_layer_config sets
    one, as Gemma 4's global layers), the whole sequence T as the mask-taking kernels compute it; a
    linear-attention layer's recurrence is left out."""
    config = args.config
    hf_config = _transformers_config(config, args.trust_remote_code, args.folder)
    q_k = _attribute(hf_config, "qk_head_dim") or args.head_dim
    q_v = _attribute(hf_config, "v_head_dim") or args.head_dim
    layers = config.get("layer_types") or ["full_attention"] * args.n_layers
    own = {int(i): fields["head_dim"] for i, fields in (config.get("per_layer_config") or {}).items()
           if isinstance(fields, dict) and isinstance(fields.get("head_dim"), int)}
    widths = sum(2 * own[i] if i in own else q_k + q_v for i, kind in enumerate(layers) if kind != "linear_attention")
    return 6 * _meta_matmul_numel(args) + 6 * args.n_heads * widths * seq_len


def experts(args: HFModelArgs) -> Experts | None:
    """The routing of a model whose experts weft's grouped experts can compute (`experts_refusal`);
    None for any other (dense, or experts of another arithmetic, such as gpt-oss's)."""
    n_experts, hidden, moe_layers, refusal = _meta_experts(args)
    top_k = _top_k(args.config)
    if refusal is not None or not isinstance(top_k, int):
        return None
    return Experts(n_experts, top_k, moe_layers * top_k * hidden // args.n_layers, moe_layers * top_k / args.n_layers)


def experts_refusal(args: HFModelArgs) -> str | None:
    """Why expert parallelism cannot spread this model's experts: weft's grouped experts (which it
    spreads) compute plain SwiGLU experts only (experts.py); None where they can."""
    return _meta_experts(args)[3]


def prepare_expert_parallel(model: nn.Module) -> None:
    """Swap the model's routed experts for weft's where weft computes them: plain SwiGLU ones, which
    `apply_ep` spreads and `apply_tp` splits by expert (its `moe_tp_experts` style), and gpt-oss's,
    which take LoRA's adapters. Others stay transformers' (expert parallelism and LoRA on experts
    refuse them before the model is built)."""
    if clamped_experts(model) or grouped_experts_refusal(model) is None:
        swap_in_grouped_experts(model)


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise HFConfigError(f"{type(model).__name__} has no model.layers, the decoder blocks weft looks for")
    return list(layers)


def block_numel(args: HFModelArgs) -> int:
    return _meta_counts(args)[0]


def lora_block_numel(args: HFModelArgs, rank: int) -> int:
    """Adapters of one block with LoRA on every linear of it (the default targets)."""
    return rank * _meta_counts(args)[1]


def _unsupported(model, **_) -> Any:
    raise NotImplementedError("the transformers backend's own plans are the model's (parallelisms/tp.py, hf_stages.py)")


class _NoWeftModel(nn.Module):
    """No module is one: `spec_for_model` leaves a transformers model to the parallelisms' own paths
    for transformers models (its `_tp_plan`, its pipeline stage, its `_init_weights`)."""


TRANSFORMERS_HF = HFMapping(model_types=(), names=SameNames(), hf_config=hf_config,
                            args_from_hf_config=args_from_hf_config, architecture_fields=architecture_fields,
                            tied_output="lm_head.weight")


@functools.lru_cache(maxsize=8)
def hf_mapping(args: HFModelArgs) -> HFMapping:
    """The folder's names: the parameters' own, or where transformers converts the folder on load
    (per-expert tensors stacked), the folder's (conversions.py); in a multimodal folder, the text
    model's tensors under the folder's names (multimodal.py); and where LoRA can adapt the routed
    experts, PEFT's names of them (`_expert_parameters`)."""
    if args.multimodal:
        model = _meta_model(args)
        decoder = type(getattr(model, model.base_model_prefix))
        names = multimodal_names(args.config_json, args.folder, decoder, model.base_model_prefix,
                                 frozenset(model.state_dict(keep_vars=True)))
        return dataclasses.replace(TRANSFORMERS_HF, names=names)
    names = converted_names(args.model_type, args.architecture)
    mapping = TRANSFORMERS_HF if names is None else dataclasses.replace(TRANSFORMERS_HF, names=names)
    if args.output_weight != mapping.tied_output:
        mapping = dataclasses.replace(mapping, tied_output=args.output_weight)
    experts = _expert_parameters(args)
    return mapping if experts is None else dataclasses.replace(mapping, expert_parameters=experts)


@functools.lru_cache(maxsize=8)
def expert_adapters_refusal(args: HFModelArgs) -> str | None:
    """Why LoRA cannot adapt this model's routed experts: its adapters go on weft's experts in
    transformers' place (experts.py), which compute plain SwiGLU experts (`experts_refusal`) and
    gpt-oss's; None where they can."""
    model = _meta_model(args)
    return None if clamped_experts(model) else experts_refusal(args)


@functools.lru_cache(maxsize=8)
def _expert_parameters(args: HFModelArgs) -> ExpertParameters | None:
    """The routed experts' parameters as PEFT's `target_parameters` name them (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`), each LoRA adapter of weft's experts in transformers' place one
    adapter of that parameter (scaling x B_e A_e added to expert e's matrix as it is held, which
    PEFT writes transposed where the module uses it as x @ W); None where no adapters can go on
    them (`expert_adapters_refusal`)."""
    if expert_adapters_refusal(args) is not None:
        return None
    model = _meta_model(args)
    found = routed_experts(model)
    patterns = {re.sub(r"\.layers\.\d+\.", ".layers.{layer}.", name) for name, _ in found}
    # PEFT lays its factors out by how the module uses the weight: [experts, in, out] (x @ W) where
    # transformers marks it is_transposed (gpt-oss), [experts, out, in] otherwise
    x_at_w = any(getattr(module, "is_transposed", False) for _, module in found)
    return ExpertParameters({f"{p}.{w}": f"{p}.{w}" for p in sorted(patterns)
                             for w in TransformersRoutedExperts.stacked_weights}, x_at_w=x_at_w)


TRANSFORMERS_SPEC = ModelSpec(
    name="transformers", flavors={}, args_type=HFModelArgs, model_type=_NoWeftModel, build=build,
    tp_plan=_unsupported, pipeline_units=_unsupported, hf=TRANSFORMERS_HF, flops_per_token=flops_per_token,
    block_numel=block_numel, lora_block_numel=lora_block_numel,
    backend=BACKEND, forward=forward,
    packed_documents_refusal=packed_documents_refusal, hf_for_args=hf_mapping, peft_refusal=peft_refusal,
    experts=experts, prepare_expert_parallel=prepare_expert_parallel, expert_parallel_refusal=experts_refusal,
    count_routing=count_routed_tokens)
