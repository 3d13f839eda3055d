"""Qwen3 and Qwen3-MoE against transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM: parameter
counts of the published models (total and active), logits and routing of tiny random folders
written by transformers and loaded through components/hf, the q/k norm row order, the export's
key set and logits, and the config fields weft refuses."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from weft.components.hf import ConversionError, load_hf_into_model, model_args_from_hf_folder, save_hf_model
from weft.models import spec_for_flavor, spec_for_hf_config
from weft.models.common.hf_names import permute_for_hf
from weft.models.common.moe import route
from weft.models.qwen3 import QWEN3_FLAVORS, Transformer
from weft.models.qwen3.hf_mapping import hf_config, model_args_from_hf_config

from tests.support.hf_folders import tiny_qwen3_hf_folder
from tests.support.published import QWEN3_PUBLISHED


def _hf_counts(flavor: str) -> tuple[int, int]:
    """transformers' total for the flavor's config.json, and total less the routed experts a token
    does not use."""
    args = QWEN3_FLAVORS[flavor]
    config = {k: v for k, v in hf_config(args).items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)) if args.n_experts else Qwen3ForCausalLM(Qwen3Config(**config))
    total = sum(p.numel() for p in hf.parameters())
    routed = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    return total, total - routed + routed * args.top_k // max(args.n_experts, 1)


def _weft_counts(flavor: str) -> tuple[int, int]:
    with torch.device("meta"):
        model = spec_for_flavor(flavor).build(QWEN3_FLAVORS[flavor])
    return sum(p.numel() for p in model.parameters()), model.active_parameters()


@pytest.mark.parametrize("flavor", sorted(QWEN3_PUBLISHED))
def test_flavor_parameter_counts_match_transformers_and_the_published_models(flavor):
    assert _weft_counts(flavor) == _hf_counts(flavor) == QWEN3_PUBLISHED[flavor]


@pytest.mark.parametrize("flavor", ["debugmodel_qwen3", "debugmodel_qwen3_untied", "debugmodel_qwen3_moe"])
def test_debug_flavor_counts_match_transformers(flavor):
    assert _weft_counts(flavor) == _hf_counts(flavor)


@pytest.mark.parametrize("flavor", sorted(QWEN3_FLAVORS))
def test_config_json_reads_back_as_the_flavor(flavor):
    args = QWEN3_FLAVORS[flavor]
    assert model_args_from_hf_config(hf_config(args)) == args
    assert spec_for_hf_config(hf_config(args)) is spec_for_flavor(flavor)


def _loaded(folder) -> Transformer:
    model = Transformer(model_args_from_hf_folder(folder))
    load_hf_into_model(model, folder)
    return model.eval()


TOKENS = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_dense_folder_gives_transformers_logits_and_unpermuted_qk_norms_do_not(tmp_path):
    hf = tiny_qwen3_hf_folder(tmp_path / "hf")
    assert hf.config.tie_word_embeddings and hf.config.head_dim != hf.config.hidden_size // hf.config.num_attention_heads
    model = _loaded(tmp_path / "hf")
    theirs = hf(TOKENS).logits
    assert theirs.abs().max() > 1.0  # a random model, not a near-zero one
    torch.testing.assert_close(model(TOKENS), theirs, rtol=0, atol=1e-5)
    # The q/k norm weights left in Hugging Face's row order (as a loader that permutes only q and k
    # rows would leave them): the logits are off.
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.copy_(permute_for_hf(param, 1))
    assert (model(TOKENS) - theirs).abs().max() > 1e-2


def _routing(model, hf, tokens):
    """Each MoE layer's chosen experts per token ([tokens, top_k], sorted) and their scores, weft's
    (from its router's logits through `route`, as its MoE layer chooses) and transformers' (from
    its router's output)."""
    ours, theirs, hooks = {}, {}, []
    for key, block in model.layers.items():
        if block.moe:
            layer = block.feed_forward
            hooks.append(layer.router.register_forward_hook(
                lambda m, i, out, key=key, layer=layer: ours.__setitem__(
                    int(key), route(out, layer.top_k, layer.score_func, layer.expert_bias, layer.norm_topk_prob))))
    for index, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda m, i, out, index=index: theirs.__setitem__(index, (out[1], out[2]))))
    logits = model(tokens), hf(tokens).logits
    for hook in hooks:
        hook.remove()

    def chosen(scores, experts):
        experts, order = experts.sort(-1)
        return experts, scores.gather(-1, order)

    return logits, {k: chosen(*v) for k, v in ours.items()}, {k: chosen(*v) for k, v in theirs.items()}


