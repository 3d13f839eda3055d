"""apply_tp's plans and its checks, before any mesh is touched (one process, meta models)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from weft.models.llama import LLAMA_FLAVORS, Transformer
from weft.parallelisms.common import TransformError
from weft.parallelisms.tp import ReplicatedOverSplitHeads, TPOptions, apply_tp, default_tp_plan, hf_tp_plan

from tests.support.own_models import NanoGPT, hf_llama


class MeshOfSize:
    """apply_tp reads only the size of the mesh before its checks pass."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def meta(build):
    with torch.device("meta"):
        return build()


def test_hf_plan_comes_from_the_model_declaration():
    model = meta(hf_llama)
    plan = hf_tp_plan(model, loss_parallel=False)
    assert set(plan) == set(model._tp_plan)
    assert type(plan["model.layers.*.self_attn.q_proj"]) is ColwiseParallel
    assert type(plan["model.layers.*.mlp.down_proj"]) is RowwiseParallel
    head = plan["lm_head"]
    assert head.output_layouts == (Replicate(),) and head.use_local_output
    sharded_head = hf_tp_plan(model, loss_parallel=True)["lm_head"]
    assert sharded_head.output_layouts == (Shard(-1),) and not sharded_head.use_local_output


def test_gemma3_s_per_head_norms_keep_whole_weights_over_split_heads():
    """replicated_with_grad_allreduce (its q/k norms) is translated; tests/recipe/test_hf_backend.py
    trains Gemma 3 under tp 2 equal to one process."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = meta(lambda: transformers.AutoModelForCausalLM.from_config(config))
    plan = hf_tp_plan(model)
    norms = {path for path, style in plan.items() if isinstance(style, ReplicatedOverSplitHeads)}
    assert norms == {"model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"}


def test_qwen3_5_s_linear_attention_projections_gather_their_output_whatever_the_loss():
    """colwise_gather_output on Qwen3.5's linear-attention projections means whole outputs (its code
    reshapes them into heads); only the head's may stay split for loss parallelism. tests/recipe/
    test_hf_backend.py trains Qwen3.5 under tp 2 equal to one process."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            layer_types=["linear_attention", "full_attention"])
    model = meta(lambda: transformers.AutoModelForCausalLM.from_config(config))
    plan = hf_tp_plan(model, loss_parallel=True)
    gathered = {path: style for path, style in plan.items() if "linear_attn" in path}
    assert {path.rsplit(".", 1)[-1] for path in gathered} == {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                              "out_proj"}
    for style in gathered.values():
        assert type(style) is ColwiseParallel and style.output_layouts == (Replicate(),) and style.use_local_output
    assert plan["lm_head"].output_layouts == (Shard(-1),)


def test_glm4_moe_s_experts_split_by_expert_and_its_undeclared_per_head_norms_sum_their_gradients():
    """GLM-4 MoE's routed experts, named by transformers 5.25's expert-parallel plan (ep_dispatch_experts)
    and by 5.24's tensor-parallel one (moe_tp_experts, whose weights' styles ExpertsByExpert replaces),
    are split by expert once weft's grouped experts compute them; transformers' own stay whole under
    5.25's plan and are refused under 5.24's; gpt-oss's (biases) stay whole. The q/k norms the plan leaves out over head-split
    projections get Gemma 3's style, but Cohere's, one weight per head, do not. tests/recipe/
    test_hf_backend.py trains both under tp 2."""
    transformers = pytest.importorskip("transformers")
    from weft.models.transformers.experts import swap_in_grouped_experts
    from weft.parallelisms.tp import ExpertsByExpert

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4)
    config = transformers.Glm4MoeConfig(**shape, head_dim=8, use_qk_norm=True, first_k_dense_replace=1,
                                        n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)
    model = meta(lambda: transformers.AutoModelForCausalLM.from_config(config))
    assert model._ep_plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    if "model.layers.*.mlp.experts" in model._tp_plan:  # transformers 5.24 declares them in its tp plan
        model._tp_plan = {k: v for k, v in model._tp_plan.items() if not k.startswith("model.layers.*.mlp.experts")}
    plan = hf_tp_plan(model)
    assert not any(path.startswith("model.layers.*.mlp.experts") for path in plan)  # transformers' own: whole
    norms = {path for path, style in plan.items() if isinstance(style, ReplicatedOverSplitHeads)}
    assert norms == {"model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"}
    moe_tp = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",  # transformers 5.24's declaration
              "model.layers.*.mlp.experts.down_proj": "rowwise", "model.layers.*.mlp.experts": "moe_tp_experts"}
    declared_5_24 = meta(lambda: transformers.AutoModelForCausalLM.from_config(config))
    declared_5_24._tp_plan = {**model._tp_plan, **moe_tp}
    with pytest.raises(TransformError, match=r"^apply_tp: model.layers.1.mlp.experts \(Glm4MoeExperts\) is not "):
        apply_tp(declared_5_24, MeshOfSize(2))  # transformers' own experts: weft's grouped ones must be swapped in
    for declared in (model, declared_5_24):
        swap_in_grouped_experts(declared)
        plan = hf_tp_plan(declared)
        assert type(plan["model.layers.*.mlp.experts"]) is ExpertsByExpert
        assert not any(path.startswith("model.layers.*.mlp.experts.") for path in plan)
        with pytest.raises(TransformError, match=r"^apply_tp: tp_mesh size 4 does not divide the 6 experts of "
                                                 r"model.layers.1.mlp.experts; "):
            apply_tp(declared, MeshOfSize(4))
    gpt_oss = meta(lambda: transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(
        **shape, num_local_experts=4, num_experts_per_tok=2)))
    swap_in_grouped_experts(gpt_oss)  # its experts' biases are not stacked weights ExpertsByExpert splits: whole
    assert gpt_oss._ep_plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert not any(path.startswith("model.layers.*.mlp.experts") for path in hf_tp_plan(gpt_oss))
    cohere = transformers.CohereConfig(**shape, use_qk_norm=True)
    plan = hf_tp_plan(meta(lambda: transformers.AutoModelForCausalLM.from_config(cohere)))
    assert not any(isinstance(style, ReplicatedOverSplitHeads) for style in plan.values())


