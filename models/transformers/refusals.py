"""What the transformers backend cannot train, and why: packed documents a model would let see each
other, attention a plain causal mask does not compute, adapters PEFT would load elsewhere, experts
weft's grouped experts do not compute, and the layouts and transforms that follow (`layout_refusal`).
Each answers one line (None where it can); the plan raises it naming the key."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from weft.models.transformers.args import HFModelArgs
from weft.models.transformers.conversions import converted_names
from weft.models.transformers.counts import experts, meta_experts
from weft.models.transformers.experts import clamped_experts
from weft.models.transformers.model import meta_model

_ATTENTION_SINKS = ("gpt_oss",)

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
def _sequence_convolution(args: HFModelArgs) -> str | None:
    """The first convolution along the sequence in the model on meta (the `conv1d` of a Mamba,
    gated-delta or short-convolution layer: Granite 4 hybrid, Bamba, LFM2, ...); None where there is none."""
    model = meta_model(args)
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


def experts_refusal(args: HFModelArgs) -> str | None:
    """Why expert parallelism cannot spread this model's experts: weft's grouped experts (which it
    spreads) compute plain SwiGLU experts only (experts.py); None where they can."""
    return meta_experts(args)[3]


@functools.lru_cache(maxsize=8)
def expert_adapters_refusal(args: HFModelArgs) -> str | None:
    """Why LoRA cannot adapt this model's routed experts: its adapters go on weft's experts in
    transformers' place (experts.py), which compute plain SwiGLU experts (`experts_refusal`) and
    gpt-oss's; None where they can."""
    model = meta_model(args)
    return None if clamped_experts(model) else experts_refusal(args)


def layout_refusal(cfg: Any, args: HFModelArgs, dims: Any, *, adapts_experts: bool,
                   tp_plan_refusal: Callable[[], str | None]) -> str | None:
    """Why the run's layout (`dims`) and transforms (`cfg`, the run's config) cannot train this model,
    naming the key first: context parallelism and pipeline stages of a model whose attention is not
    plain causal (`uncommon_attention`), context parallelism of packed rows (`_cp_refusal`); expert
    parallelism of experts other than plain SwiGLU ones, adapters on them (`adapts_experts`:
    `_expert_lora_refusal`); tensor parallelism of a model that declares no plan (`_tp_plan`) or one
    apply_tp cannot translate (`tp_plan_refusal`, asked last); weft's MoE balancing, which
    transformers' routers do not take. compile and float8 go through as for weft's models (the head
    kept by the plan's float8 filter)."""
    built = f"{args.architecture} (model_type {args.model_type}, built by transformers)"
    if dims.cp > 1 and (refusal := _cp_refusal(cfg, args, built, dims.cp)) is not None:
        return refusal
    if dims.pp > 1 and (what := uncommon_attention(args)) is not None:
        return (f"parallelism.pp = {dims.pp}: {built}: {what}, and its pipeline stage "
                "(parallelisms/hf_stages.py) gives every layer one plain causal mask; set parallelism.pp = 1")
    if dims.ep > 1 and (refusal := experts_refusal(args)) is not None:
        return (f"parallelism.ep = {dims.ep}: {built}: {refusal}, and expert parallelism spreads weft's "
                "grouped experts, which compute plain SwiGLU experts; set parallelism.ep = 1")
    if adapts_experts and (refusal := _expert_lora_refusal(cfg, args, built, dims.tp)) is not None:
        return refusal
    for key, value in (("moe.bias_update_rate", cfg.moe.bias_update_rate),
                       ("moe.load_balance_coeff", cfg.moe.load_balance_coeff)):
        if value:
            return (f"{key} = {value}: {built} routes by transformers' own arithmetic, which weft's "
                    "balancing (a routing bias, a load-balancing loss) does not reach; set it to 0")
    if dims.tp > 1 and not args.declares_tp_plan:
        return f"parallelism.tp = {dims.tp}: {built} declares no tensor-parallel plan (_tp_plan); set parallelism.tp = 1"
    split_experts = dims.tp > 1 and experts(args) is not None  # by expert (parallelisms/tp.py)
    if split_experts and dims.ep > 1:
        return (f"parallelism.tp = {dims.tp} with parallelism.ep = {dims.ep}: {built} keeps every token on "
                "each tp rank (no sequence parallelism), and tensor parallelism splits its experts by expert "
                "itself; set parallelism.ep = 1 or parallelism.tp = 1")
    if split_experts and cfg.compile.enable:
        return (f"compile.enable = true with parallelism.tp = {dims.tp}: {built} splits its experts by "
                "expert, each rank's share of the tokens cut on the host, which compile cannot trace; set "
                "compile.enable = false")
    if dims.tp > 1 and (refusal := tp_plan_refusal()) is not None:
        return f"parallelism.tp = {dims.tp}: {refusal}"
    return None


def _expert_lora_refusal(cfg: Any, args: HFModelArgs, built: str, tp: int) -> str | None:
    """LoRA on the routed experts: the adapters go on weft's experts in transformers' place
    (model.py: `prepare_expert_parallel`), so only where those compute the family's experts, and
    not yet under tensor parallelism (its plan for the stacked experts splits no adapters)."""
    key = f"lora.target_modules = {list(cfg.lora.target_modules)}"
    if (refusal := expert_adapters_refusal(args)) is not None:
        return (f"{key}: {built}: {refusal}, and adapters of routed experts go on weft's experts in "
                "their place, which compute plain SwiGLU experts and gpt-oss's; target its linears")
    if tp > 1:
        return (f"{key}: adapters of {built}'s routed experts are not split by tensor parallelism yet; "
                "set parallelism.tp = 1 (parallelism.ep spreads them) or target its linears")
    return None


def _cp_refusal(cfg: Any, args: HFModelArgs, built: str, cp: int) -> str | None:
    """Context parallelism: the model's attention layers dispatch to weft's core (parallelisms/cp.py),
    plain causal over the sequence's global positions, so the model must have only plain causal
    attention and the rows no packed documents (which that core would let see each other)."""
    what = uncommon_attention(args)
    if what is None and args.config.get("attn_logit_softcapping"):
        what = "its attention caps its logits (attn_logit_softcapping)"
    if what is not None:
        return (f"parallelism.cp = {cp}: {built}: {what}, and the context-parallel core computes plain "
                "causal attention over the whole sequence; set parallelism.cp = 1")
    formats = {"data.format": cfg.data.format, "validation.format": cfg.validation.format or cfg.data.format}
    for key, value in formats.items():
        if value in ("chat", "prompt_completion") and (key == "data.format" or cfg.validation.enable):
            return (f"parallelism.cp = {cp}: {key} = {value} packs samples into rows, and the "
                    f"context-parallel core of {built} does not keep them apart; train it on "
                    "data.format = text without data.document_masking, or set parallelism.cp = 1")
    if cfg.data.document_masking:
        return (f"parallelism.cp = {cp}: data.document_masking = true: the context-parallel core of {built} "
                "does not keep packed documents apart; set it to false, or set parallelism.cp = 1")
    return None
