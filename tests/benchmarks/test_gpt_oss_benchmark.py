"""benchmarks/gpt_oss.py runs on the CPU at a tiny size and times what it says: plain SDPA, sink
attention over the window and the whole past, and a sliding and a full block; its sink check
(values and gradients against the plain formula) passes on the CPU path."""

import torch

from weft.benchmarks.gpt_oss import check_sinks, main


def test_the_benchmark_times_attention_and_both_kinds_of_block(capsys):
    results = main(["--seq", "64", "--warmup", "0", "--repeats", "1"])
    assert set(results) == {"attention: plain causal SDPA", "attention: sinks, window 32", "attention: sinks, full",
                            "block: window 32", "block: full"}
    assert all(seconds > 0 for seconds in results.values())
    assert "block: window 32" in capsys.readouterr().out


def test_the_sink_check_finds_the_cpu_path_equal_to_the_plain_formula():
    differences = check_sinks(torch.device("cpu"))
    assert set(differences) == {"out", "q", "k", "v", "sinks"} and max(differences.values()) < 1e-5
