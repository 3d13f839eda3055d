"""Compressed plain text, and damaged compressed files (components/data/files.py, sources.py).

A folder of `.txt.gz` / `.txt.zst` files gives exactly the windows, loader states and resumes of
the same `.txt` files (the reference), alone, mixed with `.txt` files and as mixture sources. A
compressed file of any kind cut short or with a changed byte is refused naming it: at start-up
when the check reads it whole, else when the loader reaches it, the batches before the damage
being those of the whole file (never read short, never a quiet end of the data).
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch

from weft import train
from weft.components.data import SCAN_BYTES, DataError, Tokenizer, build_loader, check_text_files, find_text_files
from weft.components.data.mixture import Mixture, source_names
from weft.components.data.prepare import main as prepare

from tests.support import ASSETS
from tests.support.failure_checks import assert_clean_failure, python, run_command, run_in_process, snapshot
from tests.support.train_runs import run

zstandard = pytest.importorskip("zstandard")


def zst(data: bytes) -> bytes:
    """Two frames, each with a content checksum (as the zstd command line writes them): a reader
    must go on across frames, and can tell a changed byte."""
    half = data.index(b"\n", len(data) // 2) + 1 if b"\n" in data[len(data) // 2 :] else len(data)
    compressor = zstandard.ZstdCompressor(write_checksum=True)
    return compressor.compress(data[:half]) + compressor.compress(data[half:])


COMPRESS: dict[str, Callable[[bytes], bytes]] = {"gz": gzip.compress, "zst": zst}


def write(path: Path, data: bytes) -> Path:
    """`data` at `path`, compressed as its suffix says (.gz, .zst; else plain)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(COMPRESS.get(path.suffix[1:], lambda d: d)(data))
    return path


def texts(count: int = 6) -> list[bytes]:
    """`count` documents of different lengths: runs of Macbeth's paragraphs."""
    text = (ASSETS / "data" / "shakespeare" / "macbeth.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    return ["\n\n".join(paragraphs[4 * i : 4 * i + 2 + i]).encode() + b"\n" for i in range(count)]


def text_folder(root: Path, suffixes: list[str]) -> Path:
    """texts() as part<i><suffix>, file i compressed as suffixes[i] says."""
    for i, (doc, suffix) in enumerate(zip(texts(len(suffixes)), suffixes)):
        write(root / f"part{i}{suffix}", doc)
    return root


def big_text(size: int) -> bytes:
    """`size` bytes or so of Macbeth's words in a seeded random order (compresses about 3:1), in lines."""
    words = (ASSETS / "data" / "shakespeare" / "macbeth.txt").read_text(encoding="utf-8").split()
    rng, lines, total = random.Random(0), [], 0
    while total < size:
        lines.append(" ".join(rng.choices(words, k=12)))
        total += len(lines[-1]) + 1
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ASSETS / "tokenizer" / "shakespeare.model")


def loader(path: Path, tokenizer: Any, **kwargs: Any):
    files = find_text_files(str(path))
    check_text_files(files)
    return build_loader("text", files, tokenizer, seq_len=kwargs.pop("seq_len", 32),
                        local_batch_size=kwargs.pop("local_batch_size", 2), cooperate=False, **kwargs)


def batches_and_states(path: Path, tokenizer: Any, n: int, state: dict | None = None) -> tuple[list, list[dict]]:
    """n batches (inputs, labels) and the loader's state after each."""
    one = loader(path, tokenizer)
    if state is not None:
        one.load_state_dict(state)
    got, states = [], []
    for batch in islice(iter(one), n):
        got.append((batch.inputs, batch.labels))
        states.append(one.state_dict())
    return got, states


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


# ---------------------------------------------------------------------------------------------
# compressed .txt reads as .txt
# ---------------------------------------------------------------------------------------------

PLAIN = [".txt"] * 6
FOLDERS = {"txt.gz": [".txt.gz"] * 6, "txt.zst": [".txt.zst"] * 6,
           "mixed": [".txt", ".txt.gz", ".txt.zst", ".txt.zst", ".txt", ".txt.gz"]}


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_windows_and_states_equal_the_plain_text_ones(tmp_path, tokenizer, kind):
    """Over several epochs, and the loader state (the checkpointed data position) after every
    batch is the plain files' too."""
    reference, reference_states = batches_and_states(text_folder(tmp_path / "txt", PLAIN), tokenizer, 90)
    got, states = batches_and_states(text_folder(tmp_path / kind, FOLDERS[kind]), tokenizer, 90)
    assert reference_states[-1]["epoch"] >= 1  # the run went round the files
    assert_same(got, reference)
    assert states == reference_states


@pytest.mark.parametrize("kind", ["txt.gz", "txt.zst"])
@pytest.mark.parametrize("k", [1, 9, 40])
def test_resume_is_exact(tmp_path, tokenizer, kind, k):
    """A state saved by the plain run resumes the compressed one where the plain one goes on."""
    plain = text_folder(tmp_path / "txt", PLAIN)
    uninterrupted, states = batches_and_states(plain, tokenizer, k + 8)
    resumed, _ = batches_and_states(text_folder(tmp_path / kind, FOLDERS[kind]), tokenizer, 8, state=states[k - 1])
    assert_same(resumed, uninterrupted[k:])