@pytest.mark.parametrize("overrides", [
    {},  # norm_topk_prob, every layer MoE but layer 1 (mlp_only_layers)
    {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []},  # layers 1 and 3 MoE
    {"decoder_sparse_step": 2, "mlp_only_layers": [3]},  # layer 1 alone MoE
], ids=["norm_topk_mlp_only", "unnormalised_sparse_step", "sparse_step_and_mlp_only"])
@torch.no_grad()
def test_moe_folder_gives_transformers_logits_and_routing(tmp_path, overrides):
    hf = tiny_qwen3_hf_folder(tmp_path / "hf", moe=True, **overrides)
    model = _loaded(tmp_path / "hf")
    moe_layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    assert [int(k) for k, block in model.layers.items() if block.moe] == moe_layers
    assert 0 < len(moe_layers) < len(model.layers)  # dense and MoE layers mixed
    (ours, theirs), our_routes, their_routes = _routing(model, hf, TOKENS)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert sorted(our_routes) == sorted(their_routes) == moe_layers
    for layer in moe_layers:
        (our_experts, our_scores), (their_experts, their_scores) = our_routes[layer], their_routes[layer]
        assert torch.equal(our_experts, their_experts), f"layer {layer} routes differently"
        torch.testing.assert_close(our_scores, their_scores, rtol=0, atol=1e-5)
        assert len(our_experts.unique()) >= 6 and len(our_experts.unique(dim=0)) >= 4  # routing varies by token
        sums = our_scores.sum(-1)
        if hf.config.norm_topk_prob:
            torch.testing.assert_close(sums, torch.ones_like(sums))
        else:
            assert sums.min() < 0.9  # what renormalising would have changed


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@torch.no_grad()
def test_export_has_transformers_key_set_and_gives_weft_logits(tmp_path, moe):
    tiny_qwen3_hf_folder(tmp_path / "hf", moe=moe)
    model = _loaded(tmp_path / "hf")
    save_hf_model(model, tmp_path / "round_trip")
    source, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "round_trip" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[key], source[key]) for key in source)  # bit for bit, experts split back
    model.init_weights(seed=3)  # weft's own weights, exported and read back by transformers
    save_hf_model(model, tmp_path / "export")
    assert sorted(load_file(tmp_path / "export" / "model.safetensors")) == sorted(source)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").float().eval()
    assert type(theirs) is (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)
    torch.testing.assert_close(theirs(TOKENS).logits, model(TOKENS), rtol=0, atol=1e-5)


def test_an_old_style_config_reads_like_a_new_one(tmp_path):
    """transformers 4's files: rope_theta at the top level, num_experts; transformers 5's:
    rope_parameters, num_local_experts."""
    new = tiny_qwen3_hf_folder(tmp_path / "hf", moe=True).config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "num_local_experts")}
    old |= {"rope_theta": new["rope_parameters"]["rope_theta"], "rope_scaling": None, "num_experts": 8}
    assert model_args_from_hf_config(old) == model_args_from_hf_config(new)
    assert model_args_from_hf_config(new).rope_theta == 1e6 and model_args_from_hf_config(new).n_experts == 8


