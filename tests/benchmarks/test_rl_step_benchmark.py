"""benchmarks/rl_step.py reads its split from train.py's own records: generating and scoring as the GRPO
objective timed them inside the step, each part a share of the step, and the tokens it generated."""

import argparse

from benchmarks import rl_step


def test_the_split_is_a_part_of_train_py_s_step():
    args = argparse.Namespace(prompts=2, completion_tokens=4, warmup=0, steps=2, device_args="")
    split = rl_step.step_split("debugmodel", args)
    assert 0 < split["generate"] < split["step"] and 0 <= split["score"] < split["step"] and split["train"] > 0
    assert 1 <= split["length"] <= 4
    assert split["tokens_per_s"] == 8 * split["length"] / split["generate"]
