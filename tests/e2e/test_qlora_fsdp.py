"""QLoRA under FSDP on the shipped debug model: two ranks train train.py's debug_lora config with an
NF4 base like one process does (the same NF4 grouping in both: parallelisms.lora.nf4_scaler_block),
on the same global batch."""

import pytest

from weft.components.config import parse_args
from weft.components.distributed.cpu_ranks import run_distributed

STEPS, GLOBAL_BATCH = 6, 8


def qlora_losses(dump_folder: str, world_size: int) -> list[float]:
    from weft import train

    return train.train(parse_args([
        "--job.config_file", "debug_lora", "--lora.quantize_base", "nf4", "--checkpoint.initial_load_path", "",
        "--job.dump_folder", dump_folder, "--training.steps", str(STEPS), "--training.seq_len", "32",
        "--training.local_batch_size", str(GLOBAL_BATCH // world_size), "--parallelism.dp_shard", str(world_size),
        "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", "--no-validation.enable",
        "--no-checkpoint.enable",
    ]))


@pytest.mark.slow
def test_qlora_fsdp2_trains_like_one_process(tmp_path):
    reference = qlora_losses(str(tmp_path / "one"), 1)
    fsdp2 = run_distributed(qlora_losses, 2, str(tmp_path / "fsdp2"), 2)[0]
    assert len(fsdp2) == len(reference) == STEPS
    assert all(abs(a - b) <= 1e-5 for a, b in zip(fsdp2, reference)), (fsdp2, reference)
    assert reference[-1] < reference[0]  # it trains
