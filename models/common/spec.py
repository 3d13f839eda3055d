"""What the rest of weft needs from a model family, declared once per model folder.

`parallelisms/`, `components/`, `float8/` and `recipe/` never import a model folder: they look
its `ModelSpec` up in the registry of `weft.models` (by flavor, by model, by its hyper-parameters
or by a Hugging Face config.json) and read what they need from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from weft.models.common import head, kv_cache
from weft.models.common.hf_names import ExpertParameters, HFNames


class HFConfigError(ValueError):
    """A config.json a weft model cannot represent; the message names the field and its value."""


@dataclass(frozen=True)
class HFMapping:
    """How a weft model and its Hugging Face checkpoint translate into each other: names and the
    rotary row order from the family's name table (`HFNames`, models/common/hf_names.py), config.json
    from its functions, and where its tensors are laid out otherwise (Llama 4's experts) its own
    join and split. A family builds it with `models.common.hf_config.hf_mapping`."""

    model_types: tuple[str, ...]  # config.json model_type values this model reads
    names: HFNames  # weft <-> HF names, which weft parameters make each HF tensor, rotary rows
    hf_config: Callable[[Any, torch.dtype], dict[str, Any]]  # args, dtype -> config.json
    # config.json (trust_remote_code=, folder=: where the transformers backend may run a folder's own code)
    # -> args (HFConfigError if not)
    args_from_hf_config: Callable[..., Any]
    architecture_fields: Callable[[dict[str, Any]], dict[str, Any]]  # the config.json fields deciding the function
    # weft names of a group (`groups`), their tensors (rotary rows already in HF's order), args -> the
    # HF tensor (Llama 4: experts transposed, w1 and w3 joined). None: the group's one tensor as it is.
    join: Callable[[list[str], list[torch.Tensor], Any], torch.Tensor] | None = None
    # weft name, the HF tensor, args -> the weft parameter's part of it, before the rotary rows. None: all of it.
    split: Callable[[str, torch.Tensor, Any], torch.Tensor] | None = None
    hf_shape: Callable[[str, torch.Size], list[int]] | None = None  # weft name, its shape -> the HF tensor's
    weight_prefix: Callable[[dict[str, Any]], str] | None = None  # config.json -> what precedes tensor names
    # transformers' in-memory expert parameters, which PEFT's target_parameters adapt; None: no routed experts
    expert_parameters: ExpertParameters | None = None
    tied_output: str = "output.weight"  # the parameter a tied model writes no tensor of (the token embedding's)
    # config.json -> HFConfigError where a folder of it cannot be loaded into the model; None: where
    # args_from_hf_config refuses it (the transformers backend's compares every field instead)
    config_check: Callable[[dict[str, Any]], None] | None = None

    def check_config(self, config: dict[str, Any]) -> None:
        """Refuse (HFConfigError) a folder's config.json whose weights the model cannot take."""
        if self.config_check is None:
            self.args_from_hf_config(config)
        else:
            self.config_check(config)

    def weft_to_hf_name(self, name: str) -> str:
        """A weft parameter's Hugging Face tensor name (ValueError for one it has no place for)."""
        return self.names.to_hf(name)

    def weft_to_peft_name(self, name: str) -> str:
        """A weft parameter's name in the Hugging Face model in memory, as PEFT names its modules: the
        folder's name, but for names transformers changes on load (a multimodal folder's text model)."""
        to_peft = getattr(self.names, "to_peft", None)
        return self.weft_to_hf_name(name) if to_peft is None else to_peft(name)

    def carried(self) -> dict[str, Any]:
        """The folder's tensors that are not the model's, each with its file: an export copies them
        unchanged from the source (a multimodal folder's vision tower and projector); {} for most."""
        return dict(getattr(self.names, "carried", {}))

    def hf_to_weft_name(self, name: str) -> str:
        """A Hugging Face tensor's weft parameter name (ValueError for one weft has no place for)."""
        return self.names.to_weft(name)

    def groups(self, weft_names: Iterable[str]) -> dict[str, list[str]]:
        """Each HF tensor's name -> the weft parameters it is made of."""
        return self.names.groups(weft_names)

    def units(self, shapes: Mapping[str, torch.Size]) -> list[tuple[list[str], list[str]]]:
        """(weft parameters, the HF tensors they make) for the weft tensors of `shapes` (name ->
        shape) that Hugging Face holds: several parameters joined into one tensor (`groups`), or one
        stacked parameter held as one tensor per expert (Qwen3-MoE: `hf_parts`), or one and one."""
        return [(group, self.hf_parts(group[0], shapes[group[0]]) if len(group) == 1 else [hf_name])
                for hf_name, group in self.groups(shapes).items()]

    def stacked(self, weft_name: str) -> bool:
        """Whether the weft parameter is held in Hugging Face as one tensor per expert."""
        return self.names.stacked(weft_name)

    def hf_parts(self, weft_name: str, shape: torch.Size) -> list[str]:
        """The HF tensors holding the weft parameter of this shape: one per expert where it is
        `stacked`, else its one tensor."""
        return self.names.hf_parts(weft_name, shape[0] if self.stacked(weft_name) else 1)

    def to_hf(self, weft_names: list[str], tensors: list[torch.Tensor], args: Any) -> torch.Tensor:
        """The HF tensor made of these weft parameters (a group of `groups`)."""
        tensors = [self.names.to_hf_tensor(name, tensor, args) for name, tensor in zip(weft_names, tensors)]
        if self.join is not None:
            return self.join(weft_names, tensors, args)
        (tensor,) = tensors
        return tensor

    def to_hf_parts(self, weft_names: list[str], tensors: list[torch.Tensor], args: Any) -> list[torch.Tensor]:
        """The HF tensors of a unit (`units`): the one `to_hf` makes, or a stacked parameter's experts."""
        tensor = self.to_hf(weft_names, tensors, args)
        if not self.stacked(weft_names[0]):
            # one tensor, or several joined along its first dimension in equal parts (Kimi Linear's conv1d)
            count = len(self.hf_parts(weft_names[0], tensor.shape)) if len(weft_names) == 1 else 1
            return [tensor] if count == 1 else [part.clone() for part in tensor.chunk(count)]
        # An expert's tensors (several where they join along its rows, transformers' gate_up_proj), each
        # its own copy: safetensors refuses to write tensors that share memory.
        per_expert = len(self.hf_parts(weft_names[0], tensor.shape)) // tensor.shape[0]
        return [part.clone() for expert in tensor.unbind(0) for part in expert.chunk(per_expert)]

    def from_hf_tensor(self, weft_name: str, tensor: torch.Tensor, args: Any) -> torch.Tensor:
        """The weft parameter `weft_name` out of its HF tensor."""
        tensor = tensor if self.split is None else self.split(weft_name, tensor, args)
        return self.names.from_hf_tensor(weft_name, tensor, args)

    def shape(self, weft_name: str, shape: torch.Size) -> list[int]:
        """The shape of the HF tensor a weft parameter of `shape` is read from."""
        return list(shape) if self.hf_shape is None else self.hf_shape(weft_name, shape)

    def prefix(self, config: dict[str, Any]) -> str:
        """What precedes the model's tensor names in a folder with this config.json."""
        return "" if self.weight_prefix is None else self.weight_prefix(config)


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's routing, as the plan, the dry run and the memory estimate read it."""

    n_experts: int  # routed experts of each MoE layer
    top_k: int  # experts each token is sent to
    routed_hidden_dim: int  # the routed experts' part of args.ffn_hidden_dim (follows the routing, not the token)
    routed_slots: float  # expert slots one token fills in a block, averaged over the layers


def dense(args: Any) -> Experts | None:
    """`ModelSpec.experts` of a family without experts."""
    return None


def no_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`Backend.folder_buffers` of weft's models: their buffers (rotary tables, an MoE's balancing
    state) are their own, in no Hugging Face folder."""
    return []


def built_by_weft(spec: ModelSpec, args: Any, model: nn.Module) -> str:
    """`Backend.describe` of weft's models: its family."""
    return f"built by weft ({spec.name})"


