"""Hugging Face tokenizer folders: ids equal transformers' AutoTokenizer, chat templates render as
apply_chat_template does, and bad folders fail with one line naming the folder."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from weft.components.data import DataError, HFTokenizer, Tokenizer, load_tokenizer

from tests.support import REPO
from tests.support.hf_tokenizer import build_tokenizer_folder

CHATS = [
    [{"role": "user", "content": "Who's there?"}, {"role": "assistant", "content": "Nay, answer me: stand, and unfold yourself."}],
    [{"role": "system", "content": "You speak as Hamlet."}, {"role": "user", "content": "How now, my lord?"},
     {"role": "assistant", "content": "  Words, words, words.\n"}, {"role": "user", "content": "What do you read?"},
     {"role": "assistant", "content": "Slanders, sir — ünïcödé 🎭"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tokenizer_folder(tmp_path_factory.mktemp("tok") / "hf")


@pytest.fixture(scope="module")
def hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_text_ids_equal_transformers(folder, hf):
    ours = HFTokenizer(folder)
    for text in ["To be, or not to be, that is the question:", "  spaces\tand\nnewlines ", "ünïcödé 🎭", ""]:
        assert ours.encode(text, bos=True, eos=False) == hf(text)["input_ids"]
        assert ours.encode(text, bos=False, eos=False) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.encode("x", bos=True, eos=True)[-1] == hf.eos_token_id
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (hf.bos_token_id, hf.eos_token_id, len(hf))
    assert ours.decode(ours.encode("To be, or not", bos=False, eos=False)) == "To be, or not"


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_equals_apply_chat_template(folder, hf, generation_prompt):
    ours = HFTokenizer(folder)
    for messages in CHATS:
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert ours.render_chat(messages, add_generation_prompt=generation_prompt) == text
        assert ours.encode_chat(messages, add_generation_prompt=generation_prompt) == ids
    assert ours.stop_ids == sorted({hf.eos_token_id, hf.convert_tokens_to_ids("<|eot_id|>")})


def test_load_tokenizer_picks_by_path(folder):
    assert isinstance(load_tokenizer(folder), HFTokenizer)
    assert isinstance(load_tokenizer(REPO / "assets/tokenizer/shakespeare.model"), Tokenizer)


def test_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(DataError, match=f"'{tmp_path}' is a folder without tokenizer.json"):
        load_tokenizer(tmp_path)


def test_no_chat_template_is_one_line(tmp_path):
    folder = build_tokenizer_folder(tmp_path / "plain", chat_template=None)
    with pytest.raises(DataError, match="has no chat_template") as err:
        HFTokenizer(folder).render_chat(CHATS[0])
    assert "\n" not in str(err.value)


def test_bad_special_token(folder, tmp_path):
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    with pytest.raises(DataError, match="eos_token '<|nope|>' is not in tokenizer.json"):
        HFTokenizer(copy)


def test_missing_library_names_the_extra(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    with pytest.raises(DataError, match=r'pip install "weft\[hf\]"'):
        HFTokenizer(folder)
