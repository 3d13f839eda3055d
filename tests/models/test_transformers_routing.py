"""models/transformers/routing.py: a transformers MoE model's routers count the tokens each expert
gets (weft's routing metrics), as an independent count of the top-k indices transformers hands its
experts module finds, in training only, without changing the model's logits."""

from __future__ import annotations

import pytest
import torch

from weft.components.training.moe_balance import balance_experts
from weft.models.transformers.routing import count_routed_tokens

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, num_experts_per_tok=2)
MOE = {**SHAPE, "n_routed_experts": 8, "moe_intermediate_size": 16, "n_shared_experts": 1}
CONFIGS = {  # two MoE layers each: grouped sigmoid routing with its bias, sigmoid routing, softmax after top-k
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**MOE, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                                         qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
                                                         first_k_dense_replace=0),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**MOE, head_dim=8, first_k_dense_replace=0),
    "gpt_oss": lambda: transformers.GptOssConfig(**SHAPE, head_dim=8, num_local_experts=8),
}
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_routers_count_the_experts_transformers_sends_each_token_to(family):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # as a trained model's: the bias moves the choice
            buffer.copy_(0.01 * torch.randn(buffer.shape))
    # the independent count: the top-k indices each MoE layer hands its experts module (its 2nd argument)
    experts = [module for name, module in model.named_modules() if name.endswith("mlp.experts")]
    sent = {id(module): torch.zeros(8, dtype=torch.long) for module in experts}
    def record(module, args):
        sent[id(module)] += torch.bincount(args[1].flatten(), minlength=8)

    for module in experts:
        module.register_forward_pre_hook(record)
    with torch.no_grad():
        plain = model(TOKENS).logits
        count_routed_tokens(model, "cpu")
        model.eval()
        model(TOKENS)  # validation's tokens are not counted
        assert not any(router.tokens_per_expert.any() for router in _counting(model))
        model.train()
        for counts in sent.values():
            counts.zero_()
        counted = model(TOKENS).logits
    torch.testing.assert_close(counted, plain, rtol=0, atol=0)  # the routing is transformers' own
    routers = _counting(model)
    assert len(routers) == len(experts) == 2
    expected = [sent[id(module)].float() for module in experts]
    for router, want in zip(routers, expected):
        assert torch.equal(router.tokens_per_expert, want) and want.sum() == TOKENS.numel() * 2
    imbalance = balance_experts(model, rate=0.1)  # the log's moe/imbalance/<router>; a rate moves no router
    assert list(imbalance) == [name for name, module in model.named_modules() if module in routers]
    assert list(imbalance.values()) == pytest.approx([(w.max() / w.mean()).item() for w in expected])
    assert not any(router.tokens_per_expert.any() for router in routers)  # read and reset each step
    torch.testing.assert_close(model(TOKENS).logits, plain, rtol=0, atol=0)


def _counting(model):
    return [module for module in model.modules() if hasattr(module, "tokens_per_expert")]


def test_a_router_of_another_output_is_left_uncounted(caplog):
    """Llama 4's router returns (scores, logits), no top-k indices: its layers log no imbalance
    rather than a wrong one, and the model runs on."""
    config = transformers.Llama4TextConfig(**{**SHAPE, "num_experts_per_tok": 1}, head_dim=8, intermediate_size_mlp=64,
                                           num_local_experts=4)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    count_routed_tokens(model, "cpu")
    assert len(_counting(model)) == 2
    with torch.no_grad():
        model(TOKENS)
    assert _counting(model) == [] and balance_experts(model, rate=0.0) == {}
    assert "Llama4Router does not return (logits, weights, top-k indices)" in caplog.text
