"""Token shards (components/data/prepare.py, components/data/shards.py): the prepared ids against the
tokenizer itself, the same bytes whatever the number of workers, the same batches and losses as the
text loader on the same corpus (one process, fsdp 2, resumed), and every bad input refused in one line."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from weft import train
from weft.components.data import build_loader, load_tokenizer
from weft.components.data.prepare import main as prepare_main
from weft.components.data.shards import read_manifest, shard_dtype

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run, run_args

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "assets/tokenizer/shakespeare.model"
PLAYS = sorted((ROOT / "assets/data/shakespeare").glob("*.txt"))


def make_corpus(folder: Path) -> Path:
    """Slices of the shipped plays: a .txt, a .jsonl of short speeches (a blank line among them), a .txt."""
    folder.mkdir(parents=True)
    text = [p.read_text() for p in PLAYS[:3]]
    (folder / "a.txt").write_text(text[0][:600])
    lines = [json.dumps({"text": text[1][i * 250:(i + 1) * 250]}) for i in range(12)]
    (folder / "b.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    (folder / "c.txt").write_text(text[2][:800])
    return folder


def prepare(source: Path, out: Path, *extra: str) -> int:
    return prepare_main(["--source", str(source), "--tokenizer", str(TOKENIZER), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(the text corpus, its shards)."""
    root = tmp_path_factory.mktemp("shards")
    source = make_corpus(root / "corpus")
    assert prepare(source, root / "shards") == 0
    return source, root / "shards"


