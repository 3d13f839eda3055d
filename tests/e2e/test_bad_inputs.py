"""Adversarial inputs to train.py: configs, command lines and data a user can get wrong.

Each case builds its bad input under tmp_path and runs train.py's `main` in this process (the
contract does not depend on how Python was started; a few cases also run `python train.py`
to prove it). tests/support/failure_checks.py states and checks the contract: exit 2, one
`weft: error:` line naming the key, value or file:line, no traceback, under 60 s, and every
file that existed before byte-identical (the dump folder is never created).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from weft import train
from weft.components.config import parse_args, to_toml
from weft.components.data import SCAN_BYTES
from weft.models import flavors, spec_for_flavor

from tests.support.failure_checks import assert_clean_failure, python, run_command, run_in_process, snapshot
from tests.support.preference_data import make_pairs

SHAKESPEARE = "assets/data/shakespeare"


def base(tmp: Path) -> list[str]:
    """A quick, valid run (2 steps of 2 x 32 tokens) writing to tmp/out."""
    return ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp / "out"), "--training.steps", "2",
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--no-metrics.enable_tensorboard"]


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def toml(tmp: Path, text: str | bytes) -> list[str]:
    """A config file holding `text`, used instead of debug_model."""
    return ["--job.config_file", str(write(tmp / "bad.toml", text))]


def data(tmp: Path, name: str, content: str | bytes) -> list[str]:
    return ["--data.dataset_path", str(write(tmp / "data" / name, content))]


def folder(tmp: Path, contents: dict[str, str | bytes]) -> list[str]:
    """A dataset folder holding these files."""
    for name, content in contents.items():
        write(tmp / "data" / name, content)
    return ["--data.dataset_path", str(tmp / "data")]


def jsonl(*records: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


GOOD_LINES = jsonl(*[{"text": f"To be or not to be, line {i}."} for i in range(400)])  # ~14 KB, many steps' worth


def saved_config(tmp: Path, text: str) -> list[str]:
    """A dump folder holding a config.toml that was not written by weft."""
    write(tmp / "out" / "config.toml", text)
    return []


# (id, setup(tmp) -> extra argv, text the error line must contain (may use {tmp}))
CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    # -- the config file -------------------------------------------------------------------
    ("config-not-utf8", lambda t: toml(t, b"[training]\nsteps = 3\n\xff\xfe\x00junk"), "bad.toml:3: not UTF-8"),
    ("config-binary", lambda t: toml(t, bytes(range(256))), "bad.toml:2: not UTF-8"),
    ("config-section-scalar", lambda t: toml(t, "training = 3\n"), "expected a [training] table"),
    ("config-seed-above-int64", lambda t: toml(t, "[training]\nseed = 9223372036854775808\n"), "training.seed"),
    ("config-warmup-huge", lambda t: toml(t, "[lr_scheduler]\nwarmup_steps = 100000000000000000000\n"),
     "lr_scheduler.warmup_steps in bad.toml: must fit in 64 bits"),
    ("config-lr-inf", lambda t: toml(t, "[optimizer]\nlr = inf\n"), "optimizer.lr in bad.toml: must be a finite"),
    ("config-lr-nan", lambda t: toml(t, "[optimizer]\nlr = nan\n"), "optimizer.lr in bad.toml"),
    ("config-empty-dataset", lambda t: toml(t, '[data]\ndataset_path = ""\n'), "data.dataset_path in bad.toml"),
    ("config-invalid-toml", lambda t: toml(t, "[training\nsteps = 1\n"), "bad.toml: invalid TOML"),
    ("config-unknown-section", lambda t: toml(t, "[trainig]\nsteps = 1\n"), "did you mean [training]"),
    ("config-string-for-int", lambda t: toml(t, '[training]\nsteps = "ten"\n'), "training.steps in bad.toml"),
    ("config-a-folder", lambda t: ["--job.config_file", str(t)], "job.config_file"),
    # -- the command line ------------------------------------------------------------------
    ("cli-seed-2**63", lambda t: ["--training.seed", str(2**63)], "--training.seed: must fit in 64 bits, got 9223372036854775808"),
    ("cli-seed-2**64", lambda t: ["--training.seed", str(2**64)], "--training.seed"),
    ("cli-lr-inf", lambda t: ["--optimizer.lr", "inf"], "--optimizer.lr: must be a finite number, got inf"),
    ("cli-lr-nan", lambda t: ["--optimizer.lr", "nan"], "--optimizer.lr: must be a finite number, got nan"),
    ("cli-weight-decay-inf", lambda t: ["--optimizer.weight_decay", "inf"], "--optimizer.weight_decay"),
    ("cli-max-norm-nan", lambda t: ["--training.max_norm", "nan"], "--training.max_norm"),
    ("cli-eps-inf", lambda t: ["--optimizer.eps", "inf"], "--optimizer.eps"),
    ("cli-min-lr-ratio-nan", lambda t: ["--lr_scheduler.min_lr_ratio", "nan"], "--lr_scheduler.min_lr_ratio"),
    ("cli-beta1-nan", lambda t: ["--optimizer.beta1", "nan"], "--optimizer.beta1"),
    ("cli-empty-dataset", lambda t: ["--data.dataset_path="], "--data.dataset_path: must be a non-empty"),
    ("cli-empty-dump-folder", lambda t: ["--job.dump_folder="], "--job.dump_folder: must be a non-empty"),
    # (an empty model.tokenizer_path means the default: the HF folder's tokenizer, else Shakespeare's)
    ("cli-tokenizer-folder-without-tokenizer-json", lambda t: ["--model.tokenizer_path", str(t)],
     "is a folder without tokenizer.json"),
    ("cli-empty-text-field", lambda t: ["--data.text_field="], "--data.text_field"),
    ("cli-empty-checkpoint-folder", lambda t: ["--checkpoint.folder="], "--checkpoint.folder"),
    ("cli-absurd-batch", lambda t: ["--training.local_batch_size", "1000000000"], "--training.local_batch_size"),
    ("cli-absurd-batch-x-seq", lambda t: ["--training.local_batch_size", "600000"], "tokens per device"),
    ("cli-load-step-without-enable", lambda t: ["--checkpoint.load_step", "3"],
     "--checkpoint.load_step = 3 needs --checkpoint.enable"),
    ("cli-bool-garbage", lambda t: ["--checkpoint.enable=maybe"], "--checkpoint.enable"),
    ("cli-unknown-flavor", lambda t: ["--model.flavor", "llama5"], "--model.flavor"),
    ("cli-tp-not-dividing", lambda t: ["--parallelism.tp", "3"], "world size 1"),
    ("cli-muon-exclude-matching-nothing",  # a typo'd pattern would leave those matrices to Muon
     lambda t: ["--optimizer.name", "Muon", "--optimizer.muon_exclude", "*.router.*,*.atention.*"],
     "optimizer.muon_exclude: '*.router.*' matches no parameter name"),
    ("cli-tokenizer-not-a-model", lambda t: ["--model.tokenizer_path", str(write(t / "tok.model", "hello"))],
     "model.tokenizer_path"),
    # -- the dump folder -------------------------------------------------------------------
    ("dump-is-a-file", lambda t: ["--job.dump_folder", str(write(t / "taken", "x"))], "is a file"),
    ("dump-below-a-file", lambda t: ["--job.dump_folder", str(write(t / "taken", "x") / "sub")], "is below"),
    ("dump-config-section-scalar", lambda t: saved_config(t, 'model = "debugmodel"\n'),
     "holds [model] as \"debugmodel\""),
    ("dump-config-not-toml", lambda t: saved_config(t, "[model\n"), "config.toml: invalid TOML"),
    ("dump-config-not-utf8", lambda t: saved_config(t, b"\xff\xff"), "config.toml:1: not UTF-8"),
    ("dump-config-other-run", lambda t: saved_config(t, to_toml(parse_args(base(t) + ["--training.seq_len", "64"]))),
     "is a run with training.seq_len = 64"),
    # -- data ------------------------------------------------------------------------------
    ("data-binary-txt", lambda t: data(t, "blob.txt", b"GIF89a\x00\x01\x02" * 10), "blob.txt:1: a NUL byte"),
    ("data-invalid-utf8-txt", lambda t: data(t, "latin1.txt", "line one\nline two\nna\xefve\n".encode("latin-1")),
     "latin1.txt:3: expected UTF-8"),
    ("data-broken-jsonl", lambda t: data(t, "c.jsonl", jsonl({"text": "ok"}, '{"text": "unterminated')),
     "c.jsonl:2: expected a line of JSON"),
    ("data-jsonl-missing-field", lambda t: data(t, "c.jsonl", jsonl({"body": "no text field"})),
     "c.jsonl:1: expected a JSON object with a text field 'text'"),
    ("data-jsonl-array", lambda t: data(t, "c.jsonl", jsonl(["text", "in", "a", "list"])), "c.jsonl:1"),
    ("data-jsonl-number-text", lambda t: data(t, "c.jsonl", jsonl({"text": 42})), "c.jsonl:1"),
    ("data-jsonl-null-text", lambda t: data(t, "c.jsonl", jsonl({"text": "fine"}, {"text": None})), "c.jsonl:2"),
    ("data-jsonl-bad-late", lambda t: data(t, "c.jsonl", GOOD_LINES + '{"text": oops}\n'),
     "c.jsonl:401: expected a line of JSON"),
    ("data-jsonl-invalid-utf8", lambda t: data(t, "c.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n'),
     "c.jsonl:2: expected UTF-8"),
    ("data-jsonl-binary", lambda t: data(t, "c.jsonl", b"\x00\x01\x02"), "c.jsonl:1: a NUL byte"),
    ("data-jsonl-only-blank-lines", lambda t: data(t, "c.jsonl", "\n\n   \n"), "every document"),
    ("data-all-documents-empty", lambda t: data(t, "c.jsonl", jsonl({"text": ""}, {"text": "  "})),
     "every document in 1 file(s) is empty"),
    ("data-empty-txt-files", lambda t: folder(t, {"a.txt": "", "b.txt": "\n"}), "every document in 2 file(s) is empty"),
    ("data-wrong-text-field", lambda t: data(t, "c.jsonl", jsonl({"text": "hi"})) + ["--data.text_field", "content"],
     "c.jsonl:1: expected a JSON object with a text field 'content'"),
    ("data-bad-file-in-folder", lambda t: folder(t, {"a.txt": "good text " * 50, "b.jsonl": "{]\n"}), "b.jsonl:1"),
    ("data-no-text-files", lambda t: folder(t, {"notes.md": "# not text data"}), "no .txt or .jsonl file"),
    ("data-missing", lambda t: ["--data.dataset_path", str(t / "nowhere")], "no file or folder"),
    ("data-bad-line-beyond-first-step", lambda t: data(t, "c.jsonl", GOOD_LINES * 3 + "not json\n"),
     "c.jsonl:1201"),
]


@pytest.mark.parametrize("name, setup, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, capsys, name, setup, expected):
    argv = base(tmp_path) + setup(tmp_path)
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, argv, capsys)
    assert_clean_failure(outcome, expected, before=before, root=tmp_path)


def test_late_bad_line_fits_the_up_front_scan():
    """The cases above with a bad line after many good ones are caught before any output only
    because they lie within the scanned prefix; keep the data so."""
    assert len((GOOD_LINES * 3).encode()) < SCAN_BYTES


@pytest.mark.parametrize("extra, expected", [
    (["--optimizer.lr", "inf"], "--optimizer.lr"),
])
def test_bad_input_as_a_user_runs_it(tmp_path, extra, expected):
    """The same contract through `python train.py`, as typed (interpreter start included)."""
    before = snapshot(tmp_path)
    outcome = run_command(python("train.py", *base(tmp_path), *extra))
    assert_clean_failure(outcome, expected, before=before, root=tmp_path)


def preference(tmp: Path, records: list[dict], seq_len: int, *extra: str) -> list[str]:
    """A preference run on these pairs, one pair a step, rows of `seq_len` tokens."""
    return base(tmp) + data(tmp, "pairs.jsonl", jsonl(*records)) + [
        "--data.format", "preference", "--training.local_batch_size", "1", "--training.seq_len", str(seq_len), *extra]


@pytest.mark.parametrize("truncation", ["drop", "keep_start"])
def test_preference_pairs_that_all_are_dropped(tmp_path, capsys, truncation):
    """Pairs none of which fits a row (drop: too long; keep_start: the prompt alone fills it) used
    to leave the run waiting forever for a pair; it ends in one line naming the file, the pairs and
    the seq_len they need whole. That seq_len is the truth: one less fails alike, it trains."""
    records = make_pairs(3)
    path, rule = tmp_path / "data" / "pairs.jsonl", ["--preference.truncation", truncation]
    outcome = run_in_process(train.main, preference(tmp_path, records, 4, *rule), capsys)
    assert_clean_failure(outcome, f"{path}: all 3 pairs dropped: none fits training.seq_len = 4 under "
                                  f"preference.truncation = '{truncation}' (whole, they need seq_len ")
    needs = outcome.stderr.strip().rsplit("seq_len ", 1)[1].rstrip(")")
    least = int(needs.split(" to ")[0])
    if truncation == "keep_start":
        return
    outcome = run_in_process(train.main, preference(tmp_path, records, least - 1, *rule), capsys)
    assert_clean_failure(outcome, f"training.seq_len = {least - 1} under preference.truncation = 'drop' "
                                  f"(whole, they need seq_len {needs})")
    assert run_in_process(train.main, preference(tmp_path, records, least, *rule), capsys).code == 0


def test_empty_preference_file_is_named(tmp_path, capsys):
    argv = base(tmp_path) + data(tmp_path, "pairs.jsonl", "") + ["--data.format", "preference"]
    outcome = run_in_process(train.main, argv, capsys)
    assert_clean_failure(outcome, f"data.dataset_path: no documents in 1 file(s) ({tmp_path / 'data' / 'pairs.jsonl'})")


def config_only_folder(tmp: Path, flavor: str, change: Callable[[dict], object]) -> list[str]:
    """A Hugging Face folder holding the config.json weft writes for `flavor`, changed by `change`
    (config.json is read, and refused, before any tensor)."""
    config = spec_for_flavor(flavor).hf.hf_config(flavors()[flavor], torch.float32)
    change(config)
    write(tmp / "hf" / "config.json", json.dumps(config))
    return ["--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(tmp / "hf")]


# (flavor, the change to its config.json, the error line's text): values transformers accepts in
# a config but no model has (it fails in the forward, divides by zero, or attends to no key).
BAD_HF_VALUES = [
    ("debugmodel_gpt_oss", lambda c: c.update(sliding_window=0), "sliding_window is 0; expected a positive integer"),
    ("debugmodel_gpt_oss", lambda c: c.update(sliding_window=None), "sliding_window is null"),
    ("debugmodel_gpt_oss", lambda c: c["rope_scaling"].update(factor="32"),
     "rope_scaling.factor is '32'; expected a positive number"),
    ("debugmodel_moe", lambda c: c.update(attention_chunk_size=0), "attention_chunk_size is 0"),
    ("debugmodel_qwen3_moe", lambda c: c.update(decoder_sparse_step=0), "decoder_sparse_step is 0"),
    ("debugmodel", lambda c: c.update(num_key_value_heads=-4), "num_key_value_heads is -4"),
    ("debugmodel", lambda c: c.update(head_dim=32.0), "head_dim is 32.0; expected a positive integer"),
    ("debugmodel", lambda c: c.update(rope_theta=0.0), "rope_theta is 0.0; expected a positive number"),
    ("llama3_1b", lambda c: c["rope_scaling"].update(factor=0), "rope_scaling.factor is 0"),
    ("llama3_1b", lambda c: c["rope_scaling"].update(high_freq_factor=1.0),
     "rope_scaling.high_freq_factor is 1.0; expected more than low_freq_factor (1.0)"),
]


@pytest.mark.parametrize("flavor, change, expected", BAD_HF_VALUES, ids=[e for _, _, e in BAD_HF_VALUES])
def test_hf_config_value_no_model_has(tmp_path, capsys, flavor, change, expected):
    argv = base(tmp_path) + config_only_folder(tmp_path, flavor, change)
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, argv, capsys)
    assert_clean_failure(outcome, f"HF folder {tmp_path / 'hf'}: {expected}", before=before, root=tmp_path)
