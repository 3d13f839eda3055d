"""On-policy distillation in every layout equals one process: fsdp 2 (also resharding the root after each
forward), ddp 2, tp 2, ep 2 (an MoE student, with a dense teacher and with an MoE one), a transformers-backend
student under fsdp 2 (both ways) and tp 2, LoRA and QLoRA under fsdp 2, and hsdp 2x2, each against its own
one-process run of debug_distill over 4 steps (fp32, gloo), the teacher (a debug-model checkpoint) sharded as
the student is. The same completions (the engine's seeding) give the same lengths; the loss (the divergence
per completion token) agrees within 1e-5 and the gradient norm within its fp32 rounding
(tests/parallelisms/test_grpo_parity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weft.components.config import parse_args

from tests.support.dist_utils import data_parallel_degree, run_by_world_size
from tests.support.hf_folders import tiny_hf_folder
from tests.support.hf_tokenizer import build_tokenizer_folder

pytestmark = pytest.mark.slow  # 11 runs in 2 processes, 1 in 4, 6 references: about a minute

STEPS = 4
MOE = ["--model.flavor", "debugmodel_qwen3_moe"]
LORA = ["--lora.enable", "--lora.rank", "4"]
QLORA = [*LORA, "--lora.quantize_base", "nf4"]
# an MoE teacher (a Qwen3-MoE checkpoint) beside the MoE student: its experts spread over the ep ranks too
MOE_TEACHER = [*MOE, "--distillation.teacher_path", "{root}/teacher_moe/checkpoint/step-1",
               "--distillation.teacher_flavor", "debugmodel_qwen3_moe"]
# a transformers-backend student: a Llama folder of the debug model's shape, built by transformers' code
HF_STUDENT = ["--model.flavor", "from_hf_config", "--model.backend", "transformers",
              "--checkpoint.initial_load_path", "{root}/hf_student_folder"]
# name -> (its one-process reference, world size, the layout's overrides)
LAYOUTS = {
    "fsdp2": ("dense", 2, ["--parallelism.dp_shard", "2"]),
    # the root resharded after each forward: the teacher's head is gathered after it, the student's within
    "fsdp2_reshard_always": ("dense", 2, ["--parallelism.dp_shard", "2", "--parallelism.fsdp_reshard_after_forward",
                                          "always"]),
    "ddp2": ("dense", 2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]),
    "tp2": ("dense", 2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"]),
    "ep2": ("moe", 2, [*MOE, "--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
    "moe_teacher_ep2": ("moe_teacher", 2, [*MOE_TEACHER, "--parallelism.dp_shard", "2", "--parallelism.ep", "2"]),
    "lora_fsdp2": ("lora", 2, [*LORA, "--parallelism.dp_shard", "2"]),
    "qlora_fsdp2": ("qlora", 2, [*QLORA, "--parallelism.dp_shard", "2"]),
    "hf_fsdp2": ("hf", 2, [*HF_STUDENT, "--parallelism.dp_shard", "2"]),
    "hf_fsdp2_reshard_always": ("hf", 2, [*HF_STUDENT, "--parallelism.dp_shard", "2",
                                          "--parallelism.fsdp_reshard_after_forward", "always"]),
    "hf_tp2": ("hf", 2, [*HF_STUDENT, "--parallelism.dp_shard", "1", "--parallelism.tp", "2"]),
    "hsdp2x2": ("dense", 4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
}
REFERENCES = {"dense": [], "moe": MOE, "lora": LORA, "qlora": QLORA, "moe_teacher": MOE_TEACHER, "hf": HF_STUDENT}
GRAD_NORM_RTOL = 2e-4


def args(root: str, name: str, overrides: list[str], dp: int) -> list[str]:
    return ["--job.config_file", "debug_distill", "--job.dump_folder", f"{root}/{name}", "--training.steps",
            str(STEPS), "--training.local_batch_size", str(16 // dp), "--validation.enable", "false",
            "--distillation.teacher_path", f"{root}/teacher/checkpoint/step-1", "--metrics.log_freq", "1",
            "--no-metrics.enable_tensorboard", *(value.format(root=root) for value in overrides)]


def history(dump: Path) -> list[dict]:
    return [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]


def train_layouts(names: list[str], root: str) -> dict[str, list[dict]]:
    import torch.distributed as dist

    from weft import train

    results = {}
    for name in names:
        _, world_size, overrides = LAYOUTS[name]
        train.train(parse_args(args(root, name, overrides, data_parallel_degree(world_size, overrides))))
        dist.barrier()
        if dist.get_rank() == 0:
            results[name] = history(Path(root) / name)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    from weft import train

    root = tmp_path_factory.mktemp("distillation_parity")
    tiny_hf_folder(root / "hf_student_folder", build_tokenizer_folder(root / "tokenizer"))
    # the MoE teacher drawn from another seed than the student's, so the two differ from step 1
    for teacher, flavor, seed in (("teacher", "debugmodel", "0"), ("teacher_moe", "debugmodel_qwen3_moe", "1")):
        train.train(parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(root / teacher),
                                "--model.flavor", flavor, "--training.seed", seed, "--training.steps", "1",
                                "--training.seq_len", "32",
                                "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval",
                                "1", "--no-metrics.enable_tensorboard"]))
    results = {name: None for name in REFERENCES}
    for name, overrides in REFERENCES.items():
        train.train(parse_args(args(str(root), name, overrides, 1)))
        results[name] = history(root / name)
    results.update(run_by_world_size(train_layouts, {name: LAYOUTS[name][1:] for name in LAYOUTS}, str(root),
                                     timeout=600))
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_equals_one_process_over_4_steps(runs, layout):
    reference, got = runs[LAYOUTS[layout][0]], runs[layout]
    assert len(got) == len(reference) == STEPS
    for ours, theirs in zip(got, reference):
        assert ours["completions/mean_length"] == theirs["completions/mean_length"]  # the same completions
        assert ours["train/loss"] == pytest.approx(theirs["train/loss"], abs=1e-5)
        assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=GRAD_NORM_RTOL)
    assert all(r["train/grad_norm"] > 0.01 for r in reference)