def source_documents(source: Path) -> list[str]:
    """The corpus's documents as the README defines them: a .txt file, a non-blank .jsonl line."""
    docs = []
    for path in sorted(source.iterdir()):
        if path.suffix == ".txt":
            docs.append(path.read_text())
        else:
            docs += [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    return docs


def test_shards_hold_each_document_wrapped_in_bos_and_eos(corpus):
    source, shards = corpus
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
    expected = [[sp.bos_id(), *sp.encode(doc), sp.eos_id()] for doc in source_documents(source)]
    manifest = json.loads((shards / "manifest.json").read_text())
    found = []
    for shard in manifest["shards"]:
        ids = np.fromfile(shards / f"{shard['name']}.tokens", dtype=np.uint16)
        offsets = np.fromfile(shards / f"{shard['name']}.offsets", dtype=np.uint64)
        assert (len(ids), len(offsets) - 1) == (shard["tokens"], shard["documents"])
        found += [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    assert found == expected
    assert manifest["format_version"] == 1 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"] == {"name": "shakespeare.model", "vocab_size": sp.vocab_size(),
                                     "sha256": hashlib.sha256(TOKENIZER.read_bytes()).hexdigest()}
    assert manifest["total_tokens"] == sum(map(len, expected)) and manifest["total_documents"] == len(expected) == 14
    assert [(s["name"], s["size"]) for s in manifest["sources"]] == \
        [(p.name, p.stat().st_size) for p in sorted(source.iterdir())]
    assert manifest["sources"][0]["head_sha256"] == hashlib.sha256((source / "a.txt").read_bytes()).hexdigest()


def same_bytes(one: Path, two: Path) -> bool:
    names = sorted(p.name for p in one.iterdir())
    return names == sorted(p.name for p in two.iterdir()) and \
        all((one / n).read_bytes() == (two / n).read_bytes() for n in names)


def test_two_workers_write_the_same_bytes(corpus, tmp_path):
    source, shards = corpus
    assert prepare(source, tmp_path / "two", "--workers", "2") == 0
    assert same_bytes(shards, tmp_path / "two")
    assert prepare(source, tmp_path / "cut1", "--shard-bytes", "700") == 0
    assert prepare(source, tmp_path / "cut2", "--shard-bytes", "700", "--workers", "2") == 0
    assert same_bytes(tmp_path / "cut1", tmp_path / "cut2")


def test_a_compressed_source_gives_the_same_shards(corpus, tmp_path):
    source, shards = corpus
    gz = tmp_path / "gz"
    gz.mkdir()
    for path in source.iterdir():
        if path.suffix == ".jsonl":
            (gz / (path.name + ".gz")).write_bytes(gzip.compress(path.read_bytes()))
        else:
            (gz / path.name).write_bytes(path.read_bytes())
    assert prepare(gz, tmp_path / "out") == 0
    assert all((shards / p.name).read_bytes() == p.read_bytes() for p in (tmp_path / "out").glob("shard_*"))
    assert len(list((tmp_path / "out").glob("shard_*"))) == 6


def test_a_jsonl_file_cut_into_shards_reads_the_same(corpus, tmp_path):
    """b.jsonl (12 records of ~260 bytes) cut every 700 bytes: at the first line start after each."""
    source, shards = corpus
    assert prepare(source, tmp_path / "cut", "--shard-bytes", "700") == 0
    manifest = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    lines = (source / "b.jsonl").read_bytes().splitlines(keepends=True)
    ends, size, start = [], 0, 0
    for line in lines:  # the plain reference: a piece ends with the line holding byte start + 699
        size += len(line)
        if size > start + 699 or size == len(b"".join(lines)):
            ends.append(size)
            start = size
    assert len(ends) >= 4
    assert [s["documents"] for s in manifest["shards"]][1:-1] == \
        [sum(1 for line in b"".join(lines)[a:b].splitlines() if line.strip()) for a, b in zip([0, *ends], ends)]
    text, _ = loaders(corpus, local_batch_size=2)
    tok = load_tokenizer(TOKENIZER)
    cut = build_loader("text", [tmp_path / "cut" / f"{s['name']}.tokens" for s in manifest["shards"]], tok,
                       seq_len=64, local_batch_size=2, cooperate=False)
    a, b = iter(text), iter(cut)
    assert all(next(a).inputs.tolist() == next(b).inputs.tolist() for _ in range(30))


def loaders(corpus, **kwargs):
    source, shards = corpus
    tok = load_tokenizer(TOKENIZER)
    files = json.loads((shards / "manifest.json").read_text())["shards"]
    shard_files = [shards / f"{s['name']}.tokens" for s in files]
    make = lambda f: build_loader("text", f, tok, seq_len=64, cooperate=False, **kwargs)  # noqa: E731
    return make(sorted(source.iterdir())), make(shard_files)


@pytest.mark.parametrize("dp_rank, dp_world_size", [(0, 1), (1, 2)])
def test_the_same_batches_and_states_as_text_over_epochs(corpus, dp_rank, dp_world_size):
    text, shards = loaders(corpus, local_batch_size=2, dp_rank=dp_rank, dp_world_size=dp_world_size)
    text_it, shard_it = iter(text), iter(shards)
    total = json.loads((corpus[1] / "manifest.json").read_text())["total_tokens"]
    for _ in range(5 * total // (2 * 2 * 65 * dp_world_size)):  # 2.5 epochs
        a, b = next(text_it), next(shard_it)
        assert a.inputs.tolist() == b.inputs.tolist() and a.labels.tolist() == b.labels.tolist()
    assert shards.state_dict()["epoch"] >= 2


def test_resumed_loader_continues_on_the_next_window(corpus):
    _, first = loaders(corpus, local_batch_size=2)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    expected = [next(it).inputs.tolist() for _ in range(6)]
    _, second = loaders(corpus, local_batch_size=1, dp_rank=0, dp_world_size=2)  # another layout
    second.load_state_dict(state)
    it = iter(second)
    assert [next(it).inputs.tolist() for _ in range(6)] == [rows[:1] for rows in expected]


def args(dump: Path, data: Path, *extra: str) -> list[str]:
    return run_args(dump, *extra, seq_len=64, data=data)


CHECKPOINTS = ("--checkpoint.enable", "--checkpoint.interval", "2")


@pytest.mark.slow
def test_training_losses_equal_text_with_document_masking(corpus, tmp_path):
    source, shards = corpus
    masking = ("--data.document_masking",)
    text = run(args(tmp_path / "text", source, *masking))
    assert run(args(tmp_path / "shards", shards, *masking)) == text and len(text) == 4


def fsdp2_losses(dump: str, source: str, shards: str) -> tuple[list[float], list[float]]:
    fsdp = ("--parallelism.dp_shard", "2", "--training.local_batch_size", "1")
    return run(args(Path(dump) / "text", Path(source), *fsdp)), run(args(Path(dump) / "shards", Path(shards), *fsdp))


@pytest.mark.slow
def test_fsdp2_losses_equal_text(corpus, tmp_path):
    source, shards = corpus
    text, from_shards = run_distributed(fsdp2_losses, 2, str(tmp_path), str(source), str(shards))[0]
    assert from_shards == text and len(text) == 4


@pytest.mark.slow
def test_resumed_shard_run_equals_the_straight_one(corpus, tmp_path):
    _, shards = corpus
    straight = run(args(tmp_path / "straight", shards))
    first = run(args(tmp_path / "resumed", shards, *CHECKPOINTS), stop_after=2)
    assert len(first) == 2 and first + run(args(tmp_path / "resumed", shards, *CHECKPOINTS)) == straight


def refused(capsys, argv: list[str], dump: Path) -> str:
    assert train.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert not dump.exists()
    return lines[-1]


def copy_shards(shards: Path, to: Path) -> Path:
    to.mkdir()
    for path in shards.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def test_shards_of_another_tokenizer_are_refused(corpus, tmp_path, capsys):
    shards = copy_shards(corpus[1], tmp_path / "other")
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["tokenizer"] = {"name": "llama.model", "vocab_size": 32000, "sha256": "ab" * 32}
    (shards / "manifest.json").write_text(json.dumps(manifest))
    line = refused(capsys, args(tmp_path / "dump", shards), tmp_path / "dump")
    assert line.startswith("weft: error: model.tokenizer_path = '") and line.endswith(
        f"shakespeare.model': the shards in {shards} were made with another tokenizer ('llama.model', vocabulary "
        "32000, sha256 abababababab) than this one ('shakespeare.model', vocabulary 2048, sha256 "
        f"{hashlib.sha256(TOKENIZER.read_bytes()).hexdigest()[:12]})")


def test_a_shard_of_the_wrong_size_is_refused(corpus, tmp_path, capsys):
    shards = copy_shards(corpus[1], tmp_path / "cut")
    path = shards / "shard_00001.tokens"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-2])
    line = refused(capsys, args(tmp_path / "dump", shards), tmp_path / "dump")
    assert line == (f"weft: error: data.dataset_path: shard {path} holds {size - 2:,} bytes; manifest.json expects "
                    f"{size:,} bytes; the shard is corrupt or incomplete: prepare the shards again")


