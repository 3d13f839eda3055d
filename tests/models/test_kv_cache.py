"""weft's KV cache (models/common/kv_cache.py) through `generate`, for every in-repo family: greedy
with the cache equals greedy by full recompute (the whole context through the model for each token),
token for token, on a batch of prompts of different lengths, some longer than a sliding window or a
chunk; each returned log-probability equals log_softmax of a full forward's logits at that token."""

from dataclasses import replace

import pytest
import torch

from weft.generation import SamplingParams, generate
from weft.models.common import kv_cache
from weft.models.gpt_oss import ModelArgs as GptOssArgs
from weft.models.gpt_oss import Transformer as GptOss
from weft.models.llama import ModelArgs as LlamaArgs
from weft.models.llama import Transformer as Llama
from weft.models.llama4 import ModelArgs as Llama4Args
from weft.models.llama4 import Transformer as Llama4
from weft.models.qwen3 import ModelArgs as Qwen3Args
from weft.models.qwen3 import Transformer as Qwen3

QWEN3 = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, dense_hidden_dim=48,
                  max_seq_len=64)
MODELS = {
    "llama": (Llama, LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                               max_seq_len=64)),
    # chunks of 8 on rotary layers, every second layer NoPE with temperature tuning that changes every 4 positions
    "llama4": (Llama4, Llama4Args(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, explicit_head_dim=None, vocab_size=64,
                                  dense_hidden_dim=48, expert_hidden_dim=16, n_experts=4, top_k=2, moe_every=2,
                                  nope_every=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                                  max_seq_len=64)),
    "qwen3": (Qwen3, QWEN3),
    "qwen3_moe": (Qwen3, replace(QWEN3, n_experts=4, top_k=2, moe_hidden_dim=16, norm_topk_prob=True)),
    # sliding windows of 6 beside full layers
    "gpt_oss": (GptOss, GptOssArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64,
                                   n_experts=4, top_k=2, moe_hidden_dim=16, sliding_window=6, max_seq_len=64)),
}
PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32, 38, 4], [2, 7], [18, 28, 18, 28, 45, 9, 4, 5, 2], [61]]


def tiny(name: str):
    model_type, args = MODELS[name]
    torch.manual_seed(0)
    model = model_type(args)
    model.init_weights(seed=1)
    with torch.no_grad():  # sinks and the larger weights make attention and routing matter
        for param_name, param in model.named_parameters():
            if param_name.endswith(("sinks", "expert_bias")) or ".w" in param_name:
                param.normal_(0, 0.3 if param.ndim > 1 else 1.0)
    return model.eval()


@torch.no_grad()
def greedy_by_recompute(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids]))[0, -1].float()
        ids.append(int(logits.argmax()))
        logprobs.append(float(logits.log_softmax(-1)[ids[-1]]))
    return ids[len(prompt):], logprobs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_with_the_cache_equals_greedy_by_recompute(name):
    model = tiny(name)
    out = generate(model, PROMPTS, SamplingParams(max_completion_length=12, temperature=0))
    for prompt, (completion,) in zip(PROMPTS, out):
        tokens, logprobs = greedy_by_recompute(model, prompt, 12)
        assert completion.token_ids == tokens
        torch.testing.assert_close(completion.logprobs, logprobs, atol=1e-5, rtol=0)
    assert len({t for (completion,) in out for t in completion.token_ids}) > 8  # the model does not merely repeat


def test_moe_balancing_state_is_untouched_by_generation():
    model = tiny("qwen3_moe").train()
    counts = {name: buffer.clone() for name, buffer in model.named_buffers() if "tokens_per_expert" in name}
    generate(model, PROMPTS, SamplingParams(max_completion_length=3, temperature=0))
    assert counts and all(torch.equal(buffer, counts[name]) for name, buffer in model.named_buffers() if name in counts)


def test_cache_bytes_counts_what_the_cache_holds():
    for name in ("llama4", "gpt_oss"):
        model = tiny(name)
        cache = kv_cache.start(model, 3, 20)
        try:
            kv_cache.forward(model, torch.ones(3, 5, dtype=torch.long), torch.arange(5).expand(3, -1),
                             torch.ones(3, 5, dtype=torch.bool), cache)
            assert cache.nbytes() == kv_cache.cache_bytes(model.args, 3, 20, 4)
        finally:
            kv_cache.finish(model, cache)