def test_weft_model_gets_the_sequence_parallel_llama_plan():
    plan = default_tp_plan(meta(lambda: Transformer(LLAMA_FLAVORS["debugmodel"])))
    assert "layers.*.attention_norm" in plan and "tok_embeddings" in plan


class NanoGPTWithPlan(NanoGPT):
    """A model of one's own that declares its tensor-parallel plan, as weft's Decoder does."""

    def tensor_parallel_plan(self, *, loss_parallel: bool = False) -> dict:
        return {"transformer.h.*.mlp.0": ColwiseParallel(), "transformer.h.*.mlp.2": RowwiseParallel(),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate())}


def test_a_model_that_declares_its_plan_is_split_by_it():
    model = meta(NanoGPTWithPlan)
    assert set(default_tp_plan(model)) == {"transformer.h.*.mlp.0", "transformer.h.*.mlp.2", "lm_head"}
    assert default_tp_plan(model, loss_parallel=True)["lm_head"].output_layouts == (Shard(-1),)
    assert default_tp_plan(model)["lm_head"].output_layouts == (Replicate(),)
    with pytest.raises(TransformError, match=r"tp_mesh size 3 does not divide dim 0 \(size 128\) of transformer.h.0.mlp.0"):
        apply_tp(model, MeshOfSize(3))  # its plan, checked before anything changes (NanoGPT alone has none)


@pytest.mark.parametrize(
    "build, size, message",
    [
        (lambda: Transformer(LLAMA_FLAVORS["debugmodel"]), 3, "apply_tp: tp_mesh size 3 does not divide n_heads 8"),
        (hf_llama, 4, "apply_tp: tp_mesh size 4 does not divide num_key_value_heads 2"),
        (NanoGPT, 2, "apply_tp: no tensor-parallel plan is known for NanoGPT; pass plan="),
    ],
)
def test_refusals_name_the_function_and_the_numbers(build, size, message):
    with pytest.raises(TransformError) as error:
        apply_tp(meta(build), MeshOfSize(size))
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_split_dims_are_checked_from_the_weight_shapes():
    model = meta(lambda: nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8)))
    with pytest.raises(TransformError, match=r"^apply_tp: tp_mesh size 4 does not divide dim 0 \(size 6\) of 0.weight$"):
        apply_tp(model, MeshOfSize(4), TPOptions(plan={"0": ColwiseParallel(), "1": RowwiseParallel()}))
    with pytest.raises(TransformError, match="plan entry 'layers.*.wq' matches no module of Sequential"):
        apply_tp(model, MeshOfSize(2), TPOptions(plan={"layers.*.wq": ColwiseParallel()}))


def test_odd_head_count_is_refused_even_when_a_plan_is_given():
    args = replace(LLAMA_FLAVORS["debugmodel"], n_heads=6, n_kv_heads=2, dim=192)
    with pytest.raises(TransformError, match="tp_mesh size 4 does not divide n_heads 6"):
        apply_tp(meta(lambda: Transformer(args)), MeshOfSize(4), TPOptions(plan={"output": ColwiseParallel()}))


def hf_loss_with_and_without_tp() -> tuple[bool, float, float]:
    """Worker: a transformers LlamaForCausalLM's own `labels=` loss on one process, then on the
    same weights under apply_tp(model, tp_mesh) alone; (logits are a plain tensor, both losses)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = hf_llama()
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(input_ids=tokens, labels=tokens).loss.item()  # this process alone, no mesh
        parallel = apply_tp(copy.deepcopy(model), init_device_mesh("cpu", (dist.get_world_size(),)))
        output = parallel(input_ids=tokens, labels=tokens)
    return type(output.logits) is torch.Tensor, output.loss.item(), reference


def test_transformers_model_under_apply_tp_keeps_its_output_type():
    """By default apply_tp keeps a model's outputs what they were (the declared plan gathers the
    LM head), so the model's own loss works; loss parallelism is an explicit argument."""
    from weft.components.distributed.cpu_ranks import run_distributed

    for plain, loss, reference in run_distributed(hf_loss_with_and_without_tp, 2):
        assert plain
        assert loss == pytest.approx(reference, abs=1e-5)



