"""What the transformers backend (models/transformers) does not reach, refused in one line naming the key."""

from __future__ import annotations

from weft.components.config import ConfigError, JobConfig
from weft.models import ModelSpec
from weft.models.transformers.spec import expert_adapters_refusal, uncommon_attention
from weft.parallelisms.lora import names_routed_experts
from weft.parallelisms.parallel_dims import ParallelDims
from weft.recipe.checks.experts import tp_plan_refusal


def check_backend(cfg: JobConfig, spec: ModelSpec, args, dims: ParallelDims) -> None:
    """What the transformers backend (models/transformers) does not reach, refused in one line naming
    the key: context parallelism and pipeline stages of a model whose attention is not plain causal
    (sliding windows, sinks, linear attention: `uncommon_attention`), context parallelism of packed
    rows (`check_backend_cp`); expert parallelism of experts other than plain SwiGLU ones; tensor
    parallelism of a model that declares no plan (`_tp_plan`) or one apply_tp cannot translate;
    weft's MoE balancing (routing bias, load-balancing loss), which transformers' routers do not take.
    compile.enable (each decoder layer compiled) and float8.enable (transformers' nn.Linear layers,
    the head kept by float8_filter) go through as for weft's models."""
    if spec.backend != "transformers":
        return
    built = f"{args.architecture} (model_type {args.model_type}, built by transformers)"
    if dims.cp > 1:
        check_backend_cp(cfg, args, built, dims.cp)
    if dims.pp > 1 and (what := uncommon_attention(args)) is not None:
        raise ConfigError(f"parallelism.pp = {dims.pp}: {built}: {what}, and its pipeline stage "
                          "(parallelisms/hf_stages.py) gives every layer one plain causal mask; set parallelism.pp = 1")
    refuse_ep = spec.expert_parallel_refusal
    if dims.ep > 1 and refuse_ep is not None and (refusal := refuse_ep(args)) is not None:
        raise ConfigError(f"parallelism.ep = {dims.ep}: {built}: {refusal}, and expert parallelism spreads weft's "
                          "grouped experts, which compute plain SwiGLU experts; set parallelism.ep = 1")
    if cfg.lora.enable and names_routed_experts(cfg.lora.target_modules):
        check_backend_expert_lora(cfg, args, built, dims)
    for key, value in (("moe.bias_update_rate", cfg.moe.bias_update_rate),
                       ("moe.load_balance_coeff", cfg.moe.load_balance_coeff)):
        if value:
            raise ConfigError(f"{key} = {value}: {built} routes by transformers' own arithmetic, which weft's "
                              "balancing (a routing bias, a load-balancing loss) does not reach; set it to 0")
    if dims.tp > 1 and not args.declares_tp_plan:
        raise ConfigError(f"parallelism.tp = {dims.tp}: {built} declares no "
                          "tensor-parallel plan (_tp_plan); set parallelism.tp = 1")
    split_experts = dims.tp > 1 and spec.experts(args) is not None  # by expert (parallelisms/tp.py)
    if split_experts and dims.ep > 1:
        raise ConfigError(f"parallelism.tp = {dims.tp} with parallelism.ep = {dims.ep}: {built} keeps every token on "
                          "each tp rank (no sequence parallelism), and tensor parallelism splits its experts by expert "
                          "itself; set parallelism.ep = 1 or parallelism.tp = 1")
    if split_experts and cfg.compile.enable:
        raise ConfigError(f"compile.enable = true with parallelism.tp = {dims.tp}: {built} splits its experts by "
                          "expert, each rank's share of the tokens cut on the host, which compile cannot trace; set "
                          "compile.enable = false")
    if dims.tp > 1 and (refusal := tp_plan_refusal(spec, args, dims.tp)) is not None:
        raise ConfigError(f"parallelism.tp = {dims.tp}: {refusal}")


def check_backend_expert_lora(cfg: JobConfig, args, built: str, dims: ParallelDims) -> None:
    """LoRA on a transformers model's routed experts: the adapters go on weft's experts in
    transformers' place (`prepare_experts`), so only where those compute the family's experts, and
    not yet under tensor parallelism (its plan for the stacked experts splits no adapters)."""
    key = f"lora.target_modules = {list(cfg.lora.target_modules)}"
    if (refusal := expert_adapters_refusal(args)) is not None:
        raise ConfigError(f"{key}: {built}: {refusal}, and adapters of routed experts go on weft's experts in "
                          "their place, which compute plain SwiGLU experts and gpt-oss's; target its linears")
    if dims.tp > 1:
        raise ConfigError(f"{key}: adapters of {built}'s routed experts are not split by tensor parallelism yet; "
                          "set parallelism.tp = 1 (parallelism.ep spreads them) or target its linears")


def check_backend_cp(cfg: JobConfig, args, built: str, cp: int) -> None:
    """Context parallelism of a transformers model: its attention layers dispatch to weft's core
    (parallelisms/cp.py), which is plain causal over the sequence's global positions, so the model
    must have only plain causal attention and the rows no packed documents (which that core would
    let see each other)."""
    what = uncommon_attention(args)
    if what is None and args.config.get("attn_logit_softcapping"):
        what = "its attention caps its logits (attn_logit_softcapping)"
    if what is not None:
        raise ConfigError(f"parallelism.cp = {cp}: {built}: {what}, and the context-parallel core computes plain "
                          "causal attention over the whole sequence; set parallelism.cp = 1")
    formats = {"data.format": cfg.data.format, "validation.format": cfg.validation.format or cfg.data.format}
    for key, value in formats.items():
        if value in ("chat", "prompt_completion") and (key == "data.format" or cfg.validation.enable):
            raise ConfigError(f"parallelism.cp = {cp}: {key} = {value} packs samples into rows, and the "
                              f"context-parallel core of {built} does not keep them apart; train it on "
                              "data.format = text without data.document_masking, or set parallelism.cp = 1")
    if cfg.data.document_masking:
        raise ConfigError(f"parallelism.cp = {cp}: data.document_masking = true: the context-parallel core of {built} "
                          "does not keep packed documents apart; set it to false, or set parallelism.cp = 1")
