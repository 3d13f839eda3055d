"""On-policy distillation through train.py: a Qwen3-shaped student from scratch distilled from a Llama-shaped
teacher fine-tuned on the shipped sums: its divergence to the teacher on held-out prompts falls clearly
and its answers take the teacher's form (digits, as long as the teacher's); rollouts.jsonl and the
metrics; an exact resume; and the bad inputs refused in one line, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weft import train

from tests.support import REPO
from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.train_runs import run

SFT = str(REPO / "assets/data/arithmetic/sft.jsonl")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The debug model fine-tuned on the sums for 60 steps: a teacher that answers in digits."""
    dump = tmp_path_factory.mktemp("teacher") / "run"
    run(["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--data.format", "prompt_completion",
         "--data.dataset_path", SFT, "--training.steps", "60", "--training.seq_len", "64",
         "--training.local_batch_size", "8", "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "10",
         "--checkpoint.enable", "--checkpoint.interval", "60", "--no-validation.enable",
         "--no-metrics.enable_tensorboard"])
    return dump / "checkpoint" / "step-60"


def distill_args(dump: Path, teacher: Path, *extra: str, steps: int = 4) -> list[str]:
    return ["--job.config_file", "debug_distill", "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--distillation.teacher_path", str(teacher), "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
            *extra]


def digit_share(lines: list[dict]) -> float:
    text = "".join("".join(line["completion"].split()) for line in lines)
    return sum(c.isdigit() for c in text) / max(len(text), 1)


@pytest.mark.slow
def test_the_student_learns_the_teacher_s_answers(teacher, tmp_path):
    run(distill_args(tmp_path / "student", teacher, "--validation.freq", "30", steps=60))
    records = read_jsonl(tmp_path / "student" / "metrics.jsonl")
    first = next(r for r in records if r["step"] == 1 and "divergence" in r)
    validations = [r["validation/divergence"] for r in records if "validation/divergence" in r]
    assert validations[-1] < 0.6 * first["divergence"], (first["divergence"], validations)
    # the teacher's own completions: the teacher as the "student" of itself, at its first step (sampled before any update)
    run(distill_args(tmp_path / "teacher_itself", teacher, "--model.flavor", "debugmodel",
                     "--checkpoint.initial_load_path", str(teacher), "--validation.enable",
                     "false", steps=1))
    teacher_lines = read_jsonl(tmp_path / "teacher_itself" / "rollouts.jsonl")
    assert read_jsonl(tmp_path / "teacher_itself" / "metrics.jsonl")[0]["divergence"] == pytest.approx(0, abs=1e-6)
    lines = read_jsonl(tmp_path / "student" / "rollouts.jsonl")
    start, end = [line for line in lines if line["step"] <= 2], [line for line in lines if line["step"] > 55]
    assert digit_share(teacher_lines) > 0.9
    assert digit_share(start) < 0.3 < 0.7 < digit_share(end), (digit_share(start), digit_share(end))
    for line in lines[:16]:
        assert set(line) == {"step", "prompt", "prompt_ids", "completion", "completion_ids", "divergence",
                             "finish_reason"}
        assert line["divergence"] > 0
    for name in ("divergence", "entropy", "completions/mean_length", "completions/clipped_ratio", "num_tokens",
                 "generation_share", "train/grad_norm"):
        assert name in first, name


@pytest.mark.slow
def test_a_stopped_run_resumes_bit_for_bit(teacher, tmp_path):
    args = ("--checkpoint.enable", "--checkpoint.interval", "2", "--validation.enable", "false")
    whole = run(distill_args(tmp_path / "whole", teacher, *args))
    run(distill_args(tmp_path / "stopped", teacher, *args), stop_after=2)
    assert run(distill_args(tmp_path / "stopped", teacher, *args)) == whole[2:]
    assert (tmp_path / "stopped" / "rollouts.jsonl").read_text() == (tmp_path / "whole" / "rollouts.jsonl").read_text()


