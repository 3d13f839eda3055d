"""Parquet, Arrow and compressed JSONL sources: the same documents written as `.jsonl` (the
reference) give the same batches, losses and loss masks; resume is exact inside a file; Parquet is
read in row-group batches; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import gzip
import json
import re
import sys
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch

from weft import train
from weft.components.data import DataError, build_loader, check_text_files, find_text_files, sources
from weft.components.data.formats import check_chat_columns, check_prompt_completion_columns

from tests.support import ASSETS
from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.train_runs import run, run_args

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

FORMATS = ["parquet", "arrow", "arrow-stream", "jsonl.gz", "jsonl.zst"]


def speeches(count: int) -> list[str]:
    """The first `count` paragraphs of Macbeth (blank-line separated), of very different lengths."""
    text = (ASSETS / "data" / "shakespeare" / "macbeth.txt").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()][:count]


def write(path: Path, records: list[dict[str, Any]], fmt: str) -> Path:
    """The records as one file of `fmt`: JSONL (plain or compressed) lines, or table rows in
    several row groups / record batches of 5 rows, so positions cross group boundaries."""
    path = path.with_name(f"{path.name}.{fmt.split('-')[0]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    if fmt.startswith("jsonl"):
        if fmt == "jsonl.gz":
            lines = gzip.compress(lines)
        elif fmt == "jsonl.zst":  # two frames: a reader must go on across them
            half = lines.index(b"\n", len(lines) // 2) + 1
            lines = zstandard.compress(lines[:half]) + zstandard.compress(lines[half:])
        path.write_bytes(lines)
        return path
    keys = dict.fromkeys(key for record in records for key in record)  # every record's, not only the first's
    table = pa.Table.from_pydict({key: [record.get(key) for record in records] for key in keys})
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=5)
    else:
        with pa.OSFile(str(path), "wb") as sink:
            opener = pa.ipc.new_stream if fmt == "arrow-stream" else pa.ipc.new_file
            with opener(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=5):
                    writer.write_batch(batch)
    return path


def corpus(root: Path, fmt: str, count: int = 24) -> Path:
    """A folder of two files of `fmt` holding the first `count` paragraphs, with an extra column."""
    docs = speeches(count)
    for i, part in enumerate((docs[: count // 2], docs[count // 2 :])):
        write(root / f"part{i}", [{"id": j, "text": doc} for j, doc in enumerate(part)], fmt)
    return root


def loader_batches(path: Path, tokenizer: Any, n: int, fmt: str = "text", state: dict | None = None,
                   **kwargs: Any) -> tuple[list[tuple[torch.Tensor, ...]], dict]:
    loader = build_loader(fmt, find_text_files(str(path)), tokenizer, seq_len=kwargs.pop("seq_len", 32),
                          local_batch_size=2, cooperate=False, **kwargs)
    if state is not None:
        loader.load_state_dict(state)
    got = [tuple(t for t in b if t is not None) for b in islice(iter(loader), n)]
    return got, loader.state_dict()


def assert_same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))


@pytest.mark.parametrize("fmt", FORMATS)
def test_batches_equal_the_jsonl_ones(tmp_path, tokenizer, fmt):
    """Past the end of the data (the second epoch) too."""
    reference, _ = loader_batches(corpus(tmp_path / "jsonl", "jsonl"), tokenizer, 40)
    got, _ = loader_batches(corpus(tmp_path / fmt, fmt), tokenizer, 40)
    assert_same(got, reference)


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "jsonl.gz", "jsonl.zst"])
@pytest.mark.parametrize("k", [1, 7, 23])
def test_resume_inside_a_file_is_exact(tmp_path, tokenizer, fmt, k):
    path = corpus(tmp_path, fmt)
    uninterrupted, _ = loader_batches(path, tokenizer, k + 6)
    _, state = loader_batches(path, tokenizer, k)
    resumed, _ = loader_batches(path, tokenizer, 6, state=state)
    assert_same(resumed, uninterrupted[k:])


def test_parquet_resume_starts_at_the_row_group_of_the_saved_row(tmp_path, tokenizer, monkeypatch):
    """The state names (file, row + 1); loading it reads from that row's row group on, not the
    groups before it (5 rows each)."""
    path = corpus(tmp_path, "parquet")
    _, state = loader_batches(path, tokenizer, 12)
    assert state["file_index"] == 1 and state["byte_offset"] == 0 and state["line_number"] > 5
    row = state["line_number"] - 1
    groups = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        groups.append(list(kwargs["row_groups"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    loader_batches(path, tokenizer, 1, state=state)
    assert groups[0] == list(range(row // 5, 3))  # part1.parquet's 12 rows: groups 0, 1, 2


def test_parquet_is_read_in_bounded_batches(tmp_path, tokenizer, monkeypatch):
    """Never a whole table: read_table and ParquetFile.read fail if called, and every batch the
    reader yields holds at most ROWS_PER_BATCH rows (here 3 of 12-row files)."""
    path = corpus(tmp_path / "parquet", "parquet")
    reference, _ = loader_batches(corpus(tmp_path / "jsonl", "jsonl"), tokenizer, 12)

    def whole(*args, **kwargs):
        raise AssertionError("the whole table was read")

    monkeypatch.setattr(pq, "read_table", whole)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(sources, "ROWS_PER_BATCH", 3)
    sizes, original = [], pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        assert kwargs["batch_size"] == 3
        for batch in original(self, *args, **kwargs):
            sizes.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    got, _ = loader_batches(path, tokenizer, 12)
    assert_same(got, reference)
    assert sizes and max(sizes) <= 3


def chats() -> list[dict[str, Any]]:
    lines = speeches(16)
    return [{"messages": ([{"role": "system", "content": "Speak as a player."}] if i % 3 == 0 else [])
             + [{"role": "user", "content": lines[i][:80]}, {"role": "assistant", "content": lines[i + 1][:150]}]}
            for i in range(12)]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from weft.components.data import HFTokenizer

    from tests.support.hf_tokenizer import build_tokenizer_folder
    return HFTokenizer(build_tokenizer_folder(tmp_path_factory.mktemp("tok") / "hf"))


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_chat_rows_give_the_jsonl_loss_masks(tmp_path, chat_tokenizer, fmt):
    """Chat records from a `messages` column (list of role/content structs): the same inputs,
    labels (the loss mask), positions and document ids as the same records in JSONL."""
    reference, ref_state = loader_batches(write(tmp_path / "a" / "chats", chats(), "jsonl").parent, chat_tokenizer,
                                          5, "chat", seq_len=64)
    got, state = loader_batches(write(tmp_path / "b" / "chats", chats(), fmt).parent, chat_tokenizer, 5, "chat",
                                seq_len=64)
    assert_same(got, reference)
    assert any((b[1] == -100).any() and (b[1] != -100).any() for b in got)  # masks mask something
    resumed, _ = loader_batches(tmp_path / "b", chat_tokenizer, 2, "chat", state=loader_batches(
        tmp_path / "b", chat_tokenizer, 3, "chat", seq_len=64)[1], seq_len=64)
    assert_same(resumed, got[3:])


def test_prompt_completion_rows_with_a_missing_input(tmp_path, tokenizer):
    """Alpaca rows where some lack `input` (null in the table, absent in the JSONL) read alike."""
    lines = speeches(10)
    records = [{"instruction": lines[i][:60], "output": lines[i + 1][:90], **({"input": "Act I"} if i % 2 else {})}
               for i in range(8)]
    reference, _ = loader_batches(write(tmp_path / "a" / "pc", records, "jsonl").parent, tokenizer, 4,
                                  "prompt_completion", seq_len=64)
    got, _ = loader_batches(write(tmp_path / "b" / "pc", records, "parquet").parent, tokenizer, 4,
                            "prompt_completion", seq_len=64)
    assert_same(got, reference)


def test_a_bad_chat_row_is_named_by_file_and_row(tmp_path, chat_tokenizer):
    records = chats()
    records[4] = {"messages": [{"role": "user", "content": "no answer"}]}
    path = write(tmp_path / "chats", records, "parquet")
    loader = build_loader("chat", [path], chat_tokenizer, seq_len=64, local_batch_size=1, cooperate=False)
    assert loader.check_records() == 12  # the schema is right, the rows are not read: the footer counts them
    with pytest.raises(DataError, match=rf"^{path} row 4: the conversation has no assistant turn"):
        loader_batches(tmp_path, chat_tokenizer, 12, "chat", seq_len=64)


def test_a_null_text_is_named_by_file_and_row(tmp_path, tokenizer):
    path = write(tmp_path / "docs", [{"text": "a"}, {"text": "b"}, {"text": None}, {"text": "c"}], "parquet")
    check_text_files([path])  # the schema is right; the row is found when the loader reaches it
    with pytest.raises(DataError, match=rf"^{path} row 2: expected a string in column 'text', got null$"):
        loader_batches(tmp_path, tokenizer, 4)


def test_find_text_files_accepts_every_form(tmp_path):
    for name in ["a.txt", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst", "e.parquet", "f.arrow", "g.gz", "h.json"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in find_text_files(str(tmp_path))] == [
        "a.txt", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst", "e.parquet", "f.arrow"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no \.txt or \.jsonl file \(nor \.jsonl\.gz, \.jsonl\.zst, \.parquet, "
                                        r"\.arrow\) at or under"):
        find_text_files(str(tmp_path / "empty"))


def test_a_truncated_gzip_stream_is_named_where_it_breaks(tmp_path, tokenizer):
    """The check reads the start; the loader names file:line where decompression fails later."""
    path = write(tmp_path / "docs", [{"text": "x" * 50} for _ in range(2000)], "jsonl.gz")
    path.write_bytes(path.read_bytes()[:-40])
    check_text_files([path])
    with pytest.raises(DataError, match=rf"^{path}:\d+: cannot decompress"):
        loader_batches(tmp_path, tokenizer, 10_000)


# ---------------------------------------------------------------------------------------------
# train.py: the same losses; bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_training_losses_equal_the_jsonl_run(tmp_path):
    losses = {fmt: run(run_args(tmp_path / f"run-{fmt}", seq_len=64, data=corpus(tmp_path / fmt, fmt)))
              for fmt in ["jsonl", "parquet", "jsonl.zst", "jsonl.gz"]}
    assert len(losses["jsonl"]) == 4
    for fmt in ["parquet", "jsonl.zst", "jsonl.gz"]:
        assert losses[fmt] == losses["jsonl"], fmt


def bad_parquet(tmp_path: Path, column: str, values: list) -> Path:
    path = tmp_path / "data" / "docs.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({column: values}), path)
    return path


def no_pyarrow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    return write(tmp_path / "data" / "docs", [{"text": "a"}], "parquet")


def corrupt_zst(tmp_path, monkeypatch):
    path = tmp_path / "data" / "docs.jsonl.zst"
    path.parent.mkdir()
    path.write_bytes(b"this was never zstd\n" * 10)
    return path


def bad_line_gz(tmp_path, monkeypatch):
    return write(tmp_path / "data" / "docs", [{"text": "fine"}, {"text": "fine"}], "jsonl.gz").parent


@pytest.mark.parametrize("make, expected", [
    (lambda tmp, mp: bad_parquet(tmp, "body", ["a", "b"]),
     "data.text_field = 'text': {data}/docs.parquet has no column 'text' (its columns: body)"),
    (lambda tmp, mp: bad_parquet(tmp, "text", [1, 2]),
     "data.text_field = 'text': column 'text' of {data}/docs.parquet holds int64, expected strings"),
    (no_pyarrow, "data.dataset_path: {data}/docs.parquet is a Parquet file, which needs pyarrow: "
                 'pip install "weft[data]"'),
    (corrupt_zst, "{data}/docs.jsonl.zst: cannot decompress"),
    (bad_line_gz, "{data}/docs.jsonl.gz:3: expected a line of JSON"),
], ids=["no-column", "not-strings", "no-pyarrow", "corrupt-zst", "bad-json-gz"])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, make, expected):
    if make is bad_line_gz:
        path = make(tmp_path, monkeypatch) / "docs.jsonl.gz"
        path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes()) + b'{"text": oops}\n'))
    else:
        make(tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, run_args(tmp_path / "run", seq_len=64, data=tmp_path / "data"), capsys)
    assert_clean_failure(outcome, expected.format(data=tmp_path / "data"), before=before, root=tmp_path)
    assert not (tmp_path / "run").exists()


TURN = pa.struct([("role", pa.string()), ("content", pa.string())])


@pytest.mark.parametrize("schema", [
    pa.schema([("messages", pa.list_(TURN))]),
    pa.schema([("messages", pa.large_list(pa.struct([("content", pa.large_string()), ("role", pa.string()),
                                                       ("name", pa.string())]))), ("id", pa.int64())]),
], ids=["list", "large-list-more-fields"])
def test_chat_columns_that_can_hold_records_pass(schema):
    check_chat_columns(schema, "f.parquet")


@pytest.mark.parametrize("schema, expected", [
    (pa.schema([("conversation", pa.list_(TURN))]),
     "data.format = 'chat': f.parquet has no column 'messages' (its columns: conversation: list<item: struct<role: "
     "string, content: string>>)"),
    (pa.schema([("messages", pa.list_(pa.string()))]),
     "data.format = 'chat': column 'messages' of f.parquet holds list<item: string>, expected a list of structs "
     "with string fields 'role' and 'content'"),
    (pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.int32())])))]),
     "data.format = 'chat': column 'messages' of f.parquet holds list<item: struct<role: string, content: int32>>, "
     "expected a list of structs with string fields 'role' and 'content'"),
], ids=["no-column", "list-of-strings", "int-content"])
def test_chat_columns_that_cannot_hold_records_are_named(schema, expected):
    with pytest.raises(DataError) as err:
        check_chat_columns(schema, "f.parquet")
    assert str(err.value) == expected


@pytest.mark.parametrize("columns", [
    {"prompt": pa.string(), "completion": pa.large_string()},
    {"instruction": pa.string(), "output": pa.string()},
    {"instruction": pa.string(), "input": pa.null(), "output": pa.string()},  # an input column of nulls only
    {"prompt": pa.string(), "completion": pa.string(), "input": pa.int64()},  # input is Alpaca's, unused here
], ids=["prompt", "alpaca", "alpaca-null-input", "prompt-int-input"])
def test_prompt_completion_columns_that_can_hold_records_pass(columns):
    check_prompt_completion_columns(pa.schema(list(columns.items())), "f.parquet")


@pytest.mark.parametrize("columns, listed", [
    ({"prompt": pa.string()}, "prompt: string"),
    ({"prompt": pa.string(), "completion": pa.int64()}, "prompt: string, completion: int64"),
    ({"instruction": pa.string(), "input": pa.int64(), "output": pa.string()},
     "instruction: string, input: int64, output: string"),
], ids=["no-completion", "int-completion", "int-input"])
def test_prompt_completion_columns_that_cannot_hold_records_are_named(columns, listed):
    with pytest.raises(DataError) as err:
        check_prompt_completion_columns(pa.schema(list(columns.items())), "f.parquet")
    assert str(err.value) == ("data.format = 'prompt_completion': f.parquet needs string columns 'prompt' and "
                              f"'completion' (or 'instruction', 'output' and an optional 'input'); its columns: {listed}")


def test_parquet_files_of_no_rows_are_refused_at_start_up(tmp_path, tokenizer):
    """Their footers say they hold no rows: the text check and the record check refuse them
    before training, as they refuse empty JSONL files."""
    text = [bad_parquet(tmp_path, "text", pa.array([], pa.string()))]
    with pytest.raises(DataError, match=r"^data.dataset_path: every document in 1 file\(s\) is empty"):
        check_text_files(text)
    records = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "completion": pa.array([], pa.string())}), records)
    loader = build_loader("prompt_completion", [records], tokenizer, seq_len=32, local_batch_size=1, cooperate=False)
    with pytest.raises(DataError, match=rf"^data.dataset_path: no documents in 1 file\(s\) \({re.escape(str(records))}\)$"):
        loader.check_records()
