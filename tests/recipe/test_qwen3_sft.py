"""Supervised fine-tuning with a Qwen3-style tokenizer folder, built offline (tests/support/
hf_tokenizer.py): no BOS token ("bos_token": null, as Qwen's folders have), EOS <|im_end|>, pad
<|endoftext|>, a ChatML chat template. Chat records render as transformers renders them with only the
assistant turns supervised; prompt/completion samples take no BOS; text windows with document
masking find documents after each EOS; train.py fine-tunes the debug Qwen3 on packed chats; and
generate.py --chat answers from a Qwen3 folder's own template as transformers decodes it."""

from __future__ import annotations

import shutil

import pytest
import torch

from weft.components.config import parse_args
from weft.components.data import HFTokenizer, build_loader, chat_sample, document_layout, prompt_completion_sample

from tests.support.chat_data import make_chats, write_jsonl
from tests.support.hf_folders import tiny_qwen3_hf_folder
from tests.support.hf_tokenizer import build_qwen3_tokenizer_folder
from tests.support.train_runs import run_args

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who's there?"},
            {"role": "assistant", "content": "Nay, answer me."}, {"role": "user", "content": "Long live the king!"},
            {"role": "assistant", "content": "Bernardo?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen3_tokenizer_folder(tmp_path_factory.mktemp("qwen3_tok") / "hf")


@pytest.fixture(scope="module")
def tok(folder) -> HFTokenizer:
    return HFTokenizer(folder)


def test_a_tokenizer_without_bos_is_read_and_frames_documents_with_eos(tok):
    assert tok.bos_id is None and tok.eos_id == tok._tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok._tok.token_to_id("<|endoftext|>")
    ids = tok._tok.encode("To be, or not to be", add_special_tokens=False).ids
    assert tok.encode("To be, or not to be") == ids + [tok.eos_id]


def test_chat_renders_as_transformers_and_supervises_the_assistant_turns(tok, folder):
    from transformers import AutoTokenizer

    sample = chat_sample({"messages": MESSAGES}, tok, "x.jsonl:1")
    ids = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(MESSAGES)
    assert sample.tokens == (ids["input_ids"] if hasattr(ids, "keys") else ids)
    supervised = tok.decode([t for t, keep in zip(sample.tokens, sample.supervised) if keep])
    assert supervised == "Nay, answer me.<|im_end|>\nBernardo?<|im_end|>\n"


def test_prompt_completion_takes_no_bos(tok):
    sample = prompt_completion_sample({"prompt": "Q: who?\n", "completion": "A: I."}, tok, "x:1")
    prompt, completion = (tok._tok.encode(t, add_special_tokens=False).ids for t in ("Q: who?\n", "A: I."))
    assert sample.tokens == prompt + completion + [tok.eos_id]
    assert sample.supervised == [False] * len(prompt) + [True] * (len(completion) + 1)


def test_document_layout_without_bos_restarts_after_each_eos():
    positions, documents = document_layout(torch.tensor([[7, 2, 5, 6, 2, 9, 2]]), bos_id=None, eos_id=2)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 2]]


def test_text_windows_find_each_document_after_its_predecessors_eos(tok, tmp_path):
    """Every document of a window, cut where its ids say, is the tokenizer's encoding of one text in
    order (ids, then EOS), at positions 0, 1, ..."""
    texts = [f"Speech {i}: " + "words " * (i % 5 + 1) for i in range(40)]
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    loader = build_loader("text", [path], tok, seq_len=48, local_batch_size=1, cooperate=False)
    batch = next(loader.stream(None, document_masking=True))
    inputs, positions, documents = batch.inputs[0], batch.positions[0], batch.document_ids[0]
    stream = [t for text in texts for t in tok.encode(text)]
    assert inputs.tolist() == stream[:48]
    expected = [tok.encode(t) for t in texts]
    for doc in range(1, int(documents.max())):  # whole documents (not the window's first and last)
        where = documents == doc
        assert inputs[where].tolist() == expected[doc] and positions[where].tolist() == list(range(len(expected[doc])))


@pytest.mark.slow
def test_train_fine_tunes_debug_qwen3_on_packed_chats_and_text_documents(folder, tmp_path):
    from weft import train

    chats = write_jsonl(tmp_path / "chat.jsonl", make_chats(200))
    common = ("--model.flavor", "debugmodel_qwen3", "--model.tokenizer_path", str(folder), "--optimizer.lr", "3e-3")
    chat = train.train(parse_args(run_args(tmp_path / "chat", *common, "--data.format", "chat", steps=10,
                                           seq_len=64, batch=4, data=chats)))
    assert chat[-1] < chat[0] - 1.0, "assistant-only loss on packed chats must fall"
    texts = write_jsonl(tmp_path / "text.jsonl", [{"text": m["messages"][-1]["content"]} for m in make_chats(200)])
    masked, plain = (train.train(parse_args(run_args(tmp_path / name, *common, "--data.format", "text", *extra,
                                                     steps=3, seq_len=64, batch=4, data=texts)))
                     for name, extra in (("masked", ["--data.document_masking"]), ("plain", [])))
    assert masked[0] != pytest.approx(plain[0], rel=1e-4)  # the documents were told apart by their EOS


def test_generate_chat_answers_from_a_qwen3_folder_as_transformers_does(folder, tmp_path, capsys):
    from transformers import AutoTokenizer

    from weft.generate import main

    model = tiny_qwen3_hf_folder(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / "hf" / name)
    assert main(["--hf", str(tmp_path / "hf"), "--chat", "--prompt", "Who's there?", "--max-new-tokens", "8"]) == 0
    reply = capsys.readouterr().out
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "Who's there?"}], add_generation_prompt=True)
    ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=hf_tok.eos_token_id,
                             pad_token_id=hf_tok.pad_token_id)[0, ids.shape[1]:].tolist()
    new = new[:new.index(hf_tok.eos_token_id)] if hf_tok.eos_token_id in new else new
    assert new and reply == hf_tok.decode(new) + "\n"
