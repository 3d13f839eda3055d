"""The collectives of one training step match what the parallel plan predicts (benchmarks/comm.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.comm import ARGS, Key, Layout, Traffic, block_weights, compare, fsdp_unit_bytes, measure, theory
from weft.models.llama import ModelArgs

from tests.support.dist_utils import run_distributed

# A vocabulary of 2047 rows splits 1024 + 1023 over 2 ranks: FSDP2 pads the short shard.
UNEVEN = replace(ARGS, vocab_size=2047)

# The 2-rank cases share one set of processes: starting them costs more than a step.
TWO_RANK_CASES: list[tuple[str, Layout, ModelArgs]] = [
    ("fsdp 2", Layout(dp_shard=2, tp=1), ARGS),
    ("tp 2", Layout(dp_shard=1, tp=2), ARGS),
    ("fsdp 2, padded shards", Layout(dp_shard=2, tp=1, reshard_after_forward="never"), UNEVEN),
]


def measure_cases(cases: list[tuple[Layout, ModelArgs]]) -> list[dict[Key, Traffic]]:
    """Worker: measure one step of each case in turn, in this process group."""
    return [measure(layout, args) for layout, args in cases]


@pytest.fixture(scope="module")
def two_rank_measurements() -> list[list[dict[Key, Traffic]]]:
    """[rank][case] -> measured traffic."""
    return run_distributed(measure_cases, 2, [(layout, args) for _, layout, args in TWO_RANK_CASES])


def assert_matches_theory(per_rank: list[dict[Key, Traffic]], layout: Layout, args: ModelArgs,
                          exact: bool = False) -> None:
    """Same counts, bytes within the benchmark's 5% (or equal), and no collective the theory lacks."""
    expected = theory(layout, args)
    for rank, measured in enumerate(per_rank):
        for row in compare(measured, expected):
            assert row.expected is not None, f"rank {rank}: unexpected collective {row.key} {row.measured}"
            assert row.ok, f"rank {rank}: {row.key} measured {row.measured}, theory {row.expected}"
            if exact:
                assert row.measured == row.expected, f"rank {rank}: {row.key}"


@pytest.mark.parametrize("case", range(len(TWO_RANK_CASES)), ids=[name for name, _, _ in TWO_RANK_CASES])
def test_two_rank_collectives_match_theory(two_rank_measurements, case):
    _, layout, args = TWO_RANK_CASES[case]
    # Padding adds 2 rows of 16 MB of parameters, far inside 5%: only equal bytes show it is counted.
    assert_matches_theory([ranks[case] for ranks in two_rank_measurements], layout, args,
                          exact=args is UNEVEN)


def test_fsdp_2_tp_2_collectives_match_theory():
    layout = Layout(dp_shard=2, tp=2)
    assert_matches_theory(run_distributed(measure, layout.world_size, layout), layout, ARGS)


def test_fsdp_padding_in_theory():
    assert fsdp_unit_bytes([((2047, 256), None)], tp=1, fsdp=2) == 2048 * 256 * 4
    # wo (dim, heads·head_dim) is split by columns over tp first; FSDP then pads its rows to a multiple of 3.
    wo = next(w for w in block_weights(ARGS) if w[1] == 1)
    rows, cols = wo[0]
    assert fsdp_unit_bytes([wo], tp=2, fsdp=3) == -(-rows // 3) * 3 * (cols // 2) * 4