def test_a_mixture_of_compressed_sources_draws_the_plain_windows(tmp_path, tokenizer):
    def mixture(kinds: list[str]) -> Mixture:
        loaders = [loader(text_folder(tmp_path / f"{kind}-{i}", [f".{kind}"] * 3 if i else PLAIN[:3]), tokenizer,
                          seq_len=16, local_batch_size=1) for i, kind in enumerate(kinds)]
        return Mixture(["a", "b"], loaders, [3.0, 1.0], local_batch_size=3)

    reference = [(b.inputs, b.labels) for b in islice(iter(mixture(["txt", "txt"])), 30)]
    got = [(b.inputs, b.labels) for b in islice(iter(mixture(["txt.gz", "txt.zst"])), 30)]
    assert_same(got, reference)


def test_a_compressed_source_is_named_without_its_suffixes():
    """A mixture source's name (in metrics and checkpoints) drops `.txt.gz` whole, as it drops `.txt`."""
    assert source_names(["corpus/books.txt.gz", "corpus/web.txt.zst", "corpus/code.txt"]) == ["books", "web", "code"]


def test_a_big_compressed_text_is_read_whole(tmp_path, tokenizer):
    """A document far longer than the start-up scan and the reader's buffers, across two zstd
    frames: its tokens are those of the plain file."""
    data = big_text(9 * 2**17)
    for suffix in (".txt", ".txt.gz", ".txt.zst"):
        write(tmp_path / suffix[1:] / f"big{suffix}", data)
    reference = next(iter(loader(tmp_path / "txt", tokenizer, seq_len=2**16)))
    for kind in ("txt.gz", "txt.zst"):
        got = next(iter(loader(tmp_path / kind, tokenizer, seq_len=2**16)))
        assert torch.equal(got.inputs, reference.inputs), kind


def test_prepare_writes_the_shards_of_the_plain_text(tmp_path):
    """`python -m weft.components.data.prepare` reads a compressed folder as the text loader does."""
    def shards(kind: str) -> list[bytes]:
        out = tmp_path / f"shards-{kind}"
        assert prepare(["--source", str(text_folder(tmp_path / kind, FOLDERS.get(kind, PLAIN))), "--tokenizer",
                        str(ASSETS / "tokenizer" / "shakespeare.model"), "--out", str(out)]) == 0
        return [path.read_bytes() for path in sorted(out.glob("shard_*"))]

    reference = shards("txt")
    assert len(reference) == 12  # ids and boundaries of each of the 6 files
    assert shards("mixed") == reference


def test_a_record_format_refuses_compressed_text(tmp_path, tokenizer):
    path = write(tmp_path / "notes.txt.zst", b"plain text\n")
    with pytest.raises(DataError, match=rf"^data.dataset_path: '{path}' is not a JSONL, Parquet or Arrow file, "
                                        r"which data.format = 'chat' reads$"):
        build_loader("chat", [path], tokenizer, seq_len=32, local_batch_size=1, cooperate=False)


