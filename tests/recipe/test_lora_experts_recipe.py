"""LoRA on the routed experts through train.py (`--lora.target_modules wq,wv,experts` on the debug
MoE): the adapters learn (the loss falls below the frozen base's on the same batches), and the
adapter-only checkpoint holds the expert adapters and resumes them exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from weft.components.checkpoint.checkpointer import complete_steps

from tests.support.train_runs import run, run_args

STEPS = 8


def args(dump: Path, *extra: str) -> list[str]:
    return run_args(dump, "--lora.enable", "--lora.target_modules", "wq,wv,experts", "--lora.rank", "4",
                    "--checkpoint.initial_load_path=", "--no-validation.enable", "--optimizer.lr", "1e-2",
                    "--lr_scheduler.warmup_steps", "2", *extra,
                    config="debug_moe", steps=STEPS, seq_len=64, batch=4, checkpoint_every=4)


@pytest.mark.slow
def test_expert_adapters_learn_and_resume_exactly_from_an_adapter_only_checkpoint(tmp_path):
    straight = run(args(tmp_path / "straight"))
    # the frozen base on the same batches: an adapter that does not move (the lr must be > 0)
    frozen = run(args(tmp_path / "frozen", "--optimizer.lr", "1e-12", "--checkpoint.interval", str(STEPS)))
    assert straight[0] == frozen[0]  # step 0: B = 0, the base exactly
    assert sum(straight[-3:]) < sum(frozen[-3:]) - 0.1, (straight, frozen)  # same batches, lower loss
    saved = FileSystemReader(str(tmp_path / "straight" / "checkpoint" / "step-4")).read_metadata()
    model_keys = {k for k in saved.state_dict_metadata if k.startswith("model.")}
    experts = {k for k in model_keys if ".experts." in k}
    assert len(experts) == 12 and all(".experts.lora_" in k for k in experts)  # 2 MoE layers x A, B x w1-w3
    # adapters and the routing's balancing state only: no frozen expert or base weight
    assert all(".lora_" in k or k.endswith(".expert_bias") for k in model_keys)
    first = run(args(tmp_path / "resumed"), stop_after=4)
    assert complete_steps(tmp_path / "resumed" / "checkpoint") == [4]
    assert first + run(args(tmp_path / "resumed")) == straight  # bit for bit