@dataclass(frozen=True)
class Decoding:
    """How a model generates with a KV cache (weft.generation): prompts of a batch are left-padded to
    the longest, positions count from each row's first real token."""

    start: Callable[[nn.Module, int, int], Any]  # (model, batch, max_len) -> the cache it installs for `batch` rows
    # (model, tokens [b, s], positions [b, s], valid [b, s] bool, cache) -> logits [b, vocab] at each row's
    # last token; the s tokens appended to the cache; valid False: left padding or a stopped row's token,
    # never attended to
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
    finish: Callable[[nn.Module, Any], None]  # (model, cache): what start installed removed, the model as before
    # (args, batch, max_len, element_size) -> bytes of the cache start makes (the dry run's line); None: unknown ahead
    cache_bytes: Callable[[Any, int, int, int], int] | None = None


WEFT_DECODING = Decoding(start=kv_cache.start, forward=kv_cache.forward, finish=kv_cache.finish,
                         cache_bytes=kv_cache.cache_bytes)


@dataclass(frozen=True)
class Backend:
    """Whose code builds and runs a family's model, and what follows from it: how the model is
    called, which of its buffers a Hugging Face folder holds (read on load, written on export), how
    the start-up line names it, who counts its routed tokens. Weft's own modules by default; the
    transformers backend (models/transformers) gives its own."""

    name: str = "weft"  # the model.backend value that picks this code (models.spec_for_hf_config)
    # (model, inputs, positions, document_ids) -> logits; None: model(inputs, positions, document_ids=...)
    forward: Callable[..., torch.Tensor] | None = None
    # (model, inputs, positions, document_ids, use) -> use(final hidden states, rows -> logits): a loss that
    # projects them chunk by chunk (models/common/head.py; transformers': its logits where it must)
    forward_head: Callable[..., Any] = head.forward_head
    folder_buffers: Callable[[nn.Module], list[tuple[str, torch.Tensor]]] = no_buffers  # model -> (name, buffer)
    describe: Callable[[Any, Any, nn.Module], str] = built_by_weft  # (spec, args, whole model) -> "built by ..."
    # (materialized model, device) -> its routers count the tokens each expert gets (`tokens_per_expert`,
    # for the routing metrics: transformers' MoE models); None: its MoE layers count them themselves
    count_routing: Callable[[nn.Module, Any], None] | None = None
    decoding: Decoding = WEFT_DECODING  # how the model generates with a KV cache (weft.generation)