def olmo2(transformers):
    """OLMo 2: q/k/v colwise_gather_output (its q/k norms span every head) and o_proj rowwise_split_input."""
    return transformers.Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def deepseek_v3(transformers):
    """DeepSeek V3 (transformers 5.25's plan): attention split by heads, kv_a_proj_with_mqa mla_kv_a_proj,
    the routed experts by expert (weft's grouped experts swapped in), the dense MLP and shared expert split."""
    return transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                                         q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                         v_head_dim=8, n_group=2, topk_group=1, first_k_dense_replace=1)


def grads_with_and_without_tp(family: str, lora: bool = False) -> tuple[list[str], float, dict[str, float]]:
    """Worker: a tiny transformers model (float64) of `family`, its `labels=` loss and every gradient in
    this process alone, then the same weights under apply_tp over every rank: the modules split, the
    largest relative difference of the loss and of each gradient (split ones gathered). lora: adapters
    on every linear (the base frozen), split with their base or kept whole with it."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    transformers = pytest.importorskip("transformers")
    from weft.models.transformers.experts import swap_in_grouped_experts

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(globals()[family](transformers)).double()
    swap_in_grouped_experts(model)  # as the recipe does under tp (none in OLMo 2)
    if lora:
        from weft.parallelisms.lora import LoRAOptions, apply_lora

        apply_lora(model, LoRAOptions(rank=4))
    with torch.no_grad():
        for param in model.parameters():  # transformers' init leaves some at zero or one: every weight counts
            param.normal_(0, 0.2)
    parallel = apply_tp(copy.deepcopy(model), init_device_mesh("cpu", (dist.get_world_size(),)))
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, parallel):
        loss = m(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.item())
    theirs = dict(parallel.named_parameters())
    split = sorted({name.rpartition(".")[0] for name, p in theirs.items() if isinstance(p, DTensor)})
    errors = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = theirs[name].grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        errors[name] = ((grad - param.grad).norm() / param.grad.norm()).item()
    return split, abs(losses[1] - losses[0]) / abs(losses[0]), errors


def transformers_version() -> tuple[int, int]:
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


@pytest.mark.slow
@pytest.mark.parametrize("family, lora", [("olmo2", False), ("deepseek_v3", False), ("deepseek_v3", True)])
def test_tp2_loss_and_every_gradient_equal_one_process(family, lora):
    """Float64, so the two differ by the order of their sums alone (each gradient ~1e-15 relative; a
    gradient one rank computes a part of, unsummed, is off by its other part: order 1). DeepSeek V3's
    rotary key, shared by the heads both ranks split, is such a part (SharedRopeKeyGradSummed)."""
    from weft.components.distributed.cpu_ranks import run_distributed

    tol = 1e-10  # float64's epsilon (2.2e-16) times a margin of 4.5e5 for the order of the sums
    for split, loss, errors in run_distributed(grads_with_and_without_tp, 2, family, lora):
        assert loss <= tol
        assert {name: e for name, e in errors.items() if not e <= tol} == {}
        assert "model.layers.0.mlp.down_proj" in split and "lm_head" in split
        if family == "olmo2" or transformers_version() >= (5, 25):  # 5.24's DeepSeek V3 plan leaves attention whole
            assert "model.layers.1.self_attn.o_proj" in split
        if family == "deepseek_v3":
            assert "model.layers.1.mlp.experts" in split
        if lora:
            assert "model.layers.0.self_attn.kv_a_proj_with_mqa.lora_A.weight" in errors


def test_every_style_transformers_registers_is_translated_or_refused_with_its_reason():
    """transformers' styles (ALL_PARALLEL_STYLES) each have a meaning in weft: a PyTorch style, the
    module left whole, or a reason to refuse; an attention holding per-head parameters (GraniteSWA's
    sinks, local_params) is refused in one line naming the family and the style, no `plan=` advice."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    from weft.parallelisms.tp import _UNTRANSLATED, _WHOLE_STYLES, _hf_style

    config = SimpleNamespace(qk_rope_head_dim=8)
    for name in ALL_PARALLEL_STYLES.keys():
        assert _hf_style(name, False, head=False, config=config) is not None or name in _WHOLE_STYLES + tuple(
            _UNTRANSLATED), name
    config = transformers.AutoConfig.for_model("granite_swa", vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(TransformError) as refused:
        hf_tp_plan(meta(lambda: transformers.AutoModelForCausalLM.from_config(config)))
    assert str(refused.value).startswith("apply_tp: GraniteSWAForCausalLM (model_type granite_swa) declares the "
                                         "tensor-parallel style 'local_params' for model.layers.*.self_attn (")
    assert "plan=" not in str(refused.value) and "\n" not in str(refused.value)
