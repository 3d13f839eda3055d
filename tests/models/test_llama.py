import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from weft.models.common.rotary import apply_rotary_emb, rope_frequencies, rope_rotations
from weft.models.llama import LLAMA_FLAVORS, ModelArgs, RopeScaling, Transformer

# Parameter counts of the published checkpoints (Hugging Face model cards / safetensors indexes).
PUBLISHED_PARAMETER_COUNTS = {
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama2_70b": 68_976_648_192,
    "llama3_1b": 1_235_814_400,
    "llama3_3b": 3_212_749_824,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)


def count_parameters(args: ModelArgs) -> int:
    with torch.device("meta"):
        model = Transformer(args)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_PARAMETER_COUNTS))
def test_parameter_count_matches_published_model(flavor):
    assert count_parameters(LLAMA_FLAVORS[flavor]) == PUBLISHED_PARAMETER_COUNTS[flavor]


def test_debugmodel_parameter_count_by_formula():
    a = LLAMA_FLAVORS["debugmodel"]
    hidden = a.ffn_hidden_dim
    per_block = 2 * a.dim * a.dim + 2 * a.dim * a.kv_heads * a.head_dim + 3 * a.dim * hidden + 2 * a.dim
    expected = 2 * a.vocab_size * a.dim + a.n_layers * per_block + a.dim
    assert count_parameters(a) == expected


def test_llama31_rope_scaling_matches_closed_form():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    got = rope_frequencies(128, 500000.0, scaling)
    for i, freq in enumerate(got.tolist()):
        base = 500000.0 ** (-2 * i / 128)
        wavelen = 2 * math.pi / base
        if wavelen < 8192 / 4.0:
            want = base
        elif wavelen > 8192 / 1.0:
            want = base / 8.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * base / 8.0 + smooth * base
        assert freq == pytest.approx(want, rel=1e-12)
    # All three regimes are exercised at Llama 3.1's settings.
    unscaled = rope_frequencies(128, 500000.0)
    ratios = (unscaled / got).tolist()
    assert min(ratios) == pytest.approx(1.0) and max(ratios) == pytest.approx(8.0)
    assert any(1.01 < r < 7.99 for r in ratios)


def rotary_by_cos_sin(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The rotation of each channel pair written out in real numbers, in float64:
    (a, b) -> (a cos θ - b sin θ, a sin θ + b cos θ); angles: [seq, head_dim/2]."""
    a, b = x.double().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = angles.double().cos()[:, None], angles.double().sin()[:, None]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def test_rotary_embedding_matches_cos_sin_formula():
    torch.manual_seed(0)
    args = replace(TINY, max_seq_len=512)
    x = torch.randn(2, 512, 3, args.head_dim)
    angles = torch.outer(torch.arange(512, dtype=torch.float64), rope_frequencies(args.head_dim, args.rope_theta))
    got = apply_rotary_emb(x, rope_rotations(args))
    torch.testing.assert_close(got.double(), rotary_by_cos_sin(x, angles), rtol=0, atol=1e-6)
    # bf16 in, bf16 out: the rotation itself runs in float32.
    got_bf16 = apply_rotary_emb(x.bfloat16(), rope_rotations(args))
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16, rotary_by_cos_sin(x.bfloat16(), angles).bfloat16(), rtol=2**-8, atol=0)


def test_rotations_are_unit_complex_numbers_at_llama31_angles():
    args = LLAMA_FLAVORS["llama3_8b"]
    rotations = rope_rotations(replace(args, max_seq_len=1024))
    assert rotations.dtype == torch.complex64 and rotations.shape == (1024, args.head_dim // 2)
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(1024, dtype=torch.float64), freqs)
    torch.testing.assert_close(torch.view_as_real(rotations).double(),
                               torch.stack((angles.cos(), angles.sin()), -1), rtol=0, atol=1e-7)


def reference_forward(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The Llama forward written out with plain tensor math and explicit head repetition."""
    a = model.args
    seq = tokens.shape[1]
    freqs = rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling).float()
    rot = torch.polar(torch.ones(seq, a.head_dim // 2), torch.outer(torch.arange(seq).float(), freqs))

    def rope(t):
        return torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (-1, 2))) * rot[None, :, None]).flatten(-2)

    def rmsnorm(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + a.norm_eps) * w

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = model.tok_embeddings.weight[tokens]
    for block in model.layers.values():
        att = block.attention
        x = rmsnorm(h, block.attention_norm.weight)
        q = rope((x @ att.wq.weight.T).unflatten(-1, (a.n_heads, a.head_dim)))
        k = rope((x @ att.wk.weight.T).unflatten(-1, (a.kv_heads, a.head_dim)))
        v = (x @ att.wv.weight.T).unflatten(-1, (a.kv_heads, a.head_dim))
        repeat = a.n_heads // a.kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(a.head_dim) + mask
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).flatten(-2)
        h = h + out @ att.wo.weight.T
        ff = block.feed_forward
        x = rmsnorm(h, block.ffn_norm.weight)
        h = h + (F.silu(x @ ff.w1.weight.T) * (x @ ff.w3.weight.T)) @ ff.w2.weight.T
    return rmsnorm(h, model.norm.weight) @ model.output.weight.T


@pytest.mark.parametrize("args", [TINY, replace(TINY, n_kv_heads=None), replace(TINY, tie_embeddings=True)])
def test_forward_matches_plain_math(args):
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=3)
    tokens = torch.randint(0, args.vocab_size, (2, 11))
    torch.testing.assert_close(model(tokens), reference_forward(model, tokens), rtol=1e-4, atol=1e-5)


