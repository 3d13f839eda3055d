"""Start-up over a folder of 2,000 small Parquet files reads every file's footer but the data pages
of only the files the first batches take (counted at pyarrow's row-reading entry points, by
benchmarks/data_loader.py's `parquet_data_reads`), and a bad file that its footer can tell of (a
missing or mistyped column, a corrupt footer) is still one line naming it, exit 2, before any
data page is read and before anything is written."""

from __future__ import annotations

import math
import os
from itertools import islice
from pathlib import Path

import pytest
import torch

from benchmarks.data_loader import parquet_data_reads, write_parquet_folder
from weft import train
from weft.components.config import parse_args
from weft.components.data import build_loader
from weft.recipe.plan import RunPlan

from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FILES, ROWS = 2000, 3
SEQ_LEN, BATCH, BATCHES = 64, 2, 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """2,000 Parquet files of 3 rows (columns text, prompt, completion), written once (~0.5 s)."""
    root = tmp_path_factory.mktemp("many") / "data"
    write_parquet_folder(root, FILES, ROWS)
    return root


def args(data: Path, data_format: str, dump: Path | None = None) -> list[str]:
    return ["--job.config_file", "debug_model", "--data.dataset_path", str(data), "--data.format", data_format,
            "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(BATCH),
            "--metrics.enable_tensorboard", "false", *(["--job.dump_folder", str(dump)] if dump else [])]


def column(path: Path, name: str) -> list[str]:
    """A column's values, read here with pyarrow as the reference (outside any counting)."""
    return pq.read_table(path, columns=[name]).column(name).to_pylist()


def files_holding(files: list[Path], tokens_of, needed: int) -> int:
    """How many leading files hold the first `needed` tokens of the stream of their rows."""
    total = 0
    for index, path in enumerate(files):
        total += sum(tokens_of(path, row) for row in range(ROWS))
        if total >= needed:
            return index + 1
    raise AssertionError("the stream is shorter than the batches")


@pytest.mark.parametrize("data_format", ["text", "prompt_completion"])
def test_start_up_reads_the_data_of_only_the_files_the_first_batches_take(folder, data_format):
    """Plan (every start-up check), loader, 3 batches: the files whose data pages were read are
    the first ones, as many as the batches' tokens span and at most two more (whose lengths the
    cursor counted ahead); of the others only the footer was read. Before the footer-only checks, chat and
    prompt/completion read all 2,000 files at start-up."""
    with parquet_data_reads() as reads:
        plan = RunPlan.from_config(parse_args(args(folder, data_format)), 1, device_type="cpu",
                                   writes_dump_folder=False)
        at_plan = set(reads)
        loader = build_loader(data_format, plan.data_files, plan.tokenizer, seq_len=SEQ_LEN, local_batch_size=BATCH,
                              cooperate=False)
        batches = list(islice(loader, BATCHES))
    files, tok = plan.data_files, plan.tokenizer
    assert len(files) == FILES
    if data_format == "text":
        # the reference stream: [BOS] text [EOS] of each row, in file order, cut into windows of 65
        stream = [t for path in files[:20] for text in column(path, "text")
                  for t in [tok.bos_id, *tok.encode(text, bos=False, eos=False), tok.eos_id]]
        windows = torch.tensor(stream[: BATCHES * BATCH * (SEQ_LEN + 1)]).view(BATCHES, BATCH, SEQ_LEN + 1)
        for batch, expected in zip(batches, windows):
            assert torch.equal(batch.inputs, expected[:, :-1]) and torch.equal(batch.labels, expected[:, 1:])
        needed = files_holding(files, lambda path, row: len(tok.encode(column(path, "text")[row])),
                               BATCHES * BATCH * (SEQ_LEN + 1))
        assert at_plan == set()
    else:
        # every packed sample starts with its BOS, padding never: the BOS count is the samples taken
        samples = sum(int((batch.inputs == tok.bos_id).sum()) for batch in batches)
        first = [tok.encode(p, bos=True, eos=False) + tok.encode(c, bos=False, eos=True)
                 for p, c in zip(column(files[0], "prompt"), column(files[0], "completion"))]
        in_window = int((batches[0].inputs[0] == tok.bos_id).sum())
        packed = [t for sample in first[:in_window] for t in sample[:-1]]
        assert batches[0].inputs[0, : len(packed)].tolist() == packed
        needed = math.ceil(samples / ROWS)
        assert at_plan == {str(files[0])}  # the first record, built to check the format at start-up
    read = {Path(name) for name in reads}
    assert needed < 20
    assert any(read == {*files[:n]} for n in range(needed, needed + 3)), sorted(read)


def symlinked_folder(tmp_path: Path, folder: Path, bad: int) -> Path:
    """The 2,000 files (linked), all but file number `bad` (0-based), which the test writes."""
    data = tmp_path / "data"
    data.mkdir()
    for path in sorted(folder.iterdir()):
        if path.name != f"part{bad:05d}.parquet":
            os.symlink(path, data / path.name)
    return data


def no_text_column(path: Path) -> None:
    pq.write_table(pa.table({"body": ["a", "b"]}), path)


def no_completion(path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["c", "d"]}), path)


def corrupt_footer(path: Path) -> None:
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    data = path.read_bytes()
    path.write_bytes(data[:-12] + b"\xff" * 4 + data[-8:])  # garbage in the footer, its length and magic intact


@pytest.mark.parametrize("data_format, make, expected", [
    ("text", no_text_column, "data.text_field = 'text': {bad} has no column 'text' (its columns: body)"),
    ("prompt_completion", no_completion, "data.format = 'prompt_completion': {bad} needs string columns 'prompt' "
                                         "and 'completion' (or 'instruction', 'output' and an optional 'input'); "
                                         "its columns: prompt: string, answer: string"),
    ("text", corrupt_footer, "{bad}: cannot read it as a Parquet file ("),
], ids=["no-text-column", "no-completion-column", "corrupt-footer"])
def test_a_bad_footer_in_the_1500th_file_is_one_line_before_any_data_is_read(tmp_path, capsys, folder, data_format,
                                                                              make, expected):
    data = symlinked_folder(tmp_path, folder, bad=1499)
    make(data / "part01499.parquet")
    before = snapshot(tmp_path)
    with parquet_data_reads() as reads:
        outcome = run_in_process(train.main, args(data, data_format, tmp_path / "run"), capsys)
    assert_clean_failure(outcome, expected.format(bad=data / "part01499.parquet"), before=before, root=tmp_path)
    assert not (tmp_path / "run").exists()
    assert not reads  # no file's data pages: the footers told
