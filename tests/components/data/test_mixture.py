"""Weighted mixtures (components/data/mixture.py): each row is the next window of one source's own
loader, the sources' tokens follow the weights within one draw at every step, the state resumes
exactly and under another data-parallel degree, and bad entries are refused naming the entry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weft.components.data import DataError, build_loader
from weft.components.data.mixture import Mixture, parse_mixture, source_names, source_tokens

SEQ = 16


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, list[Path]]:
    """Three small text sources of different words, so a window shows where it came from."""
    root = tmp_path_factory.mktemp("sources")
    words = {"web": "the king is dead long live the king", "code": "if x then return y else z",
             "books": "once upon a time there lived a queen"}
    files = {}
    for name, text in words.items():
        (root / name).mkdir()
        for i in range(3):
            (root / name / f"{i}.txt").write_text("\n".join(f"{text} {i} {j}" for j in range(40)) + "\n")
        files[name] = sorted((root / name).glob("*.txt"))
    return files


def source_loader(files, tokenizer, *, dp_rank=0, dp=1, local_batch_size=1):
    return build_loader("text", files, tokenizer, seq_len=SEQ, local_batch_size=local_batch_size, dp_rank=dp_rank,
                        dp_world_size=dp, cooperate=False)


class PlainStreams:
    """Each source's own one-window loader: the reference a mixture's rows are checked against."""

    def __init__(self, sources, tokenizer, names) -> None:
        self.streams = {n: iter(source_loader(sources[n], tokenizer)) for n in names}
        self.next = {n: next(self.streams[n]).inputs[0] for n in names}

    def owner(self, row: torch.Tensor) -> str:
        """The one source whose next window `row` is; that window is taken."""
        owners = [n for n, window in self.next.items() if torch.equal(window, row)]
        assert len(owners) == 1, "each row is the next window of exactly one source"
        self.skip(owners[0], 1)
        return owners[0]

    def skip(self, name: str, windows: int) -> None:
        for _ in range(windows):
            self.next[name] = next(self.streams[name]).inputs[0]


def mixture(sources, tokenizer, weights, *, local_batch_size=3, dp_rank=0, dp=1) -> Mixture:
    names = list(weights)
    return Mixture(names, [source_loader(sources[n], tokenizer, dp_rank=dp_rank, dp=dp) for n in names],
                   [weights[n] for n in names], local_batch_size=local_batch_size)


def test_rows_interleave_the_sources_own_windows_by_the_weights(sources, tokenizer):
    """Every row is the next window of one source's plain loader, and after every draw each source's
    tokens are within one draw of its share (the weights over their sum) of all tokens drawn."""
    weights = {"web": 3.0, "code": 1.0}
    mix = mixture(sources, tokenizer, weights)
    plain = PlainStreams(sources, tokenizer, weights)
    drawn = dict.fromkeys(weights, 0)
    batches = iter(mix)
    for _ in range(12):
        batch = next(batches)
        assert batch.inputs.shape == (3, SEQ)
        for row in batch.inputs:
            drawn[plain.owner(row)] += SEQ
            total = sum(drawn.values())
            for n, w in weights.items():  # two sources: within half a draw (Tijdeman's bound)
                assert abs(drawn[n] - total * w / sum(weights.values())) <= SEQ / 2
    assert drawn == {"web": 27 * SEQ, "code": 9 * SEQ}  # 36 windows at 3:1
    assert source_tokens(mix.state_dict()) == drawn


def test_three_sources_stay_within_tijdemans_bound_of_their_shares(sources, tokenizer):
    weights = {"web": 0.5, "code": 0.3, "books": 0.2}
    mix = mixture(sources, tokenizer, weights, local_batch_size=1)
    batches = iter(mix)
    for _ in range(50):
        next(batches)
        tokens = source_tokens(mix.state_dict())
        total = sum(tokens.values())
        assert all(abs(tokens[n] - total * w) <= (1 - 1 / 4) * SEQ for n, w in weights.items()), tokens
    assert source_tokens(mix.state_dict()) == {"web": 25 * SEQ, "code": 15 * SEQ, "books": 10 * SEQ}


@pytest.mark.parametrize("seed", range(4))
def test_many_sources_of_any_weights_stay_under_one_draw_of_their_shares(seed):
    """The order alone (no data): n sources of random weights, 300 draws, each source always within
    1 - 1/(2n - 2) draws of its share: under one draw, where 'the furthest behind' exceeds one
    from 4 sources on."""
    import random

    rng = random.Random(seed)
    n = rng.randint(4, 8)
    weights = [rng.random() ** 3 + 1e-3 for _ in range(n)]

    class Stub:  # a loader's shape is all next_source reads
        class shape:
            seq_len, local_batch_size, dp_world_size = 1, 1, 1

    mix = Mixture([f"s{i}" for i in range(n)], [Stub()] * n, weights, local_batch_size=1)
    for draws in range(1, 301):
        mix.tokens[mix.next_source()] += 1
        assert max(abs(c - w / sum(weights) * draws) for c, w in zip(mix.tokens, weights)) <= 1 - 1 / (2 * n - 2) + 1e-9


def test_state_resumes_on_the_same_batches(sources, tokenizer):
    weights = {"web": 2.0, "code": 1.0, "books": 1.0}
    whole = iter(mixture(sources, tokenizer, weights))
    expected = [next(whole) for _ in range(10)]
    first = mixture(sources, tokenizer, weights)
    batches = iter(first)
    for _ in range(4):
        next(batches)
    resumed = mixture(sources, tokenizer, weights)
    resumed.load_state_dict(first.state_dict())
    again = iter(resumed)
    for want in expected[4:]:
        assert torch.equal(next(again).inputs, want.inputs)


def test_a_changed_data_parallel_degree_continues_every_source(sources, tokenizer):
    """Saved by two data-parallel ranks, loaded by one: the tokens drawn are the saved ones, and each
    source's next window is the one its plain loader gives after the windows both ranks took."""
    weights = {"web": 3.0, "code": 1.0}
    ranks = [mixture(sources, tokenizer, weights, local_batch_size=2, dp_rank=r, dp=2) for r in range(2)]
    streams = [iter(m) for m in ranks]
    for _ in range(6):
        [next(s) for s in streams]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    saved = source_tokens(state)
    assert saved == {"web": 9 * 2 * SEQ, "code": 3 * 2 * SEQ}  # 12 draws of 2 windows at 3:1

    single = mixture(sources, tokenizer, weights, local_batch_size=4)
    single.load_state_dict(state)
    assert source_tokens(single.state_dict()) == saved
    plain = PlainStreams(sources, tokenizer, weights)
    for n in weights:  # past the windows the two ranks took
        plain.skip(n, saved[n] // SEQ)
    order = [plain.owner(row) for row in next(iter(single)).inputs]
    assert sorted(order) == ["code", "web", "web", "web"]


def test_a_state_of_other_sources_is_refused(sources, tokenizer):
    state = mixture(sources, tokenizer, {"web": 1.0, "code": 1.0}).state_dict()
    with pytest.raises(DataError, match=r"checkpoint's sources are \['code', 'web'\], this run's data.mixture "
                                        r"has \['books', 'web'\]"):
        mixture(sources, tokenizer, {"web": 1.0, "books": 1.0}).load_state_dict(state)
    with pytest.raises(DataError, match="the checkpoint's sources are not a mixture's"):
        mixture(sources, tokenizer, {"web": 1.0}).load_state_dict(source_loader(sources["web"], tokenizer).state_dict())


def test_entries_and_names():
    entries = parse_mixture(["data/web:3", "corpus/code.jsonl.zst:1.5", "/x/my books/:0.25"])
    assert [(e.name, e.path, e.weight) for e in entries] == [
        ("web", "data/web", 3.0), ("code", "corpus/code.jsonl.zst", 1.5), ("my_books", "/x/my books/", 0.25)]
    assert source_names(["shards/part.v2"]) == ["part_v2"]
    # a shared last part takes as many more parts as tell the sources apart
    assert source_names(["web/train", "code/train", "books"]) == ["web_train", "code_train", "books"]
    assert source_names(["x/a/train", "y/a/train"]) == ["x_a_train", "y_a_train"]


@pytest.mark.parametrize("entry, said", [
    ("data/web:0", "weight 0; expected a finite number > 0"),
    ("data/web:-1", "weight -1; expected a finite number > 0"),
    ("data/web:nan", "weight nan; expected a finite number > 0"),
    ("data/web:three", "weight 'three' is not a number"),
    ("data/web", "expected PATH:WEIGHT"),
    (":2", "expected PATH:WEIGHT"),
])
def test_bad_entries_are_named(entry, said):
    with pytest.raises(DataError, match=f"data.mixture: entry '{entry}': .*" if ":" in entry else "data.mixture"):
        parse_mixture([entry])
    with pytest.raises(DataError) as error:
        parse_mixture([entry])
    assert said in str(error.value) and entry in str(error.value)


def test_one_path_twice_is_refused():
    with pytest.raises(DataError, match="data.mixture: sources 'a/web' and 'a/web/' are one source"):
        parse_mixture(["a/web:1", "a/web/:2"])
