"""train.py on the debug Qwen3 and Qwen3-MoE flavors (the routing bias moving): a run stopped at its
step-4 checkpoint and restarted repeats the uninterrupted run bit for bit; and resumed in another
layout (DCP resharding the q/k norms, the stacked experts and the routing bias) it repeats steps 5-8
within 1e-5: dense Qwen3 from one process into tp 2, Qwen3-MoE from one process into tp 2 x ep 2, and
from ep 2 (two ranks) back into one process."""

import pytest

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run, run_args

FLAVORS = ["debugmodel_qwen3", "debugmodel_qwen3_moe"]
CHECKPOINTS = ("--checkpoint.enable", "--checkpoint.interval", "4", "--moe.bias_update_rate", "0.01")
TP2 = ("--parallelism.dp_shard", "1", "--parallelism.tp", "2")
EP2 = ("--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.local_batch_size", "2")


def args(dump, flavor: str, *extra: str) -> list[str]:
    return run_args(dump, "--model.flavor", flavor, "--lr_scheduler.warmup_steps", "2", *CHECKPOINTS, *extra,
                    config="debug_moe", steps=8, batch=4)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, list[float]]:
    """8 steps of each flavor in one process, checkpoints at 4 and 8."""
    return {flavor: run(args(tmp_path_factory.mktemp(flavor), flavor)) for flavor in FLAVORS}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_stopped_run_resumes_bit_for_bit(tmp_path, flavor, straight):
    first = run(args(tmp_path, flavor), stop_after=4)
    second = run(args(tmp_path, flavor))
    assert len(first) == 4 and first + second == straight[flavor]
    assert straight[flavor][-1] < straight[flavor][0]


def other_layouts(dense_tp: str, moe_tp_ep: str, moe_ep: str) -> tuple[list[float], ...]:
    """Worker (2 ranks): the rest of the dense run under tp 2, the rest of the MoE run under
    tp 2 x ep 2, and the first half of another MoE run under ep 2."""
    return (run(args(dense_tp, FLAVORS[0], *TP2)), run(args(moe_tp_ep, FLAVORS[1], *TP2, "--parallelism.ep", "2")),
            run(args(moe_ep, FLAVORS[1], *EP2), stop_after=4))


@pytest.mark.slow
def test_checkpoints_resume_in_other_layouts_as_the_run_goes_on(tmp_path, straight):
    dense, moe = straight.values()
    run(args(tmp_path / "dense_tp", FLAVORS[0]), stop_after=4)
    run(args(tmp_path / "moe_tp_ep", FLAVORS[1]), stop_after=4)
    under_tp, under_tp_ep, first_under_ep = run_distributed(
        other_layouts, 2, str(tmp_path / "dense_tp"), str(tmp_path / "moe_tp_ep"), str(tmp_path / "moe_ep"),
        timeout=600)[0]
    assert under_tp == pytest.approx(dense[4:], rel=1e-5) and len(under_tp) == 4
    assert under_tp_ep == pytest.approx(moe[4:], rel=1e-5) and len(under_tp_ep) == 4
    rest_in_one_process = run(args(tmp_path / "moe_ep", FLAVORS[1]))
    assert first_under_ep + rest_in_one_process == pytest.approx(moe, rel=1e-5) and len(rest_in_one_process) == 4
