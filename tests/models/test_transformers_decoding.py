"""The transformers backend's decoding (models/transformers/decoding.py) through `generate`: batched
greedy completions of tiny models of several families, built here, equal transformers' own
`generate(do_sample=False)` on the same left-padded batch, token for token, stop at EOS included."""

import pytest
import torch

from weft.generation import SamplingParams, generate
from weft.models import TRANSFORMERS_SPEC
from weft.models.transformers.args import args_from_hf_config

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=8),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=6),  # prompts longer than the window
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SHAPE),  # families weft has no code of
    "olmo2": lambda: transformers.Olmo2Config(**SHAPE),
}
PROMPTS = [[5, 17, 33, 8, 61, 9, 12, 40, 3, 27, 11], [7, 50], [44, 19, 23, 90, 6], [13]]


def tiny(family: str):
    """A random transformers model of `family`, built as the backend builds a folder's (with its `.args`)."""
    torch.manual_seed(0)
    model = TRANSFORMERS_SPEC.build(args_from_hf_config(CONFIGS[family]().to_dict()))
    with torch.no_grad():  # larger weights: completions that vary and reach EOS sometimes
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_batched_greedy_equals_transformers_generate(family):
    model = tiny(family)
    steps = 10
    longest = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in PROMPTS])

    def hf_generate(eos: int) -> list[list[int]]:
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                                  min_new_tokens=0, eos_token_id=eos, pad_token_id=0)[:, longest:].tolist()

    eos = hf_generate(eos=95)[0][4]  # a token the first row draws: the EOS that stops it, and maybe others
    expected = hf_generate(eos)
    out = generate(model, PROMPTS, SamplingParams(max_completion_length=steps, temperature=0), stop_token_ids={eos})
    for (completion,), row in zip(out, expected):
        assert completion.token_ids == row[:len(completion.token_ids)]
        assert row[len(completion.token_ids):] == [0] * (len(row) - len(completion.token_ids))  # padding after EOS
        assert completion.finish_reason == ("stop" if completion.token_ids[-1] == eos else "length")
    assert out[0][0].finish_reason == "stop" and len(out[0][0].token_ids) <= 5
    assert any(c.finish_reason == "length" for (c,) in out)
    assert len({t for (c,) in out for t in c.token_ids}) > 6


def test_the_log_probabilities_are_a_full_forward_s():
    model = tiny("qwen3")
    ((completion,),) = generate(model, [PROMPTS[0]], SamplingParams(max_completion_length=6, temperature=0.8, seed=2))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + completion.token_ids])).logits[0, len(PROMPTS[0]) - 1:-1]
    expected = (logits / 0.8).log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)