def test_positions_select_rotary_angles():
    model = Transformer(TINY)
    model.init_weights()
    tokens = torch.randint(0, TINY.vocab_size, (1, 9))
    full = model(tokens)
    # Explicit default positions give the same result, and per-batch positions broadcast.
    torch.testing.assert_close(model(tokens, torch.arange(9)), full)
    torch.testing.assert_close(model(tokens, torch.arange(9)[None]), full)


def test_init_is_seeded_per_parameter_and_ignores_order():
    a, b = Transformer(TINY), Transformer(TINY)
    a.init_weights(seed=7)
    torch.manual_seed(1234)  # the global RNG plays no part
    b.init_weights(seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    c = Transformer(TINY)
    c.init_weights(seed=8)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_init_statistics():
    args = LLAMA_FLAVORS["debugmodel"]
    model = Transformer(args)
    model.init_weights(seed=0)
    wq = model.layers["0"].attention.wq.weight
    assert wq.std().item() == pytest.approx(0.02 * 0.987, rel=0.03)  # truncation at 3σ shrinks std by 1.3%
    assert wq.abs().max().item() <= 3 * 0.02
    wo = model.layers["0"].attention.wo.weight
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(2 * args.n_layers) * 0.987, rel=0.03)
    assert torch.equal(model.norm.weight, torch.ones(args.dim))


def test_meta_build_then_materialise_equals_direct_build():
    direct = Transformer(TINY)
    direct.init_weights(seed=5)
    with torch.device("meta"):
        lazy = Transformer(TINY)
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=5)
    tokens = torch.randint(0, TINY.vocab_size, (2, 7))
    assert torch.equal(direct(tokens), lazy(tokens))


def test_invalid_head_layout_is_rejected():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)


# -- packed documents: one mask per micro-batch ------------------------------------------------

PACKED = replace(TINY, n_layers=4)


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions and document ids of two rows of packed documents (lengths 10+30+8, 48)."""
    tokens = torch.randint(0, PACKED.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 10 + [1] * 30 + [2] * 8, [0] * 48])
    starts = torch.tensor([[0] * 10 + [10] * 30 + [40] * 8, [0] * 48])
    return tokens, torch.arange(48).expand(2, 48) - starts, docs


def per_block_mask_forward(model: Transformer, tokens, positions, docs) -> torch.Tensor:
    """The model with each block masking for itself from the document ids (SDPA, dense mask)."""
    rotations = model.rope_rotations[positions]
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, rotations, document_ids=docs)
    return model.output(model.norm(h))


def test_document_mask_is_built_once_per_micro_batch_outside_the_blocks(monkeypatch):
    """4 blocks, forward and a full activation-checkpoint backward: one mask, built by
    Transformer.forward itself (not by a block, nor by recompute), and the same logits as each
    block masking for itself."""
    import sys

    from weft.layers import attention as attention_core
    from weft.parallelisms.ac import ACOptions, apply_ac

    built, original = [], attention_core.document_mask

    def counting(document_ids, *, flex):
        caller = sys._getframe(2)  # the core's document_mask is called by ...
        built.append((caller.f_code.co_name, type(caller.f_locals.get("self")).__name__, flex))
        return original(document_ids, flex=flex)

    monkeypatch.setattr(attention_core, "document_mask", counting)
    model = Transformer(PACKED)
    model.init_weights(seed=0)
    tokens, positions, docs = packed_batch()
    with torch.no_grad():
        reference = per_block_mask_forward(model, tokens, positions, docs)
    apply_ac(model, ACOptions("full"))
    logits = model(tokens, positions, document_ids=docs)
    logits.sum().backward()
    assert built == [("forward", "Transformer", False)]
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)


def test_flex_attention_block_mask_path_equals_the_dense_mask_path(monkeypatch):
    """The CUDA path (one FlexAttention BlockMask per micro-batch) through the whole model, forward
    only on the CPU (FlexAttention has no CPU backward in torch 2.13), against the dense SDPA path."""
    from torch.nn.attention.flex_attention import BlockMask

    from weft.layers import attention as attention_core

    assert attention_core.use_flex_attention(torch.device("cuda", 0))
    assert not attention_core.use_flex_attention(torch.device("cpu"))
    model = Transformer(PACKED)
    model.init_weights(seed=0)
    tokens, positions, docs = packed_batch()
    assert isinstance(attention_core.document_mask(docs, flex=True), BlockMask)
    with torch.no_grad():
        dense = model(tokens, positions, document_ids=docs)
        monkeypatch.setattr(attention_core, "use_flex_attention", lambda device: True)
        flex = model(tokens, positions, document_ids=docs)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward and the compiled block mask need CUDA")
def test_flex_attention_on_cuda_trains_like_the_dense_mask(monkeypatch):
    """On a GPU: forward and backward through the BlockMask path equal the dense SDPA mask path."""
    from weft.layers import attention as attention_core

    model = Transformer(PACKED).cuda()
    model.init_weights(seed=0)
    tokens, positions, docs = (t.cuda() for t in packed_batch())

    def logits_and_grads():
        model.zero_grad()
        logits = model(tokens, positions, document_ids=docs)
        logits.float().square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    flex, flex_grads = logits_and_grads()
    monkeypatch.setattr(attention_core, "use_flex_attention", lambda device: False)
    dense, dense_grads = logits_and_grads()
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
    for a, b in zip(flex_grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
