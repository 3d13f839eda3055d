"""Preference runs (data.format = preference) through train.py: DPO's first step on a tiny Hugging Face
folder equals a transformers-only computation of the formula (weft's Llama and the transformers
backend), IPO's, SimPO's and ORPO's that of TRL 1.16's definitions, the LoRA policy with its adapters off is its own reference, an exact resume, DPO after SFT
learns the held-out preference, and the one-line refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from weft import train

from tests.support import REPO
from tests.support.chat_data import write_jsonl
from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.hf_folders import tiny_hf_folder, tiny_qwen3_hf_folder
from tests.support.hf_tokenizer import build_tokenizer_folder
from tests.support.preference_data import make_pairs, split_record, trl_ids, trl_objective
from tests.support.train_runs import run, run_args

transformers = pytest.importorskip("transformers")

BETA = 0.3
PAIRS = 4  # one step's global batch
FP32 = ("--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tokenizer with a chat template, a tiny Llama folder (the policy's start), another (the
    reference: its weights moved by noise), and conversational pairs."""
    root = tmp_path_factory.mktemp("preference")
    tokenizer = build_tokenizer_folder(root / "tok")
    tiny_hf_folder(root / "policy", tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "policy")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(root / "reference")
    tiny_qwen3_hf_folder(root / "qwen3_moe_policy", moe=True, seed=0)  # Qwen3-MoE: two draws of one shape
    tiny_qwen3_hf_folder(root / "qwen3_moe_reference", moe=True, seed=1)
    write_jsonl(root / "pairs.jsonl", make_pairs(16, chat=True))
    return root


def dpo_args(root: Path, dump: Path, *extra: str, steps: int = 1, policy: str = "policy") -> list[str]:
    return run_args(dump, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(root / policy),
                    "--model.tokenizer_path", str(root / "tok"), "--data.format", "preference", "--data.dataset_path", str(root / "pairs.jsonl"),
                    "--preference.beta", str(BETA), *FP32, *extra, steps=steps, batch=PAIRS, seq_len=96)


def records_of_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def transformers_dpo(root: Path, records: list[dict], prefix: str = "") -> tuple[float, float]:
    """DPO's mean loss and reward margin over `records`, with transformers alone: each answer's
    summed log-probability under the policy and the reference folders, TRL's tokenization."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "tok")
    models = [transformers.AutoModelForCausalLM.from_pretrained(root / (prefix + name)).float().eval()
              for name in ("policy", "reference")]
    losses, margins = [], []
    for record in records:
        prompt, answers = split_record(record)
        logps = []  # [policy, reference] x [chosen, rejected]
        for model in models:
            row = []
            for answer in answers:
                ids, start = trl_ids(tokenizer, prompt, answer)
                assert len(ids) <= 97, "a row longer than seq_len + 1 would be truncated"
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0, :-1].float()
                token_logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
                row.append(token_logps[start - 1:].sum().item())
            logps.append(row)
        (pc, pr), (rc, rr) = logps
        losses.append(-F.logsigmoid(torch.tensor(BETA * ((pc - pr) - (rc - rr)))).item())
        margins.append(BETA * (pc - rc) - BETA * (pr - rr))
    return sum(losses) / len(losses), sum(margins) / len(margins)


def first_record(dump: Path) -> dict:
    return json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("family, backend", [("", "weft"), ("", "transformers"), ("qwen3_moe_", "weft")])
def test_dpo_step_one_equals_transformers(root, tmp_path, family, backend):
    """Llama by weft's code and by transformers' (model.backend), and weft's Qwen3-MoE."""
    dump = tmp_path / backend
    losses = run(dpo_args(root, dump, "--model.backend", backend, "--preference.reference_path",
                          str(root / f"{family}reference"), policy=f"{family}policy"))
    loss, margin = transformers_dpo(root, records_of_jsonl(root / "pairs.jsonl")[:PAIRS], family)
    assert abs(loss - math.log(2)) > 1e-3, "the reference must differ from the policy"
    assert losses[0] == pytest.approx(loss, abs=1e-5)
    assert first_record(dump)["rewards/margins"] == pytest.approx(margin, abs=1e-5)


