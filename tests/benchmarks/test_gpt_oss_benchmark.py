"""benchmarks/gpt_oss.py runs on the CPU at a tiny size and times what it says: plain SDPA, sink
attention over the window and the whole past, and a sliding and a full block."""

from weft.benchmarks.gpt_oss import main


def test_the_benchmark_times_attention_and_both_kinds_of_block(capsys):
    results = main(["--seq", "64", "--warmup", "0", "--repeats", "1"])
    assert set(results) == {"attention: plain causal SDPA", "attention: sinks, window 32", "attention: sinks, full",
                            "block: window 32", "block: full"}
    assert all(seconds > 0 for seconds in results.values())
    assert "block: window 32" in capsys.readouterr().out
