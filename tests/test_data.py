import json
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
import torch

from components.data import (
    DataError,
    Tokenizer,
    TokenWindowLoader,
    build_dataloader,
    find_text_files,
)

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TOKENIZER_PATH = ASSETS / "tokenizer" / "shakespeare.model"
CORPUS_DIR = ASSETS / "data" / "shakespeare"

# Documents of very different lengths: some fit many times in a window, one spans many windows.
DOCS = [
    "When shall we three meet again\nIn thunder, lightning, or in rain?",
    "Fair is foul, and foul is fair:\nHover through the fog and filthy air.",
    "",
    " ".join(f"Tomorrow, and tomorrow, and tomorrow {i}," for i in range(12)),
    "Out, out, brief candle!",
    "Double, double toil and trouble; fire burn and caldron bubble.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(TOKENIZER_PATH)


def reference_windows(docs: list[str], seq_len: int, count: int) -> list[list[int]]:
    """The first `count` windows, built straight from SentencePiece: [BOS] doc [EOS], looped."""
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER_PATH))
    epoch = [tok for doc in docs for tok in [sp.bos_id(), *sp.encode(doc), sp.eos_id()]]
    size = seq_len + 1
    stream = epoch * (count * size // len(epoch) + 1)
    return [stream[i * size : (i + 1) * size] for i in range(count)]


def write_txt(root: Path, docs: list[str]) -> list[Path]:
    """One file per document, half of them in a nested folder, named so sorting keeps order."""
    paths = []
    for i, doc in enumerate(docs):
        path = root / ("a" if i < len(docs) // 2 else "b/c") / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc, encoding="utf-8")
        paths.append(path)
    return paths


def write_jsonl(root: Path, docs: list[str], field: str = "text") -> list[Path]:
    """The documents split over two .jsonl files, with a blank line and an extra field."""
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / "part0.jsonl", root / "part1.jsonl"]
    half = len(docs) // 2
    for path, part in zip(paths, (docs[:half], docs[half:])):
        lines = [json.dumps({"id": i, field: doc}) for i, doc in enumerate(part)]
        path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n", encoding="utf-8")
    return paths


@pytest.fixture(params=["txt", "jsonl"])
def corpus(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A dataset folder holding DOCS in the given format."""
    (write_txt if request.param == "txt" else write_jsonl)(tmp_path / "data", DOCS)
    return str(tmp_path / "data")


def make_loader(path: str, tokenizer: Tokenizer, **kwargs: Any) -> TokenWindowLoader:
    options = {"seq_len": 7, "local_batch_size": 2, "dp_rank": 0, "dp_world_size": 1} | kwargs
    return build_dataloader(path, tokenizer, **options)


def batches(loader: TokenWindowLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(islice(loader, n))


def test_windows_match_reference_stream(corpus: str, tokenizer: Tokenizer) -> None:
    seq_len, batch_size, steps = 7, 2, 40  # 40 * 2 * 8 tokens: over two epochs of DOCS
    loader = make_loader(corpus, tokenizer, seq_len=seq_len, local_batch_size=batch_size)
    windows = torch.tensor(reference_windows(DOCS, seq_len, steps * batch_size))
    for step, (inputs, labels) in enumerate(batches(loader, steps)):
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape == (batch_size, seq_len)
        expected = windows[step * batch_size : (step + 1) * batch_size]
        assert torch.equal(inputs, expected[:, :-1])
        assert torch.equal(labels, expected[:, 1:])
        assert torch.equal(labels[:, :-1], inputs[:, 1:])
    assert loader.state_dict()["epoch"] >= 2


def test_each_iter_continues_the_stream(corpus: str, tokenizer: Tokenizer) -> None:
    loader = make_loader(corpus, tokenizer)
    first, second = next(iter(loader)), next(iter(loader))
    expected = batches(make_loader(corpus, tokenizer), 2)
    assert torch.equal(first[0], expected[0][0]) and torch.equal(second[0], expected[1][0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_split_the_global_batch_in_order(
    corpus: str, tokenizer: Tokenizer, world_size: int
) -> None:
    single = batches(make_loader(corpus, tokenizer, local_batch_size=2 * world_size), 12)
    ranks = [
        make_loader(corpus, tokenizer, local_batch_size=2, dp_rank=r, dp_world_size=world_size)
        for r in range(world_size)
    ]
    per_rank = [batches(loader, 12) for loader in ranks]
    for step, (inputs, labels) in enumerate(single):
        assert torch.equal(torch.cat([b[step][0] for b in per_rank]), inputs)
        assert torch.equal(torch.cat([b[step][1] for b in per_rank]), labels)
    assert all(loader.state_dict() == ranks[0].state_dict() for loader in ranks)


def assert_same_batches(
    got: list[tuple[torch.Tensor, torch.Tensor]], want: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    assert len(got) == len(want)
    for (inputs, labels), (want_inputs, want_labels) in zip(got, want):
        assert torch.equal(inputs, want_inputs) and torch.equal(labels, want_labels)


# With seq_len 7 and 2 windows a step (16 tokens), one epoch of DOCS is 263 tokens: step 3 stops
# inside the second document, 10 inside the long one, 17 just past the epoch boundary, 33 in
# the third epoch.
@pytest.mark.parametrize("steps", [1, 3, 10, 16, 17, 20, 33])
def test_resume_matches_uninterrupted_run(corpus: str, tokenizer: Tokenizer, steps: int) -> None:
    uninterrupted = make_loader(corpus, tokenizer)
    batches(uninterrupted, steps)
    state = uninterrupted.state_dict()

    resumed = make_loader(corpus, tokenizer)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert_same_batches(batches(resumed, 5), batches(uninterrupted, 5))


def test_resume_at_the_end_of_a_document(corpus: str, tokenizer: Tokenizer) -> None:
    # One window of 11 tokens a step: two steps end exactly at the end of the 22-token DOCS[0].
    uninterrupted = make_loader(corpus, tokenizer, seq_len=10, local_batch_size=1)
    batches(uninterrupted, 2)
    state = uninterrupted.state_dict()
    assert (state["file_index"], state["token_offset"]) == (0, len(tokenizer.encode(DOCS[0])))

    resumed = make_loader(corpus, tokenizer, seq_len=10, local_batch_size=1)
    resumed.load_state_dict(state)
    assert_same_batches(batches(resumed, 5), batches(uninterrupted, 5))


def test_state_is_the_global_stream_position(corpus: str, tokenizer: Tokenizer) -> None:
    """Epoch and offset into the current document follow a reference cursor over DOCS."""
    lengths = [len(tokenizer.encode(doc)) for doc in DOCS]
    loader = make_loader(corpus, tokenizer)
    cursors = {}
    for step, _ in enumerate(islice(loader, 40), start=1):
        epoch, offset = divmod(step * 16 - 1, sum(lengths))  # position of the last token read
        doc = 0
        while offset >= lengths[doc]:
            offset, doc = offset - lengths[doc], doc + 1
        state = loader.state_dict()
        assert (state["epoch"], state["token_offset"]) == (epoch, offset + 1)
        cursors[step] = (epoch, doc, offset + 1)
    # The resume points test_resume_matches_uninterrupted_run relies on.
    assert cursors[3][:2] == (0, 1) and cursors[3][2] < lengths[1]
    assert cursors[10][:2] == (0, 3) and cursors[10][2] < lengths[3]
    assert cursors[16][0] == 0 and cursors[17][0] == 1 and cursors[33][0] == 2


class RecordingTokenizer(Tokenizer):
    """Remembers every text it encodes."""

    def __init__(self) -> None:
        super().__init__(TOKENIZER_PATH)
        self.texts: list[str] = []

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        self.texts.append(text)
        return super().encode(text, bos=bos, eos=eos)


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_resume_reads_only_the_saved_document(tmp_path: Path, fmt: str) -> None:
    write = write_txt if fmt == "txt" else write_jsonl
    files = write(tmp_path, DOCS)
    recording = RecordingTokenizer()
    loader = TokenWindowLoader(files, recording, seq_len=7, local_batch_size=2)
    batches(loader, 24)
    state = loader.state_dict()
    current = recording.texts[-1]

    recording.texts.clear()
    resumed = TokenWindowLoader(files, recording, seq_len=7, local_batch_size=2)
    resumed.load_state_dict(state)
    assert recording.texts == [current]
    assert_same_batches(batches(resumed, 3), batches(loader, 3))


@pytest.mark.parametrize(
    ("saved", "loaded"), [((2, 2), (1, 4)), ((1, 4), (2, 2)), ((1, 6), (3, 2))]
)
def test_state_moves_between_world_sizes(
    corpus: str, tokenizer: Tokenizer, saved: tuple[int, int], loaded: tuple[int, int]
) -> None:
    """Save with (world size, local batch) `saved`, resume with `loaded`: same global batches."""
    (saved_world, saved_batch), (loaded_world, loaded_batch) = saved, loaded
    global_batch = saved_world * saved_batch
    reference = make_loader(corpus, tokenizer, local_batch_size=global_batch)
    batches(reference, 7)

    savers = [
        make_loader(
            corpus, tokenizer, local_batch_size=saved_batch, dp_rank=r, dp_world_size=saved_world
        )
        for r in range(saved_world)
    ]
    for loader in savers:
        batches(loader, 7)
    state = savers[0].state_dict()
    assert all(loader.state_dict() == state for loader in savers)

    resumed = []
    for r in range(loaded_world):
        loader = make_loader(
            corpus, tokenizer, local_batch_size=loaded_batch, dp_rank=r, dp_world_size=loaded_world
        )
        loader.load_state_dict(state)
        resumed.append(batches(loader, 4))
    combined = [
        (torch.cat([r[step][0] for r in resumed]), torch.cat([r[step][1] for r in resumed]))
        for step in range(4)
    ]
    assert_same_batches(combined, batches(reference, 4))


def test_state_dict_is_plain_json(corpus: str, tokenizer: Tokenizer) -> None:
    loader = make_loader(corpus, tokenizer)
    batches(loader, 9)
    state = loader.state_dict()
    assert all(type(value) in (int, str) for value in state.values())
    restored = json.loads(json.dumps(state))

    resumed = make_loader(corpus, tokenizer)
    resumed.load_state_dict(restored)
    assert_same_batches(batches(resumed, 2), batches(loader, 2))


def test_jsonl_reads_the_configured_field(tmp_path: Path, tokenizer: Tokenizer) -> None:
    write_jsonl(tmp_path / "data", DOCS, field="body")
    loader = make_loader(str(tmp_path / "data"), tokenizer, text_field="body")
    inputs, labels = next(iter(loader))
    windows = torch.tensor(reference_windows(DOCS, 7, 2))
    assert torch.equal(inputs, windows[:, :-1]) and torch.equal(labels, windows[:, 1:])


def test_find_text_files_single_file_and_sorted_folder(tmp_path: Path) -> None:
    files = write_txt(tmp_path, DOCS)
    (tmp_path / "notes.md").write_text("not data")
    assert find_text_files(str(tmp_path)) == sorted(files)
    assert find_text_files(str(files[0])) == [files[0]]


def test_tokenizer_encode_decode(tokenizer: Tokenizer) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER_PATH))
    text = DOCS[0]
    assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text), sp.eos_id()]
    assert tokenizer.encode(text, bos=False, eos=False) == sp.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text


# Errors


def test_missing_dataset_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.dataset_path: .*'.*nowhere'"):
        find_text_files(str(tmp_path / "nowhere"))


def test_folder_without_text_files(tmp_path: Path) -> None:
    (tmp_path / "readme.md").write_text("no data here")
    with pytest.raises(DataError, match=r"data\.dataset_path: no \.txt or \.jsonl file"):
        find_text_files(str(tmp_path))


def test_missing_tokenizer(tmp_path: Path) -> None:
    expected = r"model\.tokenizer_path: no tokenizer file at '.*missing\.model'"
    with pytest.raises(DataError, match=expected):
        Tokenizer(tmp_path / "missing.model")


def test_unreadable_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "garbage.model"
    path.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(DataError, match=r"model\.tokenizer_path: .*garbage\.model"):
        Tokenizer(path)


def test_jsonl_line_without_the_field(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n\n{"content": "no text field"}\n', encoding="utf-8")
    loader = TokenWindowLoader([path], tokenizer, seq_len=64, local_batch_size=1)
    with pytest.raises(DataError, match=r"docs\.jsonl:3: .*'text'"):
        next(iter(loader))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_rank": 2, "dp_world_size": 2}, "dp_rank"),
        ({"dp_rank": -1, "dp_world_size": 2}, "dp_rank"),
        ({"seq_len": 0}, "seq_len"),
        ({"local_batch_size": 0}, "local_batch_size"),
    ],
)
def test_bad_loader_arguments(
    tmp_path: Path, tokenizer: Tokenizer, kwargs: dict, message: str
) -> None:
    files = write_txt(tmp_path, DOCS)
    options = {"seq_len": 7, "local_batch_size": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        TokenWindowLoader(files, tokenizer, **options)


def test_state_from_another_dataset_is_rejected(tmp_path: Path, tokenizer: Tokenizer) -> None:
    loader = TokenWindowLoader(write_txt(tmp_path, DOCS), tokenizer, seq_len=7, local_batch_size=2)
    with pytest.raises(DataError, match="file_index"):
        loader.load_state_dict(loader.state_dict() | {"file_index": len(DOCS)})
    with pytest.raises(DataError, match="token_offset"):
        loader.load_state_dict(loader.state_dict() | {"token_offset": 10_000})


# Shipped assets


def test_shipped_tokenizer_round_trips_shakespeare(tokenizer: Tokenizer) -> None:
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (2048, 1, 2)
    line = "To be, or not to be, that is the question:"
    ids = tokenizer.encode(line, bos=False, eos=False)
    assert len(ids) < len(line) // 2  # learned merges, not bytes
    assert tokenizer.decode(ids) == line


def test_shipped_corpus_has_the_plays() -> None:
    plays = {path.stem for path in CORPUS_DIR.glob("*.txt")}
    assert len(plays) == 38
    assert {"macbeth", "hamlet", "king-lear", "the-tempest", "henry-v"} <= plays
    assert (CORPUS_DIR / "README.md").is_file()
    macbeth = (CORPUS_DIR / "macbeth.txt").read_text(encoding="utf-8")
    assert "Fair is foul, and foul is fair:\n" in macbeth
    assert not any(marker in macbeth for marker in ("**", "#", "_"))
