"""The data fingerprint notices each kind of change, and only a change."""

from __future__ import annotations

import hashlib

import pytest

from weft.components.data.fingerprint import (
    HEAD_BYTES,
    DataChangedError,
    check_resumed_data,
    data_fingerprint,
    difference,
)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"x" * (HEAD_BYTES + 10))
    (root / "sub" / "b.jsonl").write_text('{"text": "hi"}\n')
    return root


def files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_fingerprint_is_names_sizes_and_head_hashes(corpus):
    fingerprint = data_fingerprint(files(corpus), corpus)
    assert fingerprint == {
        "a.txt": {"size": HEAD_BYTES + 10, "head_sha256": hashlib.sha256(b"x" * HEAD_BYTES).hexdigest()},
        "sub/b.jsonl": {"size": 15, "head_sha256": hashlib.sha256(b'{"text": "hi"}\n').hexdigest()},
    }
    assert difference(fingerprint, data_fingerprint(files(corpus), corpus)) is None


@pytest.mark.parametrize("change, said", [
    (lambda root: (root / "a.txt").write_bytes(b"x" * (HEAD_BYTES + 11)), "file a.txt changed (65,546 bytes then, 65,547 now)"),
    (lambda root: (root / "sub" / "b.jsonl").write_text('{"text": "ho"}\n'), "file sub/b.jsonl changed (same size, its first 64 KiB differ)"),
    (lambda root: (root / "sub" / "b.jsonl").unlink(), "file sub/b.jsonl is gone"),
    (lambda root: (root / "c.txt").write_text("new"), "file c.txt is new"),
])
def test_each_change_is_named(corpus, change, said):
    saved = data_fingerprint(files(corpus), corpus)
    change(corpus)
    assert difference(saved, data_fingerprint(files(corpus), corpus)) == said


def test_resume_check_stops_or_notes(corpus, tmp_path):
    step = tmp_path / "step-2"
    step.mkdir()

    def check(allow_changed: bool):
        described = f"data.dataset_path = {str(corpus)!r}"
        return check_resumed_data(data_fingerprint(files(corpus), corpus), described, step, allow_changed=allow_changed)

    text, note = check(False)  # no fingerprint saved yet
    assert note is None
    (step / "data_fingerprint.json").write_text(text)
    (corpus / "a.txt").write_bytes(b"y")
    with pytest.raises(DataChangedError, match=r"file a.txt changed .* since checkpoint .*step-2 was saved"):
        check(False)
    _, note = check(True)
    assert "resuming anyway (data.allow_changed_data = true)" in note


def parquet(path, texts):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)
    return path


def test_a_parquet_file_is_fingerprinted_by_its_footer_alone(tmp_path, monkeypatch):
    """The hash is of the footer pyarrow reads (its serialized metadata, their length, 'PAR1'),
    and every byte the fingerprint reads lies in that footer: no data page is read."""
    pq = pytest.importorskip("pyarrow.parquet")
    path = parquet(tmp_path / "data" / "a.parquet", [f"row {i} " * 50 for i in range(200)])
    data = path.read_bytes()
    footer = pq.read_metadata(path).serialized_size + 8
    assert footer < len(data) // 4  # the data pages are most of the file
    read_ranges = []
    opened = type(path).open

    def recording_open(self, *args, **kwargs):
        f = opened(self, *args, **kwargs)
        read = f.read

        def recorded(n=-1):
            start = f.tell()
            chunk = read(n)
            read_ranges.append((start, start + len(chunk)))
            return chunk
        monkeypatch.setattr(f, "read", recorded, raising=False)
        return f
    monkeypatch.setattr(type(path), "open", recording_open)
    fingerprint = data_fingerprint([path], tmp_path / "data")
    assert fingerprint == {"a.parquet": {"size": len(data), "footer_sha256": hashlib.sha256(data[-footer:]).hexdigest()}}
    assert read_ranges and all(len(data) - footer <= start <= end <= len(data) for start, end in read_ranges)


def test_a_changed_parquet_row_changes_its_footer(tmp_path):
    root = tmp_path / "data"
    path = parquet(root / "a.parquet", ["alpha", "bravo"])
    saved = data_fingerprint([path], root)
    parquet(path, ["alpha", "brave"])  # same size, another maximum in the column's statistics
    assert difference(saved, data_fingerprint([path], root)) == "file a.parquet changed (same size, its Parquet footer differs)"


def test_a_checkpoint_with_the_head_hash_of_a_parquet_file_compares_its_size(tmp_path):
    """A checkpoint saved before footer hashes: the file is the same if its size is."""
    root = tmp_path / "data"
    path = parquet(root / "a.parquet", ["alpha", "bravo"])
    old = {"a.parquet": {"size": path.stat().st_size, "head_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}
    assert difference(old, data_fingerprint([path], root)) is None
    parquet(path, ["alpha", "bravo", "charlie"])
    assert difference(old, data_fingerprint([path], root)).startswith("file a.parquet changed (")
