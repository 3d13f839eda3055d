"""Llama 4 against transformers' Llama4ForCausalLM: parameter counts of the published models,
logits of a tiny random model after loading its weights, and the way back."""

import pytest
import torch
from transformers import Llama4Config, Llama4ForCausalLM

from weft.models.common.rotary import rope_frequencies
from weft.models.llama.hf_mapping import HFConfigError
from weft.models.llama4 import LLAMA4_FLAVORS, ModelArgs, Transformer
from weft.models.llama4.hf_mapping import model_args_from_hf_config

from tests.support.llama4_transformers import (
    TINY,
    tiny_transformers_model,
    transformers_config,
    transformers_from_weft,
    weft_from_transformers,
)

PUBLISHED = {  # (total, active per token) of the text models, as the issue and model cards give them
    "llama4_scout": (107_769_861_120, 17_172_894_720),
    "llama4_maverick": (400_711_848_960, 17_184_691_200),
}


def _hf_counts(args: ModelArgs) -> tuple[int, int]:
    """transformers' total, and total less the routed experts a token does not use."""
    with torch.device("meta"):
        hf = Llama4ForCausalLM(transformers_config(args))
    total = sum(p.numel() for p in hf.parameters())
    routed = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    return total, total - routed + routed * args.top_k // args.n_experts


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavor_parameter_counts_match_transformers_and_the_published_models(flavor):
    args = LLAMA4_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    ours = (sum(p.numel() for p in model.parameters()), model.active_parameters())
    assert ours == _hf_counts(args) == PUBLISHED[flavor]


def test_debug_moe_flavor_counts_match_transformers():
    args = LLAMA4_FLAVORS["debugmodel_moe"]
    with torch.device("meta"):
        model = Transformer(args)
    assert (sum(p.numel() for p in model.parameters()), model.active_parameters()) == _hf_counts(args)


def test_scout_rotary_frequencies_match_transformers():
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

    args = LLAMA4_FLAVORS["llama4_scout"]
    theirs = Llama4TextRotaryEmbedding(transformers_config(args)).inv_freq
    ours = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)


@torch.no_grad()
def test_logits_equal_transformers_with_every_llama4_feature():
    hf = tiny_transformers_model()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(1))
    model = weft_from_transformers(hf)
    ours, theirs = model(tokens), hf(tokens).logits
    assert theirs.abs().max() > 1.0  # a random model, not a near-zero one
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@torch.no_grad()
def test_export_gives_transformers_the_same_logits():
    model = weft_from_transformers(tiny_transformers_model(seed=2))
    model.init_weights(seed=3)  # weft's own weights, not transformers' round-tripped
    tokens = torch.randint(0, TINY["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(transformers_from_weft(model)(tokens).logits, model(tokens), rtol=0, atol=1e-5)


def test_the_multimodal_folder_form_reads_as_its_text_model():
    text = tiny_transformers_model().config.to_dict()
    assert model_args_from_hf_config({"model_type": "llama4", "text_config": text}) == model_args_from_hf_config(text)
    assert model_args_from_hf_config(Llama4Config(text_config=text).to_dict()) == model_args_from_hf_config(text)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_experts_per_tok", 5, "num_experts_per_tok is 5; expected 1 to num_local_experts (4)"),
    ("hidden_act", "gelu", "hidden_act is gelu; weft's Llama 4 supports only silu"),
    ("moe_layers", [0, 3], "moe_layers is [0, 3]; weft's Llama 4 supports MoE layers every k-th layer only"),
    ("model_type", "llama", "model_type is llama, not llama4_text or llama4"),
])
def test_unsupported_config_fields_are_refused_in_one_line(field, value, message):
    config = {**tiny_transformers_model().config.to_dict(), field: value}
    with pytest.raises(HFConfigError) as caught:
        model_args_from_hf_config(config)
    assert str(caught.value) == message


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ValueError, match="^top_k 5 must lie in 1..n_experts \\(4\\)$"):
        ModelArgs(n_experts=4, top_k=5)


@torch.no_grad()
def test_hf_folders_load_and_export_with_the_same_logits(tmp_path):
    from safetensors.torch import load_file, save_file

    from weft.components.hf import load_hf_into_model, model_args_from_hf_folder, save_hf_model

    hf = tiny_transformers_model(seed=5)
    hf.save_pretrained(tmp_path / "text")
    # Meta's form: a Llama4ForConditionalGeneration folder, the text model under text_config and
    # its tensors under language_model. (its vision tower left out: weft reads only the text part)
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    (multimodal / "config.json").write_text(Llama4Config(text_config=hf.config.to_dict()).to_json_string())
    save_file({f"language_model.{k}": v for k, v in load_file(tmp_path / "text" / "model.safetensors").items()},
              multimodal / "model.safetensors")
    tokens = torch.randint(0, TINY["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(6))
    expected = hf(tokens).logits
    for folder in (tmp_path / "text", multimodal):
        model = Transformer(model_args_from_hf_folder(folder))
        load_hf_into_model(model, folder)
        torch.testing.assert_close(model.eval()(tokens), expected, rtol=0, atol=1e-5)

    model.init_weights(seed=7)  # weft's own weights, exported and read back by transformers
    save_hf_model(model, tmp_path / "export")
    exported = Llama4ForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").float().eval()
    torch.testing.assert_close(exported(tokens).logits, model(tokens), rtol=0, atol=1e-5)


@torch.no_grad()
def test_packed_documents_equal_each_document_alone():
    # Dense layers only (moe_every beyond the last layer), chunks of 4 and NoPE layers: each packed
    # document, its positions restarting at 0, must see exactly what it sees alone.
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, explicit_head_dim=None, vocab_size=64,
                     dense_hidden_dim=48, expert_hidden_dim=16, n_experts=2, top_k=1, moe_every=3, nope_every=2,
                     attention_chunk_size=4, floor_scale=2, attn_scale=0.5, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    model.init_weights(seed=1)
    lengths = (7, 3, 10)
    docs = [torch.randint(0, 64, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    together = model(packed, positions=positions, document_ids=document_ids)
    torch.testing.assert_close(together, torch.cat([model(doc) for doc in docs], dim=1), rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's chunk and document masks run on CUDA")
def test_cuda_flex_attention_masks_give_the_cpu_logits_and_a_backward():
    hf = tiny_transformers_model()
    model = weft_from_transformers(hf)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    model, tokens = model.cuda(), tokens.cuda()
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        with torch.no_grad():
            chunked = model(tokens)  # rotary layers: a FlexAttention chunk mask; NoPE layers: causal SDPA
            flex = model(tokens, document_ids=torch.zeros_like(tokens))  # every layer through FlexAttention
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.testing.assert_close(chunked.cpu(), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(flex.cpu(), expected, rtol=0, atol=1e-4)
    model.train()(tokens, document_ids=torch.zeros_like(tokens)).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_flops_count_active_parameters_and_chunked_context():
    from weft.components.observe.metrics import flops_per_token

    args = LLAMA4_FLAVORS["debugmodel_moe"]  # layers 0, 2 rotary (chunks of 64), 1, 3 NoPE
    with torch.device("meta"):
        active = Transformer(args).active_parameters()
    matmuls = active - args.vocab_size * args.dim  # the embedding is a lookup
    attention = 12 * args.n_heads * args.head_dim * (64 + 256 + 64 + 256)
    assert flops_per_token(args, active, seq_len=256) == 6 * matmuls + attention
