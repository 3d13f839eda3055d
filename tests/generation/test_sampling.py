"""Sampling options and one step's draw: each filter against a plain per-row computation, the
log-probabilities against log_softmax, the per-completion generators."""

import math
import re

import pytest
import torch

from weft.generation.sampling import SamplingParams, completion_generator, filter_logits, next_tokens


@pytest.mark.parametrize("field, value", [("max_completion_length", 0), ("temperature", -0.5),
                                          ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.5),
                                          ("top_k", -1), ("min_p", 1.2), ("seed", -3), ("stop", ("",)),
                                          ("stop", ["x"])])
def test_a_bad_option_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=re.escape(f"sampling {field} must be ") + ".*" + re.escape(f"got {value!r}")):
        SamplingParams(**{field: value})


def _logits(rows=5, vocab=40):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3


def _kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def test_top_k_keeps_the_k_largest():
    logits = _logits()
    kept = _kept(filter_logits(logits, SamplingParams(temperature=0.7, top_k=6)))
    assert kept == [set(sorted(range(40), key=lambda t: -row[t])[:6]) for row in logits.tolist()]


def test_top_p_keeps_the_smallest_head_reaching_p():
    logits = _logits()
    expected = []
    for row in (logits / 0.7).softmax(-1).tolist():
        head, mass = set(), 0.0
        for token in sorted(range(40), key=lambda t: -row[t]):
            if mass >= 0.8:
                break
            head.add(token)
            mass += row[token]
        expected.append(head)
    assert _kept(filter_logits(logits, SamplingParams(temperature=0.7, top_p=0.8))) == expected


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = _logits()
    probs = (logits / 1.3).softmax(-1).tolist()
    expected = [{t for t in range(40) if row[t] >= 0.1 * max(row)} for row in probs]
    assert _kept(filter_logits(logits, SamplingParams(temperature=1.3, min_p=0.1))) == expected


def test_filters_compose_top_k_then_top_p_then_min_p():
    logits = _logits()
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05)
    by_steps = filter_logits(filter_logits(filter_logits(logits, SamplingParams(temperature=0.9, top_k=10)),
                                           SamplingParams(temperature=1.0, top_p=0.9)),
                             SamplingParams(temperature=1.0, min_p=0.05))
    assert _kept(filter_logits(logits, params)) == _kept(by_steps)


def test_the_log_probability_is_of_the_unfiltered_tempered_softmax():
    logits = _logits()
    params = SamplingParams(temperature=0.6, top_k=3)
    generators = [completion_generator(0, i, 0) for i in range(5)]
    tokens, logprobs = next_tokens(logits, params, generators)
    expected = (logits / 0.6).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected)
    assert all(t in kept for t, kept in zip(tokens.tolist(), _kept(filter_logits(logits, params))))
    greedy, greedy_logprobs = next_tokens(logits, SamplingParams(temperature=0), generators)
    assert greedy.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(greedy_logprobs, logits.log_softmax(-1).amax(-1))


def test_each_completion_has_its_own_reproducible_generator():
    draws = {key: torch.rand(4, generator=completion_generator(*key)).tolist()
             for key in [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]}
    assert torch.rand(4, generator=completion_generator(0, 0, 0)).tolist() == draws[0, 0, 0]
    assert len({tuple(d) for d in draws.values()}) == 4