def test_lora_policy_with_adapters_off_is_its_reference(root, tmp_path):
    """Under LoRA without reference_path the reference is the policy with its adapters off: ln 2 at
    step 1, and every step as with a frozen copy of the same base (reference_path = the base), here
    under full activation checkpointing (the forward recomputed in backward, adapters on)."""
    lora = ("--lora.enable", "--lora.rank", "4")
    own = run(dpo_args(root, tmp_path / "own", *lora, steps=3))
    copy = run(dpo_args(root, tmp_path / "copy", *lora, "--preference.reference_path", str(root / "policy"),
                        "--activation_checkpoint.mode", "full", steps=3))
    assert own[0] == pytest.approx(math.log(2), abs=1e-6)
    assert min(own[1:]) < own[0] - 1e-3, "the adapters must learn"
    assert own == pytest.approx(copy, abs=1e-6)


@pytest.mark.slow
def test_dpo_after_sft_prefers_the_held_out_chosen_answers(tmp_path):
    """SFT of the debug model on Shakespeare, then DPO on pairs whose rejected answer is the chosen
    one's words reversed: on held-out pairs the rewards rank chosen above rejected."""
    sft = tmp_path / "sft"
    run(run_args(sft, "--checkpoint.enable", "--checkpoint.interval", "20", "--optimizer.lr", "3e-3",
                 steps=20, batch=8))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(128, offset=0))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", make_pairs(16, offset=400))
    dpo = tmp_path / "dpo"
    run(run_args(dpo, "--checkpoint.initial_load_path", str(sft / "checkpoint" / "step-20"),
                 "--data.format", "preference", "--data.dataset_path", str(pairs), "--optimizer.lr", "1e-3",
                 "--lr_scheduler.warmup_steps", "2", "--validation.enable", "--validation.dataset_path", str(held_out),
                 "--validation.freq", "10", "--validation.steps", "2", steps=10, batch=4, seq_len=48))
    validation = [r for r in map(json.loads, (dpo / "metrics.jsonl").read_text().splitlines())
                  if "validation/rewards/accuracies" in r]
    assert validation[-1]["validation/rewards/accuracies"] > 0.5
    assert validation[-1]["validation/rewards/margins"] > 0


