"""train.py on the debug Llama 4 MoE: the start-up log counts active parameters, a resumed run
repeats an uninterrupted one bit for bit (and within 1e-5 when resumed under tp 2, or from ep 2 in
one process and under ep 4, with the EP imbalance logged), and the
end-of-run export loads in transformers."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import Llama4ForCausalLM

from weft import train
from weft.components.config import parse_args
from weft.components.hf import load_hf_into_model, model_args_from_hf_folder
from weft.models.llama4 import Transformer
from weft.recipe.export import main as export_main

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run, run_args


def args(dump, *extra: str) -> list[str]:
    return run_args(dump, "--lr_scheduler.warmup_steps", "2", *extra, config="debug_moe", steps=8, batch=4)


def test_debug_moe_resumes_exactly_and_logs_active_parameters(tmp_path, capfd):
    """With the routing bias balancing the experts: it is checkpointed (the resumed run routes as
    the straight one), and each MoE layer's load imbalance is in the log line and metrics.jsonl."""
    checkpoints = ("--checkpoint.enable", "--checkpoint.interval", "4", "--moe.bias_update_rate", "0.01")
    straight = run(args(tmp_path / "straight", *checkpoints))
    # 2 of 4 experts per token: each MoE layer leaves 2 experts of 3·256·256 parameters idle.
    out = capfd.readouterr().out
    assert f"4,591,872 parameters ({4_591_872 - 2 * 2 * 3 * 256 * 256:,} active per token)" in out
    assert "moe_imbalance " in out
    record = json.loads((tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()[-1])
    imbalance = {k: v for k, v in record.items() if k.startswith("moe/imbalance/")}
    assert set(imbalance) == {"moe/imbalance/layers.1.feed_forward", "moe/imbalance/layers.3.feed_forward"}
    assert all(1 <= v <= 2 for v in imbalance.values())  # top 2 of 4 experts: at most 2 x the mean
    first = run(args(tmp_path / "resumed", *checkpoints), stop_after=4)
    second = run(args(tmp_path / "resumed", *checkpoints))
    assert len(first) == 4 and first + second == straight
    assert straight[-1] < straight[0]


CHECKPOINTS = ("--checkpoint.enable", "--checkpoint.interval", "4", "--moe.bias_update_rate", "0.01")


def resume_under_tp2(dump: str) -> list[float]:
    """Worker: the rest of the run in `dump` under tp 2 (the experts split by hidden dimension)."""
    return run(args(dump, *CHECKPOINTS, "--parallelism.dp_shard", "1", "--parallelism.tp", "2"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    """8 steps in one process, checkpoints at 4 and 8, the routing bias moving."""
    return run(args(tmp_path_factory.mktemp("straight"), *CHECKPOINTS))


EP2 = ("--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.local_batch_size", "2")


def resume_under_tp2_and_ep2(tp_dump: str, ep_dump: str) -> tuple[list[float], list[float]]:
    """Worker: the rest of the run in `tp_dump` under tp 2 (the experts split by hidden dimension)
    and of the run in `ep_dump` under ep 2 (two experts a rank)."""
    return resume_under_tp2(tp_dump), run(args(ep_dump, *CHECKPOINTS, *EP2))


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_under_tp2_and_ep2_as_the_run_goes_on(tmp_path, straight):
    """Resume into other layouts: DCP reshards the stacked experts (whole → hidden slices, or →
    two experts a rank) and the routing bias, and steps 5-8 repeat the straight run's within 1e-5."""
    run(args(tmp_path / "moved", *CHECKPOINTS), stop_after=4)
    shutil.copytree(tmp_path / "moved", tmp_path / "moved_ep2")
    under_tp2, under_ep2 = run_distributed(resume_under_tp2_and_ep2, 2, str(tmp_path / "moved"),
                                           str(tmp_path / "moved_ep2"), timeout=600)[0]
    for resumed in (under_tp2, under_ep2):
        assert resumed == pytest.approx(straight[4:], rel=1e-5) and len(resumed) == 4


def first_half_under_ep2(dump: str) -> list[float]:
    """Worker: steps 1-4 of the run in `dump` with the experts spread over 2 ranks (ep 2 over fsdp 2)."""
    return run(args(dump, *CHECKPOINTS, *EP2), stop_after=4)


def second_half_under_ep4(dump: str) -> list[float]:
    """Worker: steps 5-8 of the run in `dump` with each of the 4 experts on its own rank (ep 4, fsdp 4)."""
    return run(args(dump, *CHECKPOINTS, "--parallelism.dp_shard", "4", "--parallelism.ep", "4",
                    "--training.local_batch_size", "1"))


@pytest.mark.slow
def test_an_ep2_checkpoint_resumes_in_one_process_and_under_ep4(tmp_path, straight):
    """DCP gathers the experts spread over the EP ranks (and FSDP-sharded) back into whole
    stacked weights, or respreads them one a rank: steps 5-8 in one process, and under ep 4,
    repeat the straight run's within 1e-5 (exact resume in the same layout: ep 2 over fsdp 4 below)."""
    first = run_distributed(first_half_under_ep2, 2, str(tmp_path / "moved"), timeout=600)[0]
    shutil.copytree(tmp_path / "moved", tmp_path / "moved_ep4")
    records = [json.loads(line) for line in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    second = run(args(tmp_path / "moved", *CHECKPOINTS))
    assert first + second == pytest.approx(straight, rel=1e-5) and len(second) == 4
    under_ep4 = run_distributed(second_half_under_ep4, 4, str(tmp_path / "moved_ep4"), timeout=600)[0]
    assert under_ep4 == pytest.approx(straight[4:], rel=1e-5) and len(under_ep4) == 4
    # Under ep the log carries each layer's EP imbalance: between 1 (even) and ep = 2.
    ranks = [{k: v for k, v in record.items() if k.startswith("moe/ep_imbalance/")} for record in records]
    assert len(ranks) == 4 and all(set(r) == {"moe/ep_imbalance/layers.1.feed_forward",
                                              "moe/ep_imbalance/layers.3.feed_forward"} for r in ranks)
    assert all(1 <= v <= 2 for r in ranks for v in r.values())


EP2_FSDP4 = ("--parallelism.dp_shard", "4", "--parallelism.ep", "2", "--training.local_batch_size", "1")


def ep2_over_fsdp4_straight_and_resumed(straight: str, resumed: str) -> tuple[list[float], list[float]]:
    """Worker (4 ranks, experts over ep 2 and FSDP-sharded over the 2 ranks holding the same ones):
    8 straight steps; and 4 steps, then a restart that resumes from the step-4 checkpoint."""
    whole = run(args(straight, *CHECKPOINTS, *EP2_FSDP4))
    first = run(args(resumed, *CHECKPOINTS, *EP2_FSDP4), stop_after=4)
    return whole, first + run(args(resumed, *CHECKPOINTS, *EP2_FSDP4))


@pytest.mark.slow
def test_ep2_over_fsdp4_resumes_bit_for_bit(tmp_path, straight):
    """ep 2 × fsdp 2 on 4 ranks: a run stopped after its step-4 checkpoint and resumed repeats the
    uninterrupted run exactly; both follow the one-process run within 1e-5."""
    whole, resumed = run_distributed(ep2_over_fsdp4_straight_and_resumed, 4, str(tmp_path / "straight"),
                                     str(tmp_path / "resumed"), timeout=600)[0]
    assert resumed == whole and len(whole) == 8
    assert whole == pytest.approx(straight, rel=1e-5)


def export_run(dump, *layout: str) -> None:
    """3 steps of the debug MoE and its end-of-run export (to dump/hf) and checkpoint (step 3)."""
    train.train(parse_args(args(dump, "--training.steps", "3", "--export.hf_folder", "hf",
                                "--checkpoint.enable", "--checkpoint.interval", "3", *layout)))


def assert_export_gives_transformers_weft_logits(dump, tmp_path) -> dict[str, torch.Tensor]:
    folder = dump / "hf"
    # The command-line export of its checkpoint writes the same tensors.
    assert export_main(["--checkpoint", str(dump / "checkpoint" / "step-3"), "--out", str(tmp_path / "cli")]) == 0
    ours, cli = load_file(folder / "model.safetensors"), load_file(tmp_path / "cli" / "model.safetensors")
    assert ours.keys() == cli.keys() and all(torch.equal(ours[k], cli[k]) for k in ours)
    model = Transformer(model_args_from_hf_folder(folder))
    load_hf_into_model(model, folder)
    tokens = torch.randint(0, 2048, (2, 80), generator=torch.Generator().manual_seed(0))  # past a 64-token chunk
    exported = Llama4ForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model.eval()(tokens), rtol=0, atol=1e-5)
    return ours


def test_end_of_run_export_gives_transformers_weft_logits(tmp_path):
    export_run(tmp_path / "run")
    assert_export_gives_transformers_weft_logits(tmp_path / "run", tmp_path)


@pytest.fixture(scope="module")
def one_process_export(tmp_path_factory) -> dict[str, torch.Tensor]:
    dump = tmp_path_factory.mktemp("one")
    export_run(dump)
    return load_file(dump / "hf" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallelism.dp_shard", "2"],
                                    ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"]], ids=["fsdp2", "ep2"])
def test_a_2_rank_fine_tune_exports_what_one_process_does(tmp_path, layout, one_process_export):
    """The same 3 steps under FSDP 2, and with the experts spread by ep 2 (the same global batch):
    the export, gathered one tensor at a time, loads in transformers with weft's logits, and each
    tensor equals the one-process run's within 1e-5 of its norm (not element by element: AdamW's
    first steps divide a gradient by its own magnitude, so an element whose gradient is near zero
    turns rounding differences into steps of up to the learning rate; measured on one host, 1
    element in 4.6 million 1.5e-5 apart)."""
    run_distributed(export_run, 2, tmp_path / "run", *layout, "--training.local_batch_size", "2")
    exported = assert_export_gives_transformers_weft_logits(tmp_path / "run", tmp_path / "a")
    assert exported.keys() == one_process_export.keys()
    for name, want in one_process_export.items():
        difference = (exported[name] - want).norm() / want.norm()
        assert difference <= 1e-5, f"{name}: {difference:.2e} of its norm apart"
