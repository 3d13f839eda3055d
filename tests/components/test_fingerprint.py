"""The data fingerprint notices each kind of change, and only a change."""

from __future__ import annotations

import hashlib

import pytest

from weft.components.fingerprint import HEAD_BYTES, DataChangedError, check_resumed_data, data_fingerprint, difference


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