@pytest.mark.parametrize("extra, records, expected", [
    (["--preference.loss", "simpo", "--preference.reference_path", "ref"], None,
     "preference.reference_path: preference.loss = simpo uses no reference model"),
    (["--data.dataset_path", str(REPO / "assets/data/shakespeare")], None, "which data.format = 'preference' reads"),
    (["--preference.loss", "orpo", "--preference.precompute_reference"], None,
     "preference.precompute_reference: preference.loss = orpo uses no reference model"),
    (["--validation.enable", "--validation.format", "text", "--validation.dataset_path", str(REPO / "assets/data")],
     None, "validation.format = text: a preference run validates on pairs"),
    (["--data.mixture", "a:1"], None, "data.mixture: mixes windows of text or samples"),
    (["--preference.reference_path", "/nonexistent/reference"], None,
     "preference.reference_path: no checkpoint folder at /nonexistent/reference"),
    ([], [{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
           "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}],
     ":2: chosen and rejected have different prompts"),
])
def test_refusals(tmp_path, capsys, extra, records, expected):
    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", make_pairs(1) + (records or []))
    dump = tmp_path / "dump"
    before = snapshot(tmp_path)
    argv = run_args(dump, "--data.format", "preference", "--data.dataset_path", str(data), *extra)
    assert_clean_failure(run_in_process(train.main, argv, capsys), expected, before=before, root=tmp_path)


def test_preference_keys_without_preference_data_refused(tmp_path, capsys):
    argv = run_args(tmp_path / "dump", "--preference.loss", "ipo")
    assert_clean_failure(run_in_process(train.main, argv, capsys), "preference.loss: configures preference training")


@pytest.mark.parametrize("world_size", [1, 2])
def test_dry_run_counts_the_frozen_reference(world_size, capsys):
    """The frozen copy holds the policy's weights again, sharded like them: in every phase, and in
    the layouts table's row of this run; under LoRA without reference_path there is no second copy."""
    from weft.components.config import parse_args
    from weft.recipe.dry_run import dry_run

    def estimate(*extra: str):
        try:
            return dry_run(parse_args(["--job.config_file", "debug_model", "--job.dry_run", "--job.dry_run_world_size",
                                       str(world_size), *extra]))
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    plain = estimate("--data.format", "chat")
    capsys.readouterr()
    dpo = estimate("--data.format", "preference")
    this_run = next(line for line in capsys.readouterr().out.splitlines() if line.endswith("<- this run"))
    assert float(this_run.split()[-4]) == pytest.approx(dpo.peak / 2**20, abs=0.01)
    lora = estimate("--data.format", "preference", "--lora.enable")
    reference = dpo.buffers["preference reference (frozen copy's weights)"]
    assert reference == dpo.parameters == plain.parameters
    assert dpo.phases["optimizer step"] == plain.phases["optimizer step"] + reference
    assert not any("reference" in name for name in lora.buffers)


@pytest.mark.slow
def test_resume_is_exact_with_a_live_or_a_precomputed_reference(root, tmp_path):
    """Stopped after step 2 and resumed: the same losses and validation rewards as one run, with the
    reference held (a path: read again at the start, not saved in the checkpoint) or precomputed
    (preference.precompute_reference: the first pass starts at the resumed step)."""
    def args(dump: Path, *extra: str) -> list[str]:
        return dpo_args(root, dump, "--preference.reference_path", str(root / "reference"), "--validation.enable",
                        "--validation.dataset_path", str(root / "pairs.jsonl"), "--validation.freq", "2",
                        "--validation.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "2",
                        "--training.local_batch_size", "2", *extra, steps=4)

    whole = run(args(tmp_path / "whole"))
    for name, extra in (("live", ()), ("precomputed", ("--preference.precompute_reference",))):
        first = run(args(tmp_path / name, *extra), stop_after=2)
        second = run(args(tmp_path / name, *extra))
        assert len(first) == 2 and first + second == pytest.approx(whole, abs=1e-6), name

    def margins(name: str) -> list[float]:
        records = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
        return [r["validation/rewards/margins"] for r in records if "validation/rewards/margins" in r]

    assert len(margins("whole")) == 2
    for name in ("live", "precomputed"):
        assert margins(name) == pytest.approx(margins("whole"), abs=1e-6), name


@pytest.mark.parametrize("loss, extra", [("ipo", ()), ("simpo", ("--preference.gamma", "0.4")),
                                         ("orpo", ())])
@pytest.mark.parametrize("chat", [False, True], ids=["strings", "chat"])
def test_step_one_equals_trl(root, tmp_path, loss, extra, chat):
    """IPO, SimPO and ORPO's first step (loss and logged metrics) equal TRL 1.16's definitions computed
    with transformers alone, on pairs of different lengths, strings or chat; ORPO's validation runs."""
    pairs = [make_pairs(1, offset=5 * i, answer_chars=10 + 9 * i, chat=chat)[0] for i in range(PAIRS)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    reference = ("--preference.reference_path", str(root / "reference")) if loss == "ipo" else ()
    dump = tmp_path / "dump"
    args = dpo_args(root, dump, "--preference.loss", loss, *reference, *extra, "--data.dataset_path", str(data),
                    "--validation.enable", "--validation.dataset_path", str(data), "--validation.freq", "1",
                    "--validation.steps", "1")
    losses = run(args)
    hf = transformers.AutoTokenizer.from_pretrained(root / "tok")
    policy, ref = (transformers.AutoModelForCausalLM.from_pretrained(root / name).float().eval()
                   for name in ("policy", "reference"))
    gamma = float(extra[1]) if extra else 0.5
    want_loss, want, scale = trl_objective(loss, BETA, gamma, policy, ref, hf, pairs)
    assert losses[0] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    record = first_record(dump)
    for name in want:
        assert record[name] == pytest.approx(want[name], rel=1e-5, abs=1e-5 * scale), name
    assert math.isfinite(json.loads((dump / "metrics.jsonl").read_text().splitlines()[-1])["validation/loss"])
