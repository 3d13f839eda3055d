import json
import re
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
import torch

from weft.components.data import DataError, Loader, Tokenizer, build_loader, find_text_files

from tests.support import ASSETS

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


def make_loader(path: str, tokenizer: Tokenizer, **kwargs: Any) -> Loader:
    options = {"seq_len": 7, "local_batch_size": 2, "dp_rank": 0, "dp_world_size": 1} | kwargs
    return build_loader("text", find_text_files(path), tokenizer, **options)


def text_loader(files: list[Path], tokenizer: Any, **kwargs: Any) -> Loader:
    return build_loader("text", files, tokenizer, **kwargs)


def batches(loader: Loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) of the next n batches: text windows carry nothing else."""
    taken = list(islice(loader, n))
    assert all(batch.positions is None and batch.document_ids is None for batch in taken)
    return [(batch.inputs, batch.labels) for batch in taken]


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
    first, second = next(iter(loader)), next(iter(loader))  # Batches: [0] is the inputs
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
    loader = text_loader(files, recording, seq_len=7, local_batch_size=2)
    batches(loader, 24)
    state = loader.state_dict()
    current = recording.texts[-1]

    recording.texts.clear()
    resumed = text_loader(files, recording, seq_len=7, local_batch_size=2)
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
    inputs, labels = batches(loader, 1)[0]
    windows = torch.tensor(reference_windows(DOCS, 7, 2))
    assert torch.equal(inputs, windows[:, :-1]) and torch.equal(labels, windows[:, 1:])


def test_find_text_files_single_file_and_sorted_folder(tmp_path: Path) -> None:
    files = write_txt(tmp_path, DOCS)
    (tmp_path / "notes.md").write_text("not data")
    assert find_text_files(str(tmp_path)) == sorted(files)
    assert find_text_files(str(files[0])) == [files[0]]


def test_cursor_counts_the_stream_in_order(corpus: str, tokenizer: Tokenizer) -> None:
    """The cursor on its own, without a loader: documents come counted in file order, epoch after
    epoch, each with its SentencePiece length, and it starts again wherever it is sought."""
    from weft.components.data.cursor import Cursor
    from weft.components.data.files import read_text

    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER_PATH))
    lengths = [len(sp.encode(doc)) + 2 for doc in DOCS]
    files = find_text_files(corpus)
    cursor = Cursor(files, lambda raw: tokenizer.encode(read_text(files, raw, "text")), len, batch_tokens=16)
    starts = []
    for index in range(2 * len(DOCS) + 1):
        counted = cursor.peek(16, 0, None)
        assert (counted.index, counted.length, counted.raw.start.epoch) == (index, lengths[index % len(DOCS)],
                                                                             index // len(DOCS))
        assert cursor.unit(counted) == [sp.bos_id(), *sp.encode(DOCS[index % len(DOCS)]), sp.eos_id()]
        starts.append(cursor.next_start())
        cursor.counted.popleft()
    cursor.seek(starts[3])
    assert cursor.peek(16, 0, None).length == lengths[3] and cursor.next_start() == starts[3]


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
    loader = text_loader([path], tokenizer, seq_len=64, local_batch_size=1)
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
        text_loader(files, tokenizer, **options)


def test_state_from_another_dataset_is_rejected(tmp_path: Path, tokenizer: Tokenizer) -> None:
    loader = text_loader(write_txt(tmp_path, DOCS), tokenizer, seq_len=7, local_batch_size=2)
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


# Ranks count document lengths together (one spawn of 4 ranks checks it all)

COOP_SEQ_LEN, COOP_GLOBAL_BATCH, COOP_STEPS = 63, 8, 6
# Layout -> (dp rank, dp degree) of global rank r. "dp2_tp2": ranks 2k and 2k + 1 are one
# data-parallel replica (its two tensor-parallel ranks), reading the same batches.
COOP_LAYOUTS = {"dp4": lambda rank: (rank, 4), "dp2_tp2": lambda rank: (rank // 2, 2)}


class CountingTokenizer:
    """Any tokenizer, counting the documents it tokenizes (calls of encode / encode_with_offsets)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.calls += 1
        return self.inner.encode(text, **kwargs)

    def encode_with_offsets(self, text: str) -> Any:
        self.calls += 1
        return self.inner.encode_with_offsets(text)


def coop_run(case: tuple, layout: tuple[int, int], steps: int, state: dict | None = None) -> dict:
    """Up to `steps` batches of a case's loader for (dp rank, dp degree), as lists, with the state
    and sample counts after each, the DataError that ended them if any, and tokenizer calls."""
    from weft.components.data import batches as loader_batches
    from weft.components.data import load_tokenizer

    data_format, files, tokenizer_path, long_samples = case
    dp_rank, dp = layout
    tokenizer = CountingTokenizer(load_tokenizer(tokenizer_path))
    loader = build_loader(data_format, [Path(f) for f in files], tokenizer, seq_len=COOP_SEQ_LEN,
                          local_batch_size=COOP_GLOBAL_BATCH // dp, dp_rank=dp_rank, dp_world_size=dp,
                          long_samples=long_samples)
    if state is not None:
        loader.load_state_dict(state)
    run: dict = {"batches": [], "states": [], "error": None}
    try:
        for batch in islice(loader_batches(loader), steps):
            run["batches"].append([None if t is None else t.tolist() for t in batch])
            run["states"].append((loader.state_dict(), getattr(loader, "truncated", 0), getattr(loader, "dropped", 0)))
    except DataError as error:
        run["error"] = str(error)
    run["calls"] = tokenizer.calls
    return run


