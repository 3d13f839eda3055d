"""data.format = preference: pairs tokenized as TRL does (checked against transformers' own tokenizer
and chat template, and SentencePiece itself), chosen and rejected in one batch with only the answers
supervised, the truncation rules, pairs that cannot fit counted, bad records named, exact resume."""

from __future__ import annotations

import pytest
import torch

from weft.components.data import DataError, HFTokenizer, build_loader, load_tokenizer
from weft.components.data.preference import preference_pair
from weft.components.training.loss import IGNORE_INDEX

from tests.support import REPO
from tests.support.chat_data import write_jsonl
from tests.support.hf_tokenizer import build_qwen3_tokenizer_folder
from tests.support.preference_data import make_pairs, split_record, trl_ids

SP_MODEL = REPO / "assets/tokenizer/shakespeare.model"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen3_tokenizer_folder(tmp_path_factory.mktemp("tok") / "qwen")


@pytest.fixture(scope="module")
def hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("chat", [False, True])
def test_pairs_tokenized_as_trl_does(folder, hf, chat):
    tokenizer = HFTokenizer(folder)
    for record in make_pairs(6, chat=chat):
        pair = preference_pair(record, tokenizer, "r", max_tokens=10_000, truncation="keep_start")
        prompt, answers = split_record(record)
        for sample, answer in zip((pair.chosen, pair.rejected), answers):
            ids, start = trl_ids(hf, prompt, answer)
            assert sample.tokens == ids
            assert sample.supervised == [i >= start for i in range(len(ids))]


def test_string_pairs_with_sentencepiece():
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(SP_MODEL))
    record = make_pairs(1)[0]
    pair = preference_pair(record, load_tokenizer(str(SP_MODEL)), "r", max_tokens=10_000, truncation="keep_start")
    full = [sp.bos_id()] + sp.encode(record["prompt"] + record["chosen"]) + [sp.eos_id()]
    prompt = [sp.bos_id()] + sp.encode(record["prompt"])
    start = next(i for i, (a, b) in enumerate(zip(full, prompt + [None] * len(full))) if a != b)
    assert pair.chosen.tokens == full and pair.chosen.supervised.index(True) == start


def test_batch_rows_are_chosen_then_rejected_with_answers_supervised(tmp_path, folder):
    records = make_pairs(4, chat=True)
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    tokenizer = HFTokenizer(folder)
    loader = build_loader("preference", [path], tokenizer, seq_len=64, local_batch_size=2, cooperate=False)
    batch = next(iter(loader))
    assert batch.inputs.shape == batch.labels.shape == (4, 64) and batch.positions is None
    for row, (record, which) in enumerate((r, w) for r in records[:2] for w in ("chosen", "rejected")):
        sample = getattr(preference_pair(record, tokenizer, "r", max_tokens=65, truncation="keep_start"), which)
        n = len(sample.tokens) - 1
        assert batch.inputs[row, :n].tolist() == sample.tokens[:-1]
        want = [t if s else IGNORE_INDEX for t, s in zip(sample.tokens[1:], sample.supervised[1:])]
        assert batch.labels[row, :n].tolist() == want and (batch.labels[row, n:] == IGNORE_INDEX).all()
    assert loader.check_records() == 4


def test_truncation_rules_and_unfit_pairs(folder):
    tokenizer = HFTokenizer(folder)
    record = {"prompt": "To be, or not to be, that is the question:", "chosen": " Whether 'tis nobler in the mind",
              "rejected": " to suffer"}
    whole = preference_pair(record, tokenizer, "r", max_tokens=10_000, truncation="drop")
    prompt = whole.chosen.supervised.index(True)
    longest = max(len(whole.chosen.tokens), len(whole.rejected.tokens))
    limit = longest - 2
    start = preference_pair(record, tokenizer, "r", max_tokens=limit, truncation="keep_start")
    assert start.truncated and start.chosen.tokens == whole.chosen.tokens[:limit]
    assert start.rejected.tokens == whole.rejected.tokens  # short enough already
    end = preference_pair(record, tokenizer, "r", max_tokens=limit, truncation="keep_end")
    assert end.chosen.tokens == whole.chosen.tokens[2:] and end.rejected.tokens == whole.rejected.tokens[2:]
    assert end.chosen.supervised.index(True) == prompt - 2
    assert not preference_pair(record, tokenizer, "r", max_tokens=limit, truncation="drop").fits
    assert not preference_pair(record, tokenizer, "r", max_tokens=prompt, truncation="keep_start").fits
    assert not preference_pair(record, tokenizer, "r", max_tokens=longest - prompt, truncation="keep_end").fits


def test_unfit_pairs_are_skipped_and_counted(tmp_path, folder):
    long = {"prompt": "x " * 200, "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [long, *make_pairs(3)])
    loader = build_loader("preference", [path], HFTokenizer(folder), seq_len=64, local_batch_size=3,
                          truncation="keep_start", cooperate=False)
    batch = next(iter(loader))
    assert loader.dropped == 1 and batch.inputs.shape == (6, 64)


@pytest.mark.parametrize("record, message", [
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "c"}]}, "different prompts"),
    ({"prompt": "a", "chosen": "b"}, "'chosen' and 'rejected'"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}, "all be strings or all lists"),
    ({"chosen": "b", "rejected": "c"}, "all be strings or all lists"),
])
def test_bad_records_named(tmp_path, folder, record, message):
    path = write_jsonl(tmp_path / "pairs.jsonl", [*make_pairs(1), record])
    loader = build_loader("preference", [path], HFTokenizer(folder), seq_len=64, local_batch_size=1, cooperate=False)
    with pytest.raises(DataError, match=message) as err:
        loader.check_records()
    assert f"{path}:2" in str(err.value)


def test_resume_continues_on_the_next_pair(tmp_path, folder):
    path = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(7))

    def loader():
        return build_loader("preference", [path], HFTokenizer(folder), seq_len=64, local_batch_size=2, cooperate=False)

    first = loader()
    stream = iter(first)
    next(stream)
    state = first.state_dict()
    want = [next(stream) for _ in range(3)]  # across the end of the epoch
    second = loader()
    second.load_state_dict(state)
    for got, expected in zip(iter(second), want):
        assert torch.equal(got.inputs, expected.inputs) and torch.equal(got.labels, expected.labels)