def test_bad_teachers_and_options_are_refused_in_one_line(tmp_path, capsys):
    teacher = tmp_path / "teacher"  # debug_distill names the teacher's flavor: planning does not read it
    from_folder = ["--distillation.teacher_flavor", "from_hf_config"]
    cases = [
        (["--distillation.teacher_flavor", "qwen3_0_6b"], ["distillation.teacher_path", "(151936 tokens)",
                                                           "the student's (2048)"]),
        ([*from_folder, "--distillation.teacher_path", str(tmp_path / "nowhere")],
         ["distillation.teacher_path", "nowhere"]),
        ([*from_folder, "--distillation.teacher_path", str(tmp_path)], ["distillation.teacher_path"]),
        (["--distillation.beta", "1.5"], ["distillation.beta", "1.5"]),
        (["--sampling.temperature", "0"], ["sampling.temperature = 0.0", "temperature > 0"]),
        (["--parallelism.pp", "2"], ["parallelism.pp"]),
    ]
    for extra, expected in cases:
        before = snapshot(tmp_path)
        outcome = run_in_process(train.main, distill_args(tmp_path / "run", teacher, *extra), capsys)
        assert_clean_failure(outcome, expected, before=before, root=tmp_path)


def test_a_transformers_backend_teacher_teaches_an_in_repo_student(tmp_path):
    """The teacher a Hugging Face folder built by transformers' code, the student weft's own Qwen3 from
    scratch, chat prompts rendered by the folder's template: step 1's loss is the reverse KL of the two
    models' plain forwards over the step's completion tokens."""
    transformers = pytest.importorskip("transformers")

    from tests.support.chat_data import write_jsonl
    from tests.support.hf_folders import tiny_hf_folder
    from tests.support.hf_tokenizer import build_tokenizer_folder

    tiny_hf_folder(tmp_path / "teacher", build_tokenizer_folder(tmp_path / "tok"))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"Say {n}."}]} for n in range(16)])
    run(distill_args(tmp_path / "run", tmp_path / "teacher", "--distillation.teacher_flavor", "from_hf_config",
                     "--distillation.teacher_backend", "transformers", "--model.tokenizer_path", str(tmp_path / "tok"),
                     "--data.dataset_path", str(tmp_path / "prompts.jsonl"), "--training.seq_len", "64",
                     "--validation.enable", "false", steps=2))
    lines = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert len(lines) == 32 and lines[0]["completion"][0]["role"] == "assistant"
    # step 1's loss from scratch: the student at its seeded start (weft's Qwen3, drawn as train.py draws it),
    # the teacher transformers' own model, reverse KL per completion token over the step's 16 rows
    from weft.models import flavors, spec_for_flavor
    from weft.parallelisms.materialize import materialize

    with torch.device("meta"):
        student = spec_for_flavor("debugmodel_qwen3").build(flavors()["debugmodel_qwen3"])
    materialize(student, torch.device("cpu"), seed=0)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "teacher").float().eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for line in lines[:16]:
            ids, start = line["prompt_ids"] + line["completion_ids"], len(line["prompt_ids"]) - 1
            s_logits = student(torch.tensor([ids[:-1]]))[0, start:]
            t_logits = teacher(torch.tensor([ids[:-1]])).logits[0, start:]
            log_ps, log_pt = torch.log_softmax(s_logits.double(), -1), torch.log_softmax(t_logits.double(), -1)
            total += (log_ps.exp() * (log_ps - log_pt)).sum().item()
            tokens += len(line["completion_ids"])
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["train/loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_the_dry_run_counts_the_teacher_s_own_weights(tmp_path, capsys):
    """debug_distill's teacher (the Llama debug model, 4,000,000 fp32 parameters) beside a smaller Qwen3
    student: the estimate holds the teacher's bytes, and the layouts table's row of this run its peak."""
    from weft.components.config import parse_args
    from weft.models import flavors, spec_for_flavor
    from weft.recipe.dry_run import dry_run

    estimate = dry_run(parse_args(["--job.config_file", "debug_distill", "--job.dump_folder", str(tmp_path / "x"),
                                   "--job.dry_run"]))
    with torch.device("meta"):
        teacher = spec_for_flavor("debugmodel").build(flavors()["debugmodel"])
    assert estimate.buffers["distillation teacher (frozen copy's weights)"] == 4 * sum(
        p.numel() for p in teacher.parameters())
    row = next(line for line in capsys.readouterr().out.splitlines() if line.endswith("<- this run"))
    assert float(row.split()[-4]) == pytest.approx(estimate.peak / 2**20, abs=0.01)
