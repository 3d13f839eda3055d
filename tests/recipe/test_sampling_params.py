"""[sampling] read into the engine's SamplingParams, key by key."""

from dataclasses import fields

from weft.components.config import Sampling, parse_args
from weft.generation import SamplingParams
from weft.recipe.config_keys import sampling_params


def test_every_sampling_key_reaches_the_engine():
    assert [f.name for f in fields(Sampling)] == [f.name for f in fields(SamplingParams)]
    cfg = parse_args(["--sampling.max_completion_length", "12", "--sampling.temperature", "0.7", "--sampling.top_p",
                      "0.9", "--sampling.top_k", "5", "--sampling.min_p", "0.1", "--sampling.seed", "3",
                      "--sampling.stop", "END,###"])
    assert sampling_params(cfg) == SamplingParams(max_completion_length=12, temperature=0.7, top_p=0.9, top_k=5,
                                                  min_p=0.1, seed=3, stop=("END", "###"))
    assert sampling_params(parse_args([])) == SamplingParams()  # the same defaults