def test_an_unknown_format_version_is_refused(corpus, tmp_path, capsys):
    shards = copy_shards(corpus[1], tmp_path / "future")
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    line = refused(capsys, args(tmp_path / "dump", shards), tmp_path / "dump")
    assert line == (f"weft: error: data.dataset_path: {shards / 'manifest.json'} has format_version 2; this weft reads "
                    "version 1 (prepare the shards again with python -m weft.components.data.prepare)")


def test_a_bad_token_id_mid_run_names_the_shard_and_offset(corpus, tmp_path, capsys):
    shards = copy_shards(corpus[1], tmp_path / "bad")
    path = shards / "shard_00001.tokens"  # the jsonl's second record, read by step 3
    ids = np.fromfile(path, dtype=np.uint16)
    ids[100] = 4000  # the vocabulary has 2048
    ids.tofile(path)
    argv = args(tmp_path / "dump", shards, "--checkpoint.enable", "--checkpoint.interval", "1")
    assert train.main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"weft: error: {path}: token 100 is id 4000, outside the tokenizer's vocabulary (2048); "
                    "the shard is corrupt")
    assert (tmp_path / "dump" / "checkpoint" / "step-1").is_dir()


def test_prepare_refuses_bad_input_and_leaves_nothing(corpus, tmp_path, capsys):
    source, shards = corpus

    def refuse(out: Path, *argv: str) -> str:
        assert prepare_main(["--out", str(out), *argv]) == 2
        assert sorted(p.name for p in out.parent.iterdir()) == before
        return capsys.readouterr().err.strip()

    before = sorted(p.name for p in shards.parent.iterdir())
    tok = ("--tokenizer", str(TOKENIZER))
    assert refuse(shards, "--source", str(source), *tok) == \
        f"weft: error: --out = {shards}: already exists; expected a new folder (shards are never overwritten)"
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert refuse(out, "--source", str(tmp_path / "none"), *tok) == \
        f"weft: error: --source: no file or folder at '{tmp_path / 'none'}'"
    assert refuse(out, "--source", str(source), "--tokenizer", str(tmp_path / "none.model")) == \
        f"weft: error: --tokenizer = {tmp_path / 'none.model'}: no tokenizer file or folder"
    late = tmp_path / "late.jsonl"  # a bad record past what the start-up check reads: found while tokenizing
    late.write_text(('{"text": "' + "x" * 100 + '"}\n') * 700 + "not json\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert refuse(out, "--source", str(late), *tok).startswith(f"weft: error: {late}:701: expected a line of JSON")
    for cut in ("1000", "20000"):  # in a later piece of the file, the line number is still the file's
        assert refuse(out, "--source", str(late), *tok, "--shard-bytes", cut).startswith(f"weft: error: {late}:701: ")


def test_a_shard_loader_never_tokenizes(corpus, monkeypatch):
    _, shards = loaders(corpus, local_batch_size=2)
    monkeypatch.setattr(shards.tokenizer, "encode", None)  # calling it would raise
    it = iter(shards)
    assert all(next(it).inputs.shape == (2, 64) for _ in range(20))


def test_shards_in_a_record_format_are_refused(corpus, tmp_path, capsys):
    line = refused(capsys, args(tmp_path / "dump", corpus[1], "--data.format", "prompt_completion"), tmp_path / "dump")
    assert line == "weft: error: data.format = 'prompt_completion': token shards hold text windows; expected 'text'"


def validation_losses(dump: Path) -> list[float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["validation/loss"] for r in records if "validation/loss" in r]


@pytest.mark.slow
def test_validation_on_shards_equals_validation_on_text(corpus, tmp_path):
    source, shards = corpus
    for name, data in [("text", source), ("shards", shards)]:
        run(args(tmp_path / name, source, "--validation.enable", "--validation.dataset_path", str(data),
                 "--validation.freq", "2", "--validation.steps", "2"))
    assert validation_losses(tmp_path / "shards") == validation_losses(tmp_path / "text")
    assert len(validation_losses(tmp_path / "text")) == 2


def test_uint32_shards_read_the_same_ids(corpus, tmp_path):
    """A vocabulary over 65,536 ids is kept as uint32: the same shards widened read the same batches."""
    assert (shard_dtype(2**16), shard_dtype(2**16 + 1)) == (np.dtype("<u2"), np.dtype("<u4"))
    wide = copy_shards(corpus[1], tmp_path / "wide")
    manifest = json.loads((wide / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = wide / f"{shard['name']}.tokens"
        np.fromfile(path, dtype="<u2").astype("<u4").tofile(path)
    (wide / "manifest.json").write_text(json.dumps({**manifest, "dtype": "uint32"}))
    _, narrow = loaders(corpus, local_batch_size=2)
    widened = build_loader("text", read_manifest(wide).token_files, load_tokenizer(TOKENIZER), seq_len=64,
                           local_batch_size=2, cooperate=False)
    a, b = iter(narrow), iter(widened)
    assert all(next(a).inputs.tolist() == next(b).inputs.tolist() for _ in range(20))
