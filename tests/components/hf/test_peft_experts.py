"""PEFT's `target_parameters` layout of weft's expert adapters (components/hf/writer.py), against
transformers and PEFT themselves: adapters in weft's layout (A [E, r, in], B [E, out, r] per stacked
expert weight, see EXPERT_ADAPTERS in the docs) written as a PEFT folder load with
`PeftModel.from_pretrained` onto transformers' Llama4ForCausalLM and Qwen3MoeForCausalLM with the
logits of that model whose expert parameters were merged by hand, W + scaling·ΔW in Hugging Face's
own layout (Llama 4: gate_up_proj [E, dim, 2H] used as x @ W; Qwen3-MoE: [E, 2H, dim] as in F.linear)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from weft.components.hf.writer import Adapters, ExportError, write_peft_adapter
from weft.models.gpt_oss.hf_mapping import model_args_from_hf_config as gpt_oss_args
from weft.models.llama4.hf_mapping import model_args_from_hf_config as llama4_args
from weft.models.qwen3.hf_mapping import model_args_from_hf_config as qwen3_args

from tests.support.hf_folders import TINY_QWEN3_MOE, tiny_gpt_oss_model
from tests.support.llama4_transformers import tiny_transformers_model

RANK = 3


def _qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_QWEN3_MOE, attn_implementation="eager")).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.3) if "norm" in name else p.normal_(0, 0.3 if name.endswith("mlp.gate.weight") else 0.1)
    return model.eval()


# family -> (transformers model, weft args, MoE layers' experts module in weft / in transformers,
#            whether gate_up_proj is [E, dim, 2H] used as x @ W)
FAMILIES = {
    "llama4": (lambda: tiny_transformers_model(seed=2), llama4_args, "feed_forward.experts", True),
    "qwen3_moe": (_qwen3_moe, qwen3_args, "mlp.experts", False),
    # gate and up interleaved in gate_up_proj [E, dim, 2H] (gate the even features), biases beside them
    "gpt_oss": (lambda: tiny_gpt_oss_model(seed=2), gpt_oss_args, "mlp.experts", True),
}
INTERLEAVED = {"gpt_oss"}


def _hand_merged(hf, adapters: dict, scaling: float, hf_experts: str, x_at_w: bool, interleaved: bool = False):
    """transformers' model with weft's adapters merged by hand into its own expert parameters."""
    state = hf.state_dict()
    with torch.no_grad():
        for (layer, w), (a, b) in adapters.items():
            delta = scaling * (b @ a)  # [E, out, in], as weft's w1/w2/w3
            if layer == "wv":
                continue
            prefix = f"model.layers.{layer}.{hf_experts}"
            if w == "w2":
                state[f"{prefix}.down_proj"] += delta.transpose(1, 2) if x_at_w else delta
                continue
            gate_up = state[f"{prefix}.gate_up_proj"]
            hidden = gate_up.shape[2 if x_at_w else 1] // 2
            part = slice(0, hidden) if w == "w1" else slice(hidden, 2 * hidden)
            if interleaved:  # gate in the even features, up in the odd
                part = slice(0, None, 2) if w == "w1" else slice(1, None, 2)
            if x_at_w:
                gate_up[:, :, part] += delta.transpose(1, 2)
            else:
                gate_up[:, part, :] += delta
        for (layer, w), (a, b) in adapters.items():
            if layer == "wv":
                state[f"model.layers.{w}.self_attn.v_proj.weight"] += scaling * (b @ a)
    return state


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("weights, rslora", [(("w1", "w2", "w3"), True), (("w2", "w3"), False)],
                         ids=["all_three_rslora_and_wv", "up_and_down_alone"])
def test_peft_loads_expert_adapters_with_the_hand_merged_logits(tmp_path, family, weights, rslora):
    from peft import PeftModel

    build, args_of, hf_experts, x_at_w = FAMILIES[family]
    hf = build()
    args = args_of(hf.config.to_dict())
    block = hf_experts.split(".")[0]  # the feed-forward's name: feed_forward (Llama 4) or mlp
    moe_layers = [i for i in range(args.n_layers) if hasattr(hf.model.layers[i], block)
                  and hasattr(getattr(hf.model.layers[i], block), "experts")]
    assert moe_layers
    g = torch.Generator().manual_seed(7)
    experts = {n: p for n, p in hf.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
    adapters, tensors = {}, {}
    for layer in moe_layers:
        gate_up = experts[f"model.layers.{layer}.{hf_experts}.gate_up_proj"]
        n_experts, dim, hidden = gate_up.shape[0], args.dim, gate_up.shape[2 if x_at_w else 1] // 2
        for w in weights:
            out, inp = (dim, hidden) if w == "w2" else (hidden, dim)
            a, b = torch.randn(n_experts, RANK, inp, generator=g), torch.randn(n_experts, out, RANK, generator=g) * 0.02
            adapters[(layer, w)] = (a, b)
            tensors[f"layers.{layer}.feed_forward.experts.lora_A.{w}"] = a
            tensors[f"layers.{layer}.feed_forward.experts.lora_B.{w}"] = b
    linears = ("layers.0.attention.wv",) if len(weights) == 3 else ()  # and once the experts alone
    if linears:  # a linear adapter beside them (no rotary rows in wv)
        a, b = torch.randn(RANK, args.dim, generator=g), torch.randn(args.kv_heads * args.head_dim, RANK, generator=g) * 0.1
        adapters[("wv", 0)] = (a, b)
        tensors["layers.0.attention.wv.lora_A.weight"], tensors["layers.0.attention.wv.lora_B.weight"] = a, b
    alpha = 5.0
    scaling = alpha / math.sqrt(RANK) if rslora else alpha / RANK
    names = tuple(f"layers.{layer}.feed_forward.experts.{w}" for layer in moe_layers for w in weights)
    write_peft_adapter(tmp_path / "adapter", args, lambda wanted: ((n, tensors[n]) for n in wanted),
                       Adapters(linears, RANK, alpha, 0.1, rslora, scaling, experts=names))

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == (["v_proj"] if linears else None)
    assert config["lora_dropout"] == 0.0  # PEFT refuses dropout with target_parameters
    assert sorted(config["target_parameters"]) == sorted(
        {f"{hf_experts}.{'down_proj' if w == 'w2' else 'gate_up_proj'}" for w in weights})
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=g)
    reference = build()
    reference.load_state_dict(_hand_merged(reference, adapters, scaling, hf_experts, x_at_w, family in INTERLEAVED))
    with torch.no_grad():
        expected, base_logits = reference(tokens).logits, hf(tokens).logits
        assert (expected - base_logits).abs().max() > 1e-2, "the adapters must change the logits"
        peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        written = {n for n in load_file(tmp_path / "adapter" / "adapter_model.safetensors") if "experts" in n}
        assert written == {n.replace(".default", "") for n, _ in peft_model.named_parameters()
                           if ".lora_" in n and "experts" in n}  # every expert adapter in its place, none left out
        torch.testing.assert_close(peft_model(tokens).logits, expected, rtol=0, atol=1e-5)


def test_layers_adapting_different_expert_weights_are_refused(tmp_path):
    hf = tiny_transformers_model()
    args = llama4_args(hf.config.to_dict())
    names = ("layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w3", "layers.3.feed_forward.experts.w1")
    with pytest.raises(ExportError, match="adapt the same expert weights in every layer"):
        write_peft_adapter(tmp_path / "adapter", args, lambda wanted: iter(()),
                           Adapters((), RANK, 4.0, 0.0, False, 4.0 / RANK, experts=names))
    assert not (tmp_path / "adapter").exists()
