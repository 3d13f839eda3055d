"""weft's preference data and objectives against TRL 1.16's definitions, written here with transformers
and torch alone: six pairs of different lengths, plain strings and chat messages, a tokenizer whose
post-processor adds BOS and one that adds nothing (though it defines a BOS token), DPO, IPO, SimPO and
ORPO. TRL's tokenization is its DPOTrainer's for all four (tokenizer(text) with an EOS text appended to
a plain answer; apply_chat_template); its losses and rewards are DPOTrainer's (DPO, IPO), CPOTrainer's
(SimPO) and ORPOTrainer's (ORPO: the NLL over the chosen rows' every token, averaged over the batch)."""

from __future__ import annotations

import json

import pytest
import torch

from weft.components.data import HFTokenizer, build_loader
from weft.components.training.preference import (
    METRICS,
    PreferenceOptions,
    answer_logps,
    micro_batch_loss,
    nll_tokens,
)

from tests.support.chat_data import write_jsonl
from tests.support.preference_data import hamlet_lines, make_pairs, trl_objective, trl_rows

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
OPTIONS = {"sigmoid": PreferenceOptions("sigmoid", beta=0.1), "ipo": PreferenceOptions("ipo", beta=0.5),
           "simpo": PreferenceOptions("simpo", beta=2.0, gamma=0.5), "orpo": PreferenceOptions("orpo", beta=0.1)}


def build_folder(folder, post_processor: bool, **config_keys):
    """A small byte-level BPE folder (BOS <s>, EOS </s>, pad <pad>); `post_processor`: it prepends BOS;
    `config_keys` join tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(hamlet_lines()[:300], trainer)
    if post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast", **config_keys}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def records(chat: bool) -> list[dict]:
    """Six pairs whose prompts and answers all differ in length."""
    return [make_pairs(1, offset=3 * i, answer_chars=12 + 17 * i, chat=chat)[0] for i in range(6)]


def tiny_llama(vocab: int, seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["bos", "nothing"])
def folder(request, tmp_path_factory):
    """The folder, its transformers tokenizer, and a policy and a reference over its vocabulary."""
    path = build_folder(tmp_path_factory.mktemp("tok") / request.param, post_processor=request.param == "bos")
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    vocab = len(hf)
    return path, hf, tiny_llama(vocab, 0), tiny_llama(vocab, 1)


@pytest.mark.parametrize("chat", [False, True], ids=["strings", "chat"])
@pytest.mark.parametrize("loss", list(OPTIONS))
def test_loss_and_metrics_equal_trl(tmp_path, folder, chat, loss):
    path, hf, policy, reference = folder
    pairs = records(chat)
    options = OPTIONS[loss]
    want_loss, want, scale = trl_objective(loss, options.beta, options.gamma, policy, reference, hf, pairs)
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    batch = next(iter(build_loader("preference", [jsonl], HFTokenizer(path), seq_len=160, local_batch_size=6,
                                   cooperate=False)))
    for row, (ids, start) in enumerate(r for pair in pairs for r in trl_rows(hf, pair)):  # the rows TRL trains
        assert batch.inputs[row, :len(ids) - 1].tolist() == ids[:-1]
        assert batch.row_labels[row, :len(ids) - 1].tolist() == ids[1:]
        assert (batch.labels[row] != -100).nonzero()[0].item() == start - 1
    with torch.no_grad():
        logits = policy(batch.inputs).logits.float()
        ref_logps = answer_logps(reference(batch.inputs).logits.float(), batch.labels)[0]
        got, metrics = micro_batch_loss(options, logits, batch.labels, batch.row_labels, ref_logps, 6,
                                        nll_tokens(batch.row_labels))
        # two micro-batches of one global batch (2 pairs, then 4) add up to the same loss
        parts = [micro_batch_loss(options, logits[s], batch.labels[s], batch.row_labels[s], ref_logps[s], 6,
                                  nll_tokens(batch.row_labels))[0] for s in (slice(0, 4), slice(4, 12))]
    assert got.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert sum(parts).item() == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    for name in METRICS:
        tolerance = 1e-5 * scale if name.startswith("rewards/") else 0.0
        assert metrics[name].mean().item() == pytest.approx(want[name], rel=1e-5, abs=tolerance), name


@pytest.mark.parametrize("post_processor, config_keys", [
    (True, {}), (False, {}), (True, {"add_bos_token": False}), (False, {"add_bos_token": True, "add_eos_token": True}),
], ids=["bos", "nothing", "bos-config-says-no", "nothing-config-says-bos-eos"])
def test_plain_text_gets_the_special_tokens_transformers_adds(tmp_path, post_processor, config_keys):
    path = build_folder(tmp_path / "tok", post_processor, **config_keys)
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    text = records(False)[0]["prompt"] + "</s>"  # the EOS text appended to an answer is read as EOS
    assert HFTokenizer(path).encode_plain(text) == hf(text)["input_ids"]
