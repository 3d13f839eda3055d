"""The files of an exported Hugging Face folder besides its weights (components/hf/model_files.py)."""

from __future__ import annotations

import json

import pytest
import torch

from weft.components.hf.model_files import finish_hf_folder, write_hf_files
from weft.models.llama import LLAMA_FLAVORS

from tests.support import REPO

SHAKESPEARE = REPO / "assets/tokenizer/shakespeare.model"


def test_sentencepiece_tokenizer_is_converted_for_autotokenizer(tmp_path):
    """A run on the shipped SentencePiece model exports a folder AutoTokenizer loads, encoding a
    passage it never saw (no sample the conversion checked) exactly as SentencePiece does, BOS
    included; config.json and generation_config.json carry its BOS and EOS ids."""
    transformers = pytest.importorskip("transformers")
    sentencepiece = pytest.importorskip("sentencepiece")
    args = LLAMA_FLAVORS["debugmodel"]
    write_hf_files(tmp_path / "recorded", args, SHAKESPEARE, None)
    (tmp_path / "out").mkdir()
    finish_hf_folder(tmp_path / "recorded", tmp_path / "out", args, torch.bfloat16)

    reference = sentencepiece.SentencePieceProcessor(model_file=str(SHAKESPEARE))
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = (REPO / "assets/data/shakespeare/macbeth.txt").read_text()[5000:8000]
    assert loaded(text)["input_ids"] == [reference.bos_id()] + reference.encode(text)
    assert loaded.decode(reference.encode(text)) == reference.decode(reference.encode(text))
    config = json.loads((tmp_path / "out/config.json").read_text())
    generation = json.loads((tmp_path / "out/generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (
        reference.bos_id(), reference.eos_id(), "bfloat16")
    assert generation["eos_token_id"] == [reference.eos_id()]
    assert not (tmp_path / "out/TOKENIZER_NOTE.txt").exists()


def test_source_generation_config_keeps_its_eos_ids_and_gains_end_of_turn(tmp_path):
    """A source folder's generation_config.json (Llama 3.1 Instruct lists several EOS ids) is kept,
    with <|eot_id|> added where it is missing, and its config.json's other fields survive."""
    from tests.support.hf_tokenizer import build_tokenizer_folder

    source = build_tokenizer_folder(tmp_path / "source", vocab_size=300)
    eot = json.loads((source / "tokenizer.json").read_text())["added_tokens"]
    eot = next(t["id"] for t in eot if t["content"] == "<|eot_id|>")
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 0, "eos_token_id": 1,
                                                    "pad_token_id": 7, "rope_scaling": {"rope_type": "yarn"}}))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [1], "temperature": 0.6}))
    args = LLAMA_FLAVORS["debugmodel"]
    write_hf_files(tmp_path / "recorded", args, source, source)
    generation = json.loads((tmp_path / "recorded/generation_config.json").read_text())
    assert generation == {"eos_token_id": [1, eot], "temperature": 0.6, "bos_token_id": 0}
    config = json.loads((tmp_path / "recorded/config.json").read_text())
    assert config["pad_token_id"] == 7 and "rope_scaling" not in config and config["hidden_size"] == args.dim
    assert (tmp_path / "recorded/tokenizer_config.json").read_text() == (source / "tokenizer_config.json").read_text()
