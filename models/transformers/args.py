"""A Hugging Face folder's config.json as the transformers backend reads it: `HFModelArgs` (the
config itself plus the shape fields the recipe reads), refused in one line naming the field where
transformers cannot build a causal LM of it; transformers' config object of it
(`transformers_config`), and the few fields read family by family (`config_top_k`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from weft.layers.torchao_import import quiet_torchao_import
from weft.models.common.spec import HFConfigError
from weft.models.transformers.conversions import converted_names
from weft.models.transformers.family_refusals import refuse_family
from weft.models.transformers.multimodal import multimodal_class


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
    hf_config = transformers_config(config, trust_remote_code, folder)
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
        kv_heads=attribute(hf_config, "num_key_value_heads") or n_heads,
        head_dim=attribute(hf_config, "head_dim") or dim // n_heads,
        ffn_hidden_dim=attribute(hf_config, "intermediate_size") or 4 * dim,
        vocab_size=_field(hf_config, "vocab_size"),
        max_seq_len=attribute(hf_config, "max_position_embeddings") or 2**31 - 1,
        tie_embeddings=tied,
        declares_tp_plan=bool(attribute(hf_config, "base_model_tp_plan")),
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
    flagged = bool(attribute(hf_config, "tie_word_embeddings"))
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


def attribute(hf_config, name: str) -> Any:
    """A config attribute, None where it is missing; where it varies by layer (Gemma 4's head_dim, which
    transformers refuses to read as one value: AmbiguousGlobalPerLayerAttributeError, a RuntimeError),
    its global value."""
    try:
        return getattr(hf_config, name, None)
    except RuntimeError:
        return vars(hf_config).get(name)


def _field(hf_config, name: str) -> int:
    value = attribute(hf_config, name)
    if not isinstance(value, int):
        raise HFConfigError(f"config.json of model_type {hf_config.model_type} has no integer {name}")
    return value


def transformers_config(config: dict[str, Any], trust_remote_code: bool, folder: str):
    """transformers' config object of a config.json."""
    with quiet_torchao_import():  # the backend's first use of transformers: its quantizers import torchao
        from transformers import AutoConfig, PretrainedConfig, modeling_utils  # noqa: F401

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


# The config.json key of the experts a token is sent to, family by family (the first one present).
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")


def config_top_k(config: dict[str, Any]) -> int | None:
    """How many routed experts each token is sent to (Kimi Linear's num_experts_per_token, Hunyuan's
    moe_topk, ERNIE 4.5's moe_k, ...); None where config.json names none."""
    return next((config[key] for key in _TOP_K_KEYS if isinstance(config.get(key), int)), None)
