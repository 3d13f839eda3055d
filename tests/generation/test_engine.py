"""`generate` on a tiny Llama: greedy and seeded sampling against a plain loop that recomputes the
whole context for each token; completions independent of their batch; finish reasons; bad
arguments; the model left as it was."""

import pytest
import torch

from weft.generation import Completion, GenerationError, SamplingParams, generate
from weft.generation.sampling import completion_generator, filter_logits
from weft.layers.attention import CausalAttention
from weft.models.llama import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [40]]


@pytest.fixture(scope="module")
def model():
    model = Transformer(ARGS).double()
    model.init_weights(seed=3)
    return model


@torch.no_grad()
def recompute(model, prompt, params, generator, stop_ids=()):
    """The plain reference: the whole context through the model for every new token."""
    ids, logprobs = list(prompt), []
    for _ in range(params.max_completion_length):
        logits = model(torch.tensor([ids]))[0, -1].float()
        if params.temperature == 0:
            token, tempered = int(logits.argmax()), logits
        else:
            probs = filter_logits(logits[None], params).softmax(-1)[0]
            token, tempered = int(torch.multinomial(probs, 1, generator=generator)), logits / params.temperature
        ids.append(token)
        logprobs.append(float(tempered.log_softmax(-1)[token]))
        if token in stop_ids:
            break
    return ids[len(prompt):], logprobs


@pytest.mark.parametrize("params", [SamplingParams(max_completion_length=9, temperature=0),
                                    SamplingParams(max_completion_length=9, temperature=1.3, top_k=20, top_p=0.95,
                                                   min_p=0.01, seed=5)])
def test_completions_equal_a_plain_recomputing_loop(model, params):
    out = generate(model, PROMPTS, params, n=2)
    for p, prompt in enumerate(PROMPTS):
        for j in range(2):
            tokens, logprobs = recompute(model, prompt, params, completion_generator(params.seed, p, j))
            assert out[p][j].token_ids == tokens
            assert out[p][j].finish_reason == "length"
            torch.testing.assert_close(out[p][j].logprobs, logprobs, atol=1e-5, rtol=0)


def test_a_seeded_completion_does_not_depend_on_its_batch(model):
    params = SamplingParams(max_completion_length=8, temperature=1.0, seed=11)
    together = generate(model, PROMPTS, params, n=3)
    alone = generate(model, [PROMPTS[2]], params, n=3, prompt_indices=[2])
    small = generate(model, PROMPTS, params, n=3, max_batch_sequences=2)
    by_tokens = generate(model, PROMPTS, params, n=3, max_batch_tokens=40)
    assert alone[0] == together[2]
    assert [[c.token_ids for c in cs] for cs in small] == [[c.token_ids for c in cs] for cs in together]
    assert [[c.token_ids for c in cs] for cs in by_tokens] == [[c.token_ids for c in cs] for cs in together]
    assert together[0][0].token_ids != together[0][1].token_ids  # each completion its own draws


def test_finish_reasons_stop_token_stop_string_and_length(model):
    greedy = SamplingParams(max_completion_length=8, temperature=0)
    (free,), (other,) = generate(model, [PROMPTS[0], PROMPTS[3]], greedy)
    token = next(t for t in free.token_ids[1:] if t not in other.token_ids)  # stops the first row only
    first = free.token_ids.index(token)
    (stopped,), (unchanged,) = generate(model, [PROMPTS[0], PROMPTS[3]], greedy, stop_token_ids={token})
    assert stopped == Completion(free.token_ids[:first + 1], free.logprobs[:first + 1], "stop")
    assert unchanged == other  # the other row runs on to its length
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    with_stop = SamplingParams(max_completion_length=8, temperature=0, stop=(f"<{free.token_ids[2]}><{free.token_ids[3]}>",))
    ((by_string,),) = generate(model, [PROMPTS[0]], with_stop, decode=decode)
    assert by_string.token_ids == free.token_ids[:4] and by_string.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 8


def test_the_model_is_left_as_it_was(model):
    model.train()
    before = {name: type(module) for name, module in model.named_modules()}
    generate(model, [[1, 2]], SamplingParams(max_completion_length=3, temperature=0))
    assert model.training and {name: type(module) for name, module in model.named_modules()} == before
    assert all(type(layer.attention.core) is CausalAttention for layer in model.layers.values())
    assert not model.norm._forward_pre_hooks


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1], []]), "prompt 1 is empty"),
    (dict(prompts=[[1] * 60]), "prompt 0 has 60 tokens; with max_completion_length 8 that is 68 positions, beyond "
                               "the model's max_seq_len 64"),
    (dict(prompts=[[1, 97]]), r"prompt 0 holds token id 97, outside the vocabulary \[0, 97\)"),
    (dict(n=0), "n must be an integer >= 1, got 0"),
    (dict(max_batch_sequences=0), "max_batch_sequences must be an integer >= 1, got 0"),
    (dict(max_batch_tokens=12), "max_batch_tokens 12 cannot hold prompt 0 .5 tokens. plus max_completion_length 8"),
    (dict(params=SamplingParams(max_completion_length=8, stop=("x",))), r"stop strings \['x'\] need decode"),
    (dict(prompt_indices=[0, 1]), "prompt_indices has 2 entries; expected one per prompt .1."),
])
def test_bad_arguments_are_refused_in_one_line(model, kwargs, message):
    call = dict(prompts=[[1, 2, 3, 4, 5]], params=SamplingParams(max_completion_length=8)) | kwargs
    with pytest.raises(GenerationError, match=message):
        generate(model, call.pop("prompts"), call.pop("params"), **call)


@pytest.mark.slow
def test_the_compiled_decode_step_equals_eager_and_compiles_once():
    """torch.compile of the decode step: every step has the same shapes, so one graph serves them all."""
    import torch._dynamo

    model = Transformer(ARGS)
    model.init_weights(seed=3)
    params = SamplingParams(max_completion_length=8, temperature=0)
    eager = generate(model, PROMPTS, params)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = generate(model, PROMPTS, params, compile=True)
    assert [[c.token_ids for c in cs] for cs in compiled] == [[c.token_ids for c in cs] for cs in eager]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
