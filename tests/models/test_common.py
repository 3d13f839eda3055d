"""The shared decoder parts of models/common/ as a new family would use them, against transformers:
a Qwen3-shaped model assembled from them alone (grouped-query attention with the per-head q/k
RMSNorm before rotary, the decoder frame, a name table whose rotary rows include the q/k norm
weights) gives transformers' Qwen3 logits; the name table names a Qwen3-MoE folder's per-expert
tensors exactly as transformers writes them; no family folder imports another's."""

from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from weft.models.common.decoder import Decoder
from weft.models.common.feed_forward import FeedForward
from weft.models.common.gqa import GroupedQueryAttention
from weft.models.common.hf_names import DECODER_BLOCK, ROTARY_ROWS, HFNames, decoder_table, swiglu
from weft.models.common.norms import RMSNorm

from tests.support.import_graph import ROOT, import_graph


@dataclass(frozen=True)
class Args:  # the fields the shared parts read
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32  # not dim / n_heads, as in Qwen3-0.6B
    vocab_size: int = 96
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: None = None
    max_seq_len: int = 64
    tie_embeddings: bool = True
    hidden: int = 80


class Block(nn.Module):
    def __init__(self, args: Args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = GroupedQueryAttention(args, qk_norm_eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden)

    def forward(self, x, rotations):
        h = x + self.attention(self.attention_norm(x), rotations)
        return h + self.feed_forward(self.ffn_norm(h))


class QwenShaped(Decoder):
    def __init__(self, args: Args):
        super().__init__(args, lambda layer: Block(args))

    def forward(self, tokens):
        return self.run_blocks(tokens, self.rope_rotations[: tokens.shape[1]])


QK_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
QK_NORM_ROWS = {"attention.q_norm.weight": 1, "attention.k_norm.weight": 1}  # one head of head_dim rows each
DENSE = decoder_table(DECODER_BLOCK | QK_NORMS | swiglu("feed_forward", "mlp"))


def transformers_qwen3(args: Args) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=args.dim, intermediate_size=args.hidden, num_hidden_layers=args.n_layers,
                         num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings,
                         max_position_embeddings=args.max_seq_len,
                         rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                         attn_implementation="eager")
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # random norm weights too, so that their row order matters
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.1)
    return model.eval()


def weft_from(hf: Qwen3ForCausalLM, names: HFNames, args: Args) -> QwenShaped:
    model = QwenShaped(args)
    state = hf.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(names.from_hf_tensor(name, state[names.to_hf(name)], args))
    return model.eval()


def test_a_qwen3_shaped_model_from_the_shared_parts_gives_transformers_logits():
    args = Args()
    hf = transformers_qwen3(args)
    ours = weft_from(hf, HFNames(DENSE, rotary_rows=ROTARY_ROWS | QK_NORM_ROWS), args)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
    assert sum(p.numel() for p in ours.parameters()) == hf.num_parameters()
    # The q/k norm weights left in Hugging Face's row order: the logits are off.
    unpermuted = weft_from(hf, HFNames(DENSE, rotary_rows=ROTARY_ROWS), args)
    with torch.no_grad():
        assert (unpermuted(tokens) - hf(tokens).logits).abs().max() > 1e-2


def test_the_name_table_round_trips_and_refuses_what_it_lacks():
    names = HFNames(DENSE, weft_only=["layers.{layer}.feed_forward.expert_bias"])
    weft = [name for name, _ in QwenShaped(Args()).named_parameters()]
    assert [names.to_weft(names.to_hf(name)) for name in weft] == weft
    assert names.to_hf("layers.11.attention.q_norm.weight") == "model.layers.11.self_attn.q_norm.weight"
    assert names.groups(["layers.0.feed_forward.expert_bias", "norm.weight"]) == {"model.norm.weight": ["norm.weight"]}
    with pytest.raises(ValueError, match="no Hugging Face name for weft parameter 'rope_rotations'"):
        names.to_hf("rope_rotations")
    with pytest.raises(ValueError, match="no weft name for Hugging Face tensor 'model.layers.0.mlp.experts.0.gate_proj.weight'"):
        names.to_weft("model.layers.0.mlp.experts.0.gate_proj.weight")


MOE = decoder_table(DECODER_BLOCK | QK_NORMS | {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.experts.w1": "mlp.experts.{expert}.gate_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{expert}.down_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{expert}.up_proj.weight",
})


def test_per_expert_tensors_are_named_as_transformers_writes_them_and_stack_into_weft_experts(tmp_path):
    """One weft parameter ([experts, out, in]) from one 2-D Hugging Face tensor per expert: the
    table's `{expert}` field names them in stacking order; the stack is transformers' own expert
    weights."""
    experts, hidden = 4, 16
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=hidden, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=50,
                            num_experts=experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(config)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        on_disk = {key: f.get_tensor(key) for key in f.keys()}
    names = HFNames(MOE)
    weft = {names.to_weft(key) for key in on_disk}
    assert {"layers.1.feed_forward.experts.w1", "layers.1.feed_forward.router.weight"} <= weft
    parts = {name: names.hf_parts(name, experts) for name in weft}
    assert sorted(key for keys in parts.values() for key in keys) == sorted(on_disk)
    with pytest.raises(ValueError, match="held by several Hugging Face tensors"):
        names.to_hf("layers.0.feed_forward.experts.w1")
    w1 = torch.stack([on_disk[key] for key in parts["layers.1.feed_forward.experts.w1"]])
    w2 = torch.stack([on_disk[key] for key in parts["layers.1.feed_forward.experts.w2"]])
    block = hf.model.layers[1].mlp.experts
    assert w1.shape == (experts, hidden, 32) and w2.shape == (experts, 32, hidden)  # weft's GroupedExperts layout
    torch.testing.assert_close(w1, block.gate_up_proj[:, :hidden].detach(), rtol=0, atol=0)
    torch.testing.assert_close(w2, block.down_proj.detach(), rtol=0, atol=0)


def test_no_family_folder_imports_another():
    families = sorted(path.parent.name for path in (ROOT / "models").glob("*/spec.py") if path.parent.name != "common")
    assert {"llama", "llama4", "qwen3"} <= set(families)
    offenders = [f"{name} imports {target}" for name, targets in import_graph().items()
                 for target in targets for family in families for other in families
                 if other != family and name.startswith(f"weft.models.{family}.")
                 and (target == f"weft.models.{other}" or target.startswith(f"weft.models.{other}."))]
    assert not offenders, "\n".join(offenders)
