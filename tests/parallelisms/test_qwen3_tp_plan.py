"""Qwen3's tensor-parallel plan (models/qwen3/tp_plan.py) through train.py, against one process
(fp32, CPU, gloo, 10 steps with the MoE routing bias moving after every step, within 1e-5
relative at every step): dense Qwen3 under tp 2 (the q/k
norms' weights whole, their input this rank's heads, their gradient summed over the ranks), and
Qwen3-MoE under tp 2 with ep 2 (each tp rank routing its own tokens to the experts' ranks) and under
tp 2 alone (the experts split by hidden dimension, the gradient of the scores that weigh their
outputs summed over the ranks), and LoRA on dense Qwen3 under tp 2 (the adapters' outputs split by
head before the q/k norms) against LoRA in one process. (The full sweep of layouts belongs to the
Qwen3 layout parity tests.) Both flavors are cut to 2 blocks: Qwen3-MoE's MoE block 0 and dense
block 1, each split as in 4."""

from __future__ import annotations

import pytest

from weft.components.config import parse_args

from tests.support.blocks import fewer_blocks
from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run_args

STEPS = 10
BLOCKS = {"debugmodel_qwen3": 2, "debugmodel_qwen3_moe": 2}
TP2 = ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"]
LORA = ["--lora.enable", "--lora.rank", "4", "--lora.dropout", "0", "--optimizer.lr", "3e-3"]
LAYOUTS = {  # name -> (flavor, overrides), each on 2 ranks
    "dense_tp2": ("debugmodel_qwen3", TP2),
    "moe_tp2_ep2": ("debugmodel_qwen3_moe", [*TP2, "--parallelism.ep", "2"]),
    "moe_tp2": ("debugmodel_qwen3_moe", TP2),
    "dense_tp2_lora": ("debugmodel_qwen3", [*TP2, *LORA]),
}
# name -> (flavor, overrides) of the one-process runs the layouts are compared with
REFERENCES = {"debugmodel_qwen3": ("debugmodel_qwen3", []), "debugmodel_qwen3_moe": ("debugmodel_qwen3_moe", []),
              "debugmodel_qwen3_lora": ("debugmodel_qwen3", LORA)}


def reference_of(layout: str) -> str:
    flavor, overrides = LAYOUTS[layout]
    return flavor + ("_lora" if "--lora.enable" in overrides else "")


def config_args(dump_folder: str, flavor: str, overrides: list[str]) -> list[str]:
    return run_args(dump_folder, "--model.flavor", flavor, "--moe.bias_update_rate", "0.01", *overrides, steps=STEPS,
                    seq_len=64)


def train_layouts(root: str) -> dict[str, list[float] | str]:
    """Worker: each layout in turn; its losses, or the one-line error that refused it."""
    from weft import train
    from weft.errors import UserError

    results: dict[str, list[float] | str] = {}
    for name, (flavor, overrides) in LAYOUTS.items():
        try:
            with fewer_blocks(BLOCKS):
                results[name] = train.train(parse_args(config_args(f"{root}/{name}", flavor, overrides)))
        except UserError as e:
            results[name] = str(e)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[float] | str]:
    from weft import train

    root = tmp_path_factory.mktemp("qwen3_tp")
    with fewer_blocks(BLOCKS):
        single = {name: train.train(parse_args(config_args(str(root / name), flavor, overrides)))
                  for name, (flavor, overrides) in REFERENCES.items()}
    return single | run_distributed(train_layouts, 2, str(root / "layouts"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dense_tp2", "moe_tp2_ep2", "moe_tp2", "dense_tp2_lora"])
def test_tensor_parallel_qwen3_matches_one_process(layout, results):
    losses, reference = results[layout], results[reference_of(layout)]
    assert len(losses) == len(reference) == STEPS
    assert reference[-1] < reference[0] - 0.1, "the reference run must learn"
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        assert got == pytest.approx(want, rel=1e-5), f"{layout} step {step}: {got} vs {want}"