@dataclass(frozen=True)
class Refusals:
    """What a family cannot train, each asked of the model's args and answered with why (one line)
    or None: the plan raises each as a ConfigError naming the key."""

    # (args, names of the linears holding adapters) -> why PEFT cannot load such an adapter onto the
    # transformers model (its loader reads some names otherwise: Qwen3-MoE)
    peft: Callable[[Any, list[str]], str | None] | None = None
    # args -> why documents packed into one row would see each other in this model
    packed_documents: Callable[[Any], str | None] | None = None
    # (cfg, args, dims, adapts_experts=, tp_plan_refusal=) -> why the run's layout and transforms cannot
    # train this model, naming the key first (the transformers backend's: models/transformers/refusals.py)
    layout: Callable[..., str | None] | None = None


@dataclass(frozen=True, eq=False)  # one object per family: hashed and compared by identity
class ModelSpec:
    """A model family: its flavors, how to build it, and how each transform reads it."""

    name: str
    flavors: Mapping[str, Any]  # flavor name -> hyper-parameters (the family's ModelArgs)
    args_type: type  # the family's ModelArgs class
    model_type: type[nn.Module]  # the class `build` returns (stages and wrappers keep it)
    build: Callable[[Any], nn.Module]  # args -> model, on the current default device (meta included)
    # (model, loss_parallel, float8_linears) -> {module path: ParallelStyle}, the tensor-parallel plan
    tp_plan: Callable[..., dict]
    pipeline_units: Callable[[nn.Module], list[list[str]]]  # modules a pipeline split may not cut, in order
    hf: HFMapping
    flops_per_token: Callable[[Any, int, int], float]  # args, parameters in use, seq_len -> training FLOPs
    block_numel: Callable[[Any], int]  # args -> parameters of one block (memory estimates)
    lora_block_numel: Callable[[Any, int], int]  # args, LoRA rank -> adapter parameters of one block
    experts: Callable[[Any], Experts | None] = dense  # args -> its experts and routing; None: a dense model
    active_parameters: Callable[[nn.Module], int] | None = None  # model -> parameters one token uses; None: all
    refusals: Refusals = Refusals()  # what the family cannot train, and why
    backend: Backend = Backend()  # whose code builds and runs the model
    # args -> the HFMapping of this model where it depends on the model (transformers' families whose
    # folders it converts on load); None: `hf` for every model of the family
    hf_for_args: Callable[[Any], HFMapping] | None = None
    # model on meta -> made ready for apply_ep and apply_tp (transformers' experts swapped for weft's grouped
    # ones where plain); None: as built
    prepare_expert_parallel: Callable[[nn.Module], None] | None = None
    # (args, layer) -> the chunk of positions the layer's attention stays within (Llama 4's rotary
    # layers), read by the KV cache; None: no layer attends by chunks
    attention_chunk: Callable[[Any, int], int | None] | None = None

    def hf_of(self, args: Any) -> HFMapping:
        """How the model `args` and its Hugging Face folder translate into each other."""
        return self.hf if self.hf_for_args is None else self.hf_for_args(args)

    def built_by(self, args: Any, model: nn.Module) -> str:
        """Whose code built the model `args` (the whole `model`), for the start-up line."""
        return self.backend.describe(self, args, model)