@pytest.mark.parametrize(("change", "message"), [
    ({"use_sliding_window": True}, "use_sliding_window is True; weft's Qwen3 supports only False"),
    ({"attention_bias": True}, "attention_bias is True; weft's Qwen3 supports only False"),
    ({"hidden_act": "gelu"}, "hidden_act is gelu; weft's Qwen3 supports only silu"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_parameters.rope_type is yarn; weft's Qwen3 implements default and llama3"),
    ({"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types is ['full_attention', 'sliding_attention']; weft's Qwen3 supports only full_attention layers"),
    ({"num_experts_per_tok": 9}, "top_k 9 must lie in 1..n_experts (8)"),
])
def test_unrepresentable_config_is_refused_in_one_line_naming_the_field(tmp_path, change, message):
    folder = tmp_path / "hf"
    tiny_qwen3_hf_folder(folder, moe=True)
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError) as caught:
        model_args_from_hf_folder(folder)
    assert str(caught.value) == f"HF folder {folder}: {message}"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_generate_decodes_a_folder_greedily_as_transformers_does(tmp_path, moe, capsys):
    """`generate.py --hf <folder> --temperature 0` builds weft's Qwen3 by its spec and prints the
    tokens transformers' generate(do_sample=False) gives: 40 tokens, routed where the folder is MoE."""
    from tests.support.greedy_decoding import assert_greedy_decoding_equals_transformers

    reference = tiny_qwen3_hf_folder(tmp_path / "hf", moe=moe)
    assert_greedy_decoding_equals_transformers(reference, tmp_path / "hf", "Qwen3", 40, 4, capsys)


@pytest.mark.parametrize("flavor", ["debugmodel_qwen3", "debugmodel_qwen3_moe"])
def test_what_the_spec_says_holds_for_the_model_it_builds(flavor):
    """experts() and active_parameters against the built model: its MoE layers and the routed
    experts' share a token skips. The memory estimate's block
    and adapter counts against the model's, and its adapters as apply_lora makes them."""
    from weft.components.observe.metrics import active_parameters
    from weft.models.common.moe import MoE

    spec = spec_for_flavor(flavor)
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    experts, total = spec.experts(args), sum(p.numel() for p in model.parameters())
    if not moes:
        assert experts is None and active_parameters(model) == total
    else:
        assert {(m.router.out_features, m.top_k, m.score_func, m.score_before_experts, m.shared_expert)
                for m in moes} == {(experts.n_experts, experts.top_k, "softmax", False, None)}
        assert experts.routed_slots == len(moes) * experts.top_k / args.n_layers
        assert experts.routed_hidden_dim == len(moes) * experts.top_k * args.moe_hidden_dim // args.n_layers
        routed = sum(p.numel() for m in moes for p in m.experts.parameters())
        assert active_parameters(model) == total - routed + routed * experts.top_k // experts.n_experts
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    assert spec.block_numel(args) * args.n_layers == pytest.approx(blocks, rel=1e-3)
    from weft.parallelisms.lora import LoRAOptions, apply_lora

    apply_lora(model, LoRAOptions(rank=4, alpha=8))  # the default targets: every linear but the output head and routers
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert spec.lora_block_numel(args, 4) * args.n_layers == pytest.approx(adapters, rel=1e-3)


# config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B as published (transformers 4.51's format:
# rope_theta at the top level, num_experts).
PUBLISHED_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
PUBLISHED_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize(("config", "flavor"), [(PUBLISHED_0_6B, "qwen3_0_6b"), (PUBLISHED_30B_A3B, "qwen3_30b_a3b")])
def test_published_config_files_read_as_their_flavors(tmp_path, config, flavor):
    """So that `model.flavor = from_hf_config` on the Hub folder builds the flavor, and the flavor
    given with that folder passes the architecture check (config.json alone: no weights needed)."""
    from weft.components.hf.load import model_args_for_run

    assert model_args_from_hf_config(config) == QWEN3_FLAVORS[flavor]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_args_for_run("from_hf_config", str(tmp_path)) == QWEN3_FLAVORS[flavor]
    assert model_args_for_run(flavor, str(tmp_path)) == QWEN3_FLAVORS[flavor]