def cooperative_worker(cases: dict[str, tuple], resume: dict[str, dict]) -> dict:
    """On each rank: every case in every layout, and each resumable case from a saved state."""
    import torch.distributed as dist

    rank, runs = dist.get_rank(), {}
    for layout, dp_of in COOP_LAYOUTS.items():
        for name, case in cases.items():
            runs[name, layout] = coop_run(case, dp_of(rank), COOP_STEPS)
            if name in resume:
                runs[name, layout, "resumed"] = coop_run(case, dp_of(rank), 2, resume[name])
    return runs


def coop_cases(root: Path) -> dict[str, tuple]:
    """Many short documents (Hamlet's speeches, cut to 20-160 characters), as .txt files and as
    JSONL; prompt/completion and chat samples packed (some too long: truncated, or dropped); and
    JSONL with one bad record that one rank alone reads, a few micro-batches in."""
    from assets.make_chat_data import speeches

    from tests.support.hf_tokenizer import build_tokenizer_folder

    texts = [s[1][: 20 + 7 * (i % 21)] for i, s in enumerate(
        s for s in speeches(CORPUS_DIR / "hamlet.txt") if s is not None)][:240]
    txt = write_txt(root / "txt", texts[:90])  # fewer than 6 micro-batches hold: the epoch wraps
    jsonl = write_jsonl(root / "jsonl", texts)
    pairs = [{"prompt": a, "completion": b * (4 if i % 9 == 0 else 1)}
             for i, (a, b) in enumerate(zip(texts[:200], texts[1:201]))]
    prompt_completion = root / "pc.jsonl"
    prompt_completion.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p["prompt"]},
                                                     {"role": "assistant", "content": p["completion"]}]}) + "\n"
                            for p in pairs[:150]))
    bad = root / "bad.jsonl"
    lines = [json.dumps({"text": t}) for t in texts]
    bad.write_text("\n".join(lines[:100] + ['{"text": "unterminated'] + lines[100:]) + "\n")
    sp, hf = str(TOKENIZER_PATH), str(build_tokenizer_folder(root / "hf", vocab_size=600))
    return {"txt": ("text", [str(p) for p in txt], sp, "truncate"),
            "jsonl": ("text", [str(p) for p in jsonl], sp, "truncate"),
            "prompt_completion": ("prompt_completion", [str(prompt_completion)], sp, "drop"),
            "chat": ("chat", [str(chat)], hf, "truncate"),
            "bad": ("text", [str(bad)], sp, "truncate")}


def test_ranks_count_lengths_together(tmp_path: Path) -> None:
    """Under 4 ranks (dp 4, and dp 2 x tp 2) every rank's batches are its block of the single
    loader's global batches, states and sample counts equal the single loader's after every batch
    (also resumed from a saved state), each rank tokenizes well under all of the documents, and a
    bad record read by one rank raises the same DataError, after the same batches, on all four."""
    from tests.support.dist_utils import run_distributed

    cases = coop_cases(tmp_path)
    reference = {name: coop_run(case, (0, 1), COOP_STEPS) for name, case in cases.items()}
    resume = {name: reference[name]["states"][2][0] for name in ("jsonl", "prompt_completion")}
    resumed = {name: coop_run(cases[name], (0, 1), 2, resume[name]) for name in resume}
    assert reference["txt"]["states"][-1][0]["epoch"] == 1, "the txt case should wrap around an epoch"
    assert reference["prompt_completion"]["states"][-1][2] > 0 and reference["chat"]["states"][-1][1] > 0
    bad = reference["bad"]
    assert bad["error"] is not None and re.search(r"bad\.jsonl:101: expected a line of JSON", bad["error"])
    assert 1 <= len(bad["batches"]) < COOP_STEPS

    runs = run_distributed(cooperative_worker, 4, cases, resume, timeout=120)
    for layout, dp_of in COOP_LAYOUTS.items():
        for name in cases:
            calls = [runs[rank][name, layout]["calls"] for rank in range(4)]
            print(f"{layout} {name}: documents tokenized per rank {calls}, single loader {reference[name]['calls']}")
            for rank in range(4):
                dp_rank, dp = dp_of(rank)
                rows = slice(dp_rank * COOP_GLOBAL_BATCH // dp, (dp_rank + 1) * COOP_GLOBAL_BATCH // dp)
                pairs = [(runs[rank][name, layout], reference[name])]
                if name in resume:
                    pairs.append((runs[rank][name, layout, "resumed"], resumed[name]))
                for got, want in pairs:
                    assert got["error"] == want["error"], (layout, name, rank)
                    assert got["states"] == want["states"], (layout, name, rank)
                    assert len(got["batches"]) == len(want["batches"])
                    for step, (ours, whole) in enumerate(zip(got["batches"], want["batches"])):
                        block = [None if t is None else t[rows] for t in whole]
                        assert ours == block, (layout, name, rank, step)
            if name != "bad":  # one in 4 to count with, its own windows besides (mostly the same ones)
                share = 0.5 if layout == "dp4" else 0.75
                assert max(calls) <= share * reference[name]["calls"], (layout, name, calls)
