"""The MoE layer against plain per-token math, and its grouped multiply against a per-expert loop."""

import math

import pytest
import torch
import torch.nn.functional as F

from weft.models.common import moe as moe_module
from weft.models.common.moe import MoE, load_balance_loss, route


def moe(score_func="sigmoid", score_before_experts=True, dtype=torch.float32) -> MoE:
    torch.manual_seed(0)
    layer = MoE(16, 32, n_experts=4, top_k=2, shared_hidden_dim=24, score_func=score_func,
                score_before_experts=score_before_experts)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.to(dtype)


def reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through the experts it chose, one token and one expert at a time."""
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = layer.router.weight @ token
        chosen = (logits + layer.expert_bias).topk(layer.top_k).indices  # the bias picks, never weighs
        probabilities = torch.sigmoid(logits) if layer.score_func == "sigmoid" else logits.softmax(-1)
        scores = probabilities[chosen]
        y = layer.shared_expert(token)
        for e, s in zip(chosen.tolist(), scores):
            w1, w2, w3 = layer.experts.w1[e], layer.experts.w2[e], layer.experts.w3[e]
            inp = s * token if layer.score_before_experts else token
            expert = w2 @ (F.silu(w1 @ inp) * (w3 @ inp))
            y = y + (expert if layer.score_before_experts else s * expert)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("score_before_experts", [True, False])
def test_routed_output_equals_per_token_math(score_func, score_before_experts):
    layer = moe(score_func, score_before_experts)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_multiply_equals_the_per_expert_loop_forward_and_backward(dtype, monkeypatch):
    layer, x = moe(dtype=dtype), torch.randn(3, 7, 16, dtype=dtype)
    grad = torch.randn(3, 7, 16, dtype=dtype)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(moe_module, "grouped_mm_applies", lambda x, w1, g=grouped: g)
        layer.zero_grad()
        x_ = x.clone().requires_grad_()
        out = layer(x_)
        out.backward(grad)
        results.append([out, x_.grad, *(p.grad for p in layer.experts.parameters())])
    for grouped, looped in zip(*results):
        torch.testing.assert_close(grouped, looped, rtol=0, atol=0)


def test_the_routing_bias_changes_the_choice_not_the_weights():
    """A bias that sends every token to expert 3 (among its top 2): the output is the per-token
    math with that choice and the unbiased scores."""
    layer = moe()
    x = torch.randn(2, 5, 16)
    unbiased = route(layer.router(x.reshape(-1, 16)), 2, "sigmoid")[1]
    with torch.no_grad():
        layer.expert_bias[3] = 100.0
    chosen = route(layer.router(x.reshape(-1, 16)), 2, "sigmoid", layer.expert_bias)[1]
    assert (chosen == 3).any(-1).all() and not (unbiased == 3).any(-1).all()
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-5, atol=1e-5)


def test_each_training_forward_counts_the_tokens_per_expert_and_eval_forwards_do_not():
    layer, x = moe(), torch.randn(3, 7, 16)
    chosen = route(layer.router(x.reshape(-1, 16)), 2, "sigmoid")[1]
    layer(x)
    layer(x)
    layer.eval()(torch.randn(3, 7, 16))  # validation: not the step's tokens
    assert torch.equal(layer.tokens_per_expert, 2 * torch.bincount(chosen.flatten(), minlength=4).float())


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"^top_k 5 must lie in 1..n_experts \(4\)$"):
        MoE(16, 32, n_experts=4, top_k=5)


def test_experts_under_autocast_compute_in_its_dtype_as_a_linear_would():
    """autocast does not know `_grouped_mm`: the experts cast as it casts a Linear (bf16 operands,
    bf16 result), and equal the per-token math on the bf16-rounded tokens and weights."""
    layer, x = moe(), torch.randn(2, 5, 16)
    counts = torch.tensor([4, 0, 3, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer.experts(x.reshape(-1, 16), counts)
    assert out.dtype == torch.bfloat16
    bf16 = layer.experts.to(torch.bfloat16)
    expected = torch.cat([F.linear(F.silu(F.linear(p, bf16.w1[e])) * F.linear(p, bf16.w3[e]), bf16.w2[e])
                          for e, p in enumerate(x.reshape(-1, 16).bfloat16().split(counts.tolist()))])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_load_balance_loss_is_switch_transformers_formula(score_func):
    """n_experts · Σ_i f_i · P_i computed token by token: f_i the share of the top-k choices that
    went to expert i, P_i the mean normalised router probability."""
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    experts = logits.topk(2).indices
    choices, probability_sums = [0.0] * 4, [0.0] * 4
    for token_logits, token_experts in zip(logits, experts):
        if score_func == "softmax":
            probabilities = [float(v) for v in token_logits.softmax(-1)]
        else:
            scores = [1 / (1 + math.exp(-float(v))) for v in token_logits]
            probabilities = [v / sum(scores) for v in scores]
        for i in range(4):
            probability_sums[i] += probabilities[i] / 6
        for e in token_experts.tolist():
            choices[e] += 1 / 12
    expected = 4 * sum(f * p for f, p in zip(choices, probability_sums))
    assert load_balance_loss(logits, experts, score_func).item() == pytest.approx(expected, rel=1e-6)


def test_the_load_balance_loss_reaches_the_router_as_if_added_to_the_loss():
    """With load_balance_coeff c the layer's backward gives every weight the gradient of
    loss + c · load_balance_loss; in eval, or with c = 0, nothing is added."""
    x = torch.randn(3, 7, 16)
    with_aux, plain = moe(), moe()
    with_aux.load_balance_coeff = 0.5
    with_aux(x).square().sum().backward()
    logits = plain.router(x.reshape(-1, 16))
    experts = route(logits, 2, "sigmoid")[1]
    (plain(x).square().sum() + 0.5 * load_balance_loss(logits, experts, "sigmoid")).backward()
    for (name, a), b in zip(with_aux.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert plain.router.weight.grad.abs().sum() > 0
    with_aux.eval()
    torch.testing.assert_close(with_aux(x), plain.eval()(x), rtol=0, atol=0)


def test_the_masked_form_compile_uses_equals_the_loop():
    """Compiled in float32 (no grouped multiply there), every expert runs on every row, masked."""
    layer, x = moe(), torch.randn(10, 16)
    counts = torch.tensor([3, 0, 5, 2])
    results = []
    for form in (moe_module.masked, moe_module.loop):
        layer.zero_grad()
        x_ = x.clone().requires_grad_()
        out = form(x_, counts, *(p for p in layer.experts.parameters()))
        out.square().sum().backward()
        results.append([out, x_.grad, *(p.grad for p in layer.experts.parameters())])
    for masked, looped in zip(*results):  # the same math; a matmul over more rows rounds a little apart
        torch.testing.assert_close(masked, looped, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_form_equals_per_token_math(norm_topk_prob):
    """Qwen3-MoE's layer: softmax over all experts, the top_k probabilities divided by their sum
    where `norm_topk_prob` (else kept), each chosen expert's output weighed by its score, no shared
    expert."""
    torch.manual_seed(0)
    layer = MoE(16, 32, n_experts=4, top_k=2, score_func="softmax", score_before_experts=False,
                norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 5, 16)
    expected = []
    for token in x.reshape(-1, 16):
        probabilities = (layer.router.weight @ token).softmax(-1)
        scores, chosen = probabilities.topk(2)
        if norm_topk_prob:
            scores = scores / scores.sum()
        w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
        expected.append(sum(s * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token))) for e, s in zip(chosen.tolist(), scores)))
    torch.testing.assert_close(layer(x), torch.stack(expected).view_as(x), rtol=1e-5, atol=1e-5)
    scores = route(layer.router(x.reshape(-1, 16)), 2, "softmax", norm_topk_prob=norm_topk_prob)[0]
    assert torch.allclose(scores.sum(-1), torch.ones(10)) == norm_topk_prob