def test_other_compressions_are_not_taken_for_text(tmp_path):
    for name in ["a.txt.gz", "b.txt.zst", "c.txt.bz2", "d.gz", "e.zst", "f.txt.xz"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in find_text_files(str(tmp_path))] == ["a.txt.gz", "b.txt.zst"]
    (tmp_path / "a.txt.gz").unlink()
    (tmp_path / "b.txt.zst").unlink()
    with pytest.raises(DataError, match=r"at or under '.*', nor a \.txt\.gz or \.txt\.zst one$"):
        find_text_files(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# damaged compressed files
# ---------------------------------------------------------------------------------------------

KINDS = ["jsonl.gz", "jsonl.zst", "txt.gz", "txt.zst"]


def content(kind: str, data: bytes) -> bytes:
    """`data` as the file's content: text, or JSONL lines of its lines."""
    if kind.startswith("txt"):
        return data
    return b"".join(json.dumps({"text": line}).encode() + b"\n" for line in data.decode().splitlines())


def damage(path: Path, how: str, where: float = 0.5) -> Path:
    """Cut the file at `where` of its length, or change one byte there."""
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    if how == "cut":
        del data[at:]
    else:
        data[at] ^= 0x55
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["cut", "byte"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_small_file_is_refused_at_start_up(tmp_path, kind, how):
    """Alone, and beside a whole file: the start-up check reads it whole and names it."""
    data = content(kind, big_text(SCAN_BYTES // 2))
    whole = write(tmp_path / f"a.{kind}", data)
    damaged = damage(write(tmp_path / f"b.{kind}", data), how, where=0.4)
    for files in ([damaged], [whole, damaged]):
        with pytest.raises(DataError, match=rf"^{damaged}: cannot decompress \(.+\)$"):
            check_text_files(files)
    check_text_files([whole])


class Recording:
    """A tokenizer that records every text it encodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.texts = tokenizer, []

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self.texts.append(text)
        return self.tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("how", ["cut", "byte"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_file_damaged_past_the_scan_is_refused_when_the_loader_reaches_it(tmp_path, tokenizer, kind, how):
    """The start-up check reads only the start; the loader, reaching the file, refuses it naming
    it (and the line it broke in, if a JSONL file) before any of its documents is tokenized (a changed byte spoils the bytes after it, and
    gzip's CRC or zstd's checksum tells only at the stream's end), after the very batches the
    whole files give, instead of ending the data early."""
    first = content(kind, texts(1)[0])
    for folder in ("whole", "damaged"):
        write(tmp_path / folder / f"a.{kind}", first)
        write(tmp_path / folder / f"b.{kind}", content(kind, big_text(2 * 2**20)))
    damaged = damage(tmp_path / "damaged" / f"b.{kind}", how, where=0.75)
    check_text_files(find_text_files(str(tmp_path / "damaged")))
    recording, got = Recording(tokenizer), []
    with pytest.raises(DataError, match=rf"^{damaged}(:\d+)?: cannot decompress \(.+\)$"):
        for batch in islice(loader(tmp_path / "damaged", recording, seq_len=64, local_batch_size=2), 20_000):
            got.append((batch.inputs, batch.labels))
    reference = [(b.inputs, b.labels) for b in islice(iter(loader(tmp_path / "whole", tokenizer, seq_len=64,
                                                                   local_batch_size=2)), len(got))]
    assert_same(got, reference)
    first_documents = [first.decode()] if kind.startswith("txt") else [
        json.loads(line)["text"] for line in first.splitlines()]
    assert recording.texts and set(recording.texts) <= set(first_documents)


def train_args(dump: Path, data: Path, steps: int = 4) -> list[str]:
    return ["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--metrics.enable_tensorboard", "false", "--data.dataset_path", str(data)]


def test_a_cut_jsonl_zst_beside_a_whole_one_stops_train_py(tmp_path):
    """As a user runs it: exit 2, one line naming the cut file, nothing written."""
    data = content("jsonl.zst", big_text(20_000))
    write(tmp_path / "data" / "a.jsonl.zst", data)
    damage(write(tmp_path / "data" / "b.jsonl.zst", data), "cut")
    before = snapshot(tmp_path)
    outcome = run_command(python("train.py", *train_args(tmp_path / "run", tmp_path / "data")))
    assert_clean_failure(outcome, f"{tmp_path / 'data' / 'b.jsonl.zst'}: cannot decompress (the file ends inside "
                                  "a zstd frame: it was cut short)", before=before, root=tmp_path)


@pytest.mark.parametrize("kind", ["txt.gz", "txt.zst"])
def test_a_cut_compressed_text_stops_the_run(tmp_path, capsys, kind):
    write(tmp_path / "data" / f"a.{kind}", texts(1)[0])
    cut = damage(write(tmp_path / "data" / f"b.{kind}", texts(2)[1]), "cut")
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, train_args(tmp_path / "run", tmp_path / "data"), capsys)
    assert_clean_failure(outcome, f"{cut}: cannot decompress", before=before, root=tmp_path)


@pytest.mark.slow
def test_a_cut_file_the_run_reaches_stops_it_with_exit_2(tmp_path, capsys):
    """A folder of a whole .txt and a .jsonl.zst too big for the start-up check to read whole, cut
    short: the run trains on the .txt, then stops in one line naming the cut file where the
    loader reaches it (exit 2), instead of training on what the cut file held."""
    write(tmp_path / "data" / "a.txt", big_text(4000))  # about ten steps' tokens
    cut = damage(write(tmp_path / "data" / "b.jsonl.zst", content("jsonl.zst", big_text(4 * SCAN_BYTES))), "cut",
                 where=0.8)
    outcome = run_in_process(train.main, train_args(tmp_path / "run", tmp_path / "data", steps=40), capsys)
    errors = [line for line in outcome.stderr.splitlines() if line.startswith("weft: error: ")]
    assert outcome.code == 2 and len(errors) == 1, outcome.stderr
    assert errors[0].startswith(f"weft: error: {cut}:") and errors[0].endswith(
        ": cannot decompress (the file ends inside a zstd frame: it was cut short)")
    assert "step      1" in outcome.stdout and "done:" not in outcome.stdout  # it trained, then stopped


@pytest.mark.slow
def test_training_on_a_folder_of_compressed_text_gives_the_plain_losses(tmp_path):
    plain = run(train_args(tmp_path / "run-txt", text_folder(tmp_path / "txt", PLAIN)))
    mixed = run(train_args(tmp_path / "run-mixed", text_folder(tmp_path / "mixed", FOLDERS["mixed"])))
    assert len(plain) == 4
    assert mixed == plain
