"""Supervised fine-tuning: chat and prompt/completion samples, loss masks, packing with document
masking, global loss normalisation, resumable packing, bad input, and parity across layouts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from assets.make_chat_data import speeches
from weft.components.config import parse_args
from weft.components.data import (
    DataError,
    HFTokenizer,
    build_loader,
    chat_sample,
    document_layout,
    prompt_completion_sample,
)
from weft.components.training.loss import IGNORE_INDEX, global_supervised_count, token_loss
from weft.models.llama import ModelArgs, Transformer

from tests.support import REPO
from tests.support.blocks import fewer_blocks
from tests.support.chat_data import make_chats, write_jsonl
from tests.support.dist_utils import run_distributed
from tests.support.hf_folders import tiny_hf_folder
from tests.support.hf_tokenizer import build_tokenizer_folder

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, multiple_of=16, max_seq_len=128)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    return build_tokenizer_folder(tmp_path_factory.mktemp("tok") / "hf")


@pytest.fixture(scope="module")
def tok(tokenizer_folder) -> HFTokenizer:
    return HFTokenizer(tokenizer_folder)


# ---------------------------------------------------------------------------------------------
# Samples and masks
# ---------------------------------------------------------------------------------------------


def test_chat_sample_supervises_exactly_the_assistant_turns(tok, tokenizer_folder):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who's there?"},
                {"role": "assistant", "content": "Nay, answer me."}, {"role": "user", "content": "Long live the king!"},
                {"role": "assistant", "content": "Bernardo?"}]
    sample = chat_sample({"messages": messages}, tok, "x.jsonl:1")
    ids = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder)).apply_chat_template(messages)
    assert sample.tokens == (ids["input_ids"] if hasattr(ids, "keys") else ids)
    supervised = tok.decode([t for t, keep in zip(sample.tokens, sample.supervised) if keep])
    assert supervised == "Nay, answer me.<|eot_id|>Bernardo?<|eot_id|>"


def test_prompt_completion_and_alpaca(tok):
    sample = prompt_completion_sample({"prompt": "Q: who?\n", "completion": "A: I."}, tok, "x:1")
    assert sample.tokens[0] == tok.bos_id and sample.tokens[-1] == tok.eos_id
    assert tok.decode([t for t, k in zip(sample.tokens, sample.supervised) if k]) == "A: I.<|end_of_text|>"
    alpaca = prompt_completion_sample({"instruction": "Say hi", "input": "to Horatio", "output": "Hi."}, tok, "x:1")
    assert tok.decode(alpaca.tokens[1:]).startswith("Say hi\n\nto Horatio\n\nHi.")


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown role 'narrator'"),
    ({"text": "no messages"}, "non-empty list 'messages'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
])
def test_bad_chat_records_name_file_and_line(tok, record, message):
    with pytest.raises(DataError, match=f"data.jsonl:7: .*{message}"):
        chat_sample(record, tok, "data.jsonl:7")


def test_masked_labels_change_nothing_supervised_do():
    """Changing the targets of unsupervised tokens changes neither loss nor gradients; a supervised one does."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights(0)
    tokens = torch.randint(0, 1000, (2, 17))
    supervised = torch.rand(2, 16) < 0.4
    supervised[0, 3] = True

    def loss_and_grads(targets):
        model.zero_grad()
        labels = torch.where(supervised, targets, IGNORE_INDEX)
        loss = token_loss(model(tokens[:, :-1]), labels, global_supervised_count([labels], None))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    base_loss, base_grads = loss_and_grads(tokens[:, 1:])
    changed = torch.where(supervised, tokens[:, 1:], (tokens[:, 1:] + 7) % 1000)
    loss, grads = loss_and_grads(changed)
    assert torch.equal(loss, base_loss) and all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    one = tokens[:, 1:].clone()
    one[0, 3] = (one[0, 3] + 1) % 1000
    assert not torch.equal(loss_and_grads(one)[0], base_loss)


# ---------------------------------------------------------------------------------------------
# Packing and document masking
# ---------------------------------------------------------------------------------------------


def test_packed_logits_equal_each_document_alone():
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    model.init_weights(0)
    lengths = [5, 17, 1, 9]
    docs = [torch.randint(0, 1000, (n,)) for n in lengths]
    packed = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        logits = model(packed, positions, document_ids=document_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)


def test_document_layout_restarts_at_bos():
    inputs = torch.tensor([[7, 7, 0, 5, 6, 0, 9]])
    positions, documents = document_layout(inputs, bos_id=0)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 2]]


def test_packing_keeps_samples_whole_and_counts_long_ones(tok, tmp_path):
    records = make_chats(40, long_chars=40) + [{"messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    loader = build_loader("chat", [path], tok, seq_len=64, local_batch_size=4)
    batch = next(iter(loader))
    for row in range(4):
        docs, pos = batch.document_ids[row], batch.positions[row]
        starts = torch.nonzero(torch.diff(docs, prepend=docs[:1] - 1)).flatten()
        assert torch.equal(pos[starts], torch.zeros_like(starts))  # every document starts at position 0
        assert (batch.labels[row] != IGNORE_INDEX).any()
    drop = build_loader("chat", [path], tok, seq_len=64, local_batch_size=4, long_samples="drop")
    for _, _ in zip(range(8), drop):
        pass
    assert drop.dropped == 1 and drop.truncated == 0
    only_long = write_jsonl(tmp_path / "long.jsonl", records[-1:] * 3)
    with pytest.raises(DataError, match="every sample is longer than training.seq_len"):
        next(iter(build_loader("chat", [only_long], tok, seq_len=64, local_batch_size=1, long_samples="drop")))


def test_resume_mid_epoch_in_another_layout(tok, tmp_path):
    """State saved by one rank of a 1-rank loader resumes 2-rank loaders on the same windows."""
    path = write_jsonl(tmp_path / "chat.jsonl", make_chats(60))

    def loader(rank=0, world=1, batch=4):
        return build_loader("chat", [path], tok, seq_len=64, local_batch_size=batch, dp_rank=rank,
                            dp_world_size=world)

    whole = loader()
    stream = iter(whole)
    next(stream)
    state = whole.state_dict()
    expected = [next(stream) for _ in range(2)]
    halves = []
    for rank in range(2):
        resumed = loader(rank, 2, 2)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        halves.append([b for _, b in zip(range(2), resumed)])
    for step in range(2):
        for field in range(4):
            assert torch.equal(torch.cat([halves[0][step][field], halves[1][step][field]]), expected[step][field])


# ---------------------------------------------------------------------------------------------
# Bad input through train.py: one line, exit 2, nothing written
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "king", "content": "x"}, {"role": "assistant", "content": "y"}]}', "chat.jsonl:2: messages\\[0\\] has unknown role 'king'"),
    ('{"prompt": "x"}', "chat.jsonl:2: expected a JSON object with a non-empty list 'messages'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "chat.jsonl:2: the conversation has no assistant turn"),
])
def test_train_rejects_bad_chat_records(tokenizer_folder, tmp_path, capsys, line, message):
    from weft import train

    good = json.dumps(make_chats(1)[0])
    data = write_jsonl(tmp_path / "chat.jsonl", [good, line])
    dump = tmp_path / "out"
    code = train.main(["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--training.steps", "1",
                       "--training.seq_len", "32", "--training.local_batch_size", "8", "--data.format", "chat",
                       "--data.dataset_path", str(data), "--model.tokenizer_path", str(tokenizer_folder)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert re.search(message, err), err
    assert not dump.exists()


def test_train_refuses_chat_without_template(tmp_path, capsys):
    from weft import train

    folder = build_tokenizer_folder(tmp_path / "plain", chat_template=None)
    data = write_jsonl(tmp_path / "chat.jsonl", make_chats(2))
    code = train.main(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "out"),
                       "--data.format", "chat", "--data.dataset_path", str(data), "--model.tokenizer_path", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and f"'{folder}' has no chat template" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Parity: packed SFT under every layout equals one device; end to end from and to Hugging Face
# ---------------------------------------------------------------------------------------------

STEPS = 10
GLOBAL_BATCH = 8
# Text with short documents, packed with document masking (positions restart at each BOS).
TEXT_DOCUMENTS = ["--data.format", "text", "--data.dataset_path", "{text}", "--data.document_masking",
                  "--validation.format", "text", "--validation.dataset_path", "{text}"]
# name -> (world size, overrides, the single-device run it must match)
SFT_LAYOUTS: dict[str, tuple[int, list[str], str]] = {
    "accumulation2": (1, ["--training.gradient_accumulation_steps", "2"], "reference"),
    "fsdp2": (2, ["--parallelism.dp_shard", "2"], "reference"),
    "tp2": (2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"], "reference"),
    "cp2": (2, ["--parallelism.dp_shard", "1", "--parallelism.cp", "2"], "reference"),
    "text_documents_cp2": (2, [*TEXT_DOCUMENTS, "--parallelism.dp_shard", "1", "--parallelism.cp", "2"],
                           "text_reference"),
    # Pipeline parallelism: packed chat, and text with document masking; validation through the pipeline.
    "pp2": (2, ["--parallelism.pp", "2", "--parallelism.dp_shard", "1", "--parallelism.pp_microbatches", "4"],
            "reference"),
    "text_documents_pp2": (2, [*TEXT_DOCUMENTS, "--parallelism.pp", "2", "--parallelism.dp_shard", "1",
                               "--parallelism.pp_schedule", "Interleaved1F1B", "--parallelism.pp_microbatches", "2"],
                           "text_reference"),
    "fsdp2_tp2": (4, ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"], "reference"),
}


# The chat layouts and their references train the debug model cut to 2 blocks (each layout splits every
# block alike); the text ones keep 4, for Interleaved1F1B's 2 stages on each of 2 ranks.
BLOCKS = {"debugmodel": 2}


def blocks_of(overrides: list[str]) -> dict[str, int]:
    return {} if "--data.document_masking" in overrides else BLOCKS


def sft_args(dump: str, files: dict[str, str], tokenizer: Path | str, overrides: list[str], dp: int = 1) -> list[str]:
    """Ten packed chat steps of the debug model at seq_len 64, global batch 8, one validation at the end."""
    accumulation = 2 if "--training.gradient_accumulation_steps" in overrides else 1
    return ["--job.config_file", "debug_model", "--job.dump_folder", dump, "--training.steps", str(STEPS),
            "--training.seq_len", "64", "--training.local_batch_size", str(GLOBAL_BATCH // dp // accumulation),
            "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
            "--data.format", "chat", "--data.dataset_path", files["chat"], "--model.tokenizer_path", str(tokenizer),
            "--validation.enable", "--validation.dataset_path", files["validation"], "--validation.freq", str(STEPS),
            "--validation.steps", "2", *(o.format(**files) for o in overrides)]


def validation_losses(dump: Path) -> list[float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["validation/loss"] for r in records if "validation/loss" in r]


def sft_worker(names: list[str], root: str, files: dict[str, str], tokenizer: str, hf_job: list[str] | None) -> dict:
    """Train each layout in this process group (and, if given, the end-to-end HF job); return losses."""
    import torch.distributed as dist

    from weft import train

    losses = {}
    for name in names:
        overrides = SFT_LAYOUTS[name][1]
        dp = 2 if name.startswith("fsdp2") else 1
        with fewer_blocks(blocks_of(overrides)):
            losses[name] = train.train(parse_args(sft_args(f"{root}/{name}", files, tokenizer, overrides, dp)))
        dist.barrier()
    if hf_job is not None:
        losses["hf"] = train.train(parse_args(hf_job))
        dist.barrier()
    return losses


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, tokenizer_folder) -> dict:
    root = tmp_path_factory.mktemp("sft")
    lines = [s[1] for s in speeches(REPO / "assets/data/shakespeare/hamlet.txt") if s is not None]
    files = {"chat": str(write_jsonl(root / "chat.jsonl", make_chats(400))),
             "validation": str(write_jsonl(root / "validation.jsonl", make_chats(40, seed=1))),
             "text": str(write_jsonl(root / "text.jsonl", [{"text": line} for line in lines[:300]]))}
    hf = tiny_hf_folder(root / "hf", tokenizer_folder)
    hf_job = sft_args(str(root / "hf_run"), files, "", ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"], dp=2)
    hf_job += ["--training.steps", "20", "--checkpoint.initial_load_path", str(hf), "--checkpoint.enable",
               "--checkpoint.interval", "20", "--validation.freq", "10", "--metrics.log_freq", "10"]
    from weft import train

    single = {"reference": [], "text_reference": TEXT_DOCUMENTS, "accumulation2": SFT_LAYOUTS["accumulation2"][1]}
    runs = {}
    for name, overrides in single.items():
        with fewer_blocks(blocks_of(overrides)):
            runs[name] = train.train(parse_args(sft_args(str(root / name), files, tokenizer_folder, overrides)))
    for world in (2, 4):
        names = [n for n, (w, _, _) in SFT_LAYOUTS.items() if w == world]
        runs.update(run_distributed(sft_worker, world, names, str(root), files, str(tokenizer_folder),
                                    hf_job if world == 4 else None, timeout=600)[0])
    runs["root"] = root
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SFT_LAYOUTS))
def test_sft_layout_matches_single_device(layout, sft_runs):
    """Training and validation losses equal the single-device run's within 1e-5 relative."""
    reference_name = SFT_LAYOUTS[layout][2]
    reference, losses = sft_runs[reference_name], sft_runs[layout]
    assert len(losses) == len(reference) == STEPS
    assert reference[-1] < reference[0], "the reference run must learn"
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        assert got == pytest.approx(want, rel=1e-5), f"{layout} step {step}: {got} vs {want}"
    root = sft_runs["root"]
    want, got = validation_losses(root / reference_name), validation_losses(root / layout)
    assert len(want) == 1 and got == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_document_masking_changes_text_training(sft_runs, tokenizer_folder, tmp_path):
    """Sanity check of the text comparison: without document masking the same run differs."""
    from weft import train

    files = {k: str(sft_runs["root"] / f"{k}.jsonl") for k in ("chat", "validation", "text")}
    plain = [o for o in TEXT_DOCUMENTS if o != "--data.document_masking"]
    # Step 1 alone: the same weights and tokens, so only the masks can part its loss from the reference's.
    losses = train.train(parse_args(sft_args(str(tmp_path / "plain"), files, tokenizer_folder,
                                             [*plain, "--training.steps", "1"])))
    assert len(losses) == 1 and losses[0] != pytest.approx(sft_runs["text_reference"][0], rel=1e-4)


@pytest.mark.slow
def test_hf_finetune_end_to_end(sft_runs):
    """HF folder imported under fsdp 2 x tp 2 (its tokenizer by default), fine-tuned on packed chats,
    validation loss falls, exported back: transformers' logits equal weft's."""
    transformers = pytest.importorskip("transformers")
    from weft.components.checkpoint.checkpointer import load_model_weights
    from weft.components.hf import export_to_hf
    from weft.models.llama import LLAMA_FLAVORS

    root = sft_runs["root"]
    records = [json.loads(line) for line in (root / "hf_run/metrics.jsonl").read_text().splitlines()]
    validation = validation_losses(root / "hf_run")
    assert len(validation) == 2 and validation[1] < validation[0]
    assert all(r["validation/perplexity"] == pytest.approx(math.exp(r["validation/loss"]))
               for r in records if "validation/loss" in r)
    step = root / "hf_run/checkpoint/step-20"
    export_to_hf(step, root / "exported", flavor="debugmodel")
    ours = Transformer(LLAMA_FLAVORS["debugmodel"])
    ours.init_weights(0)
    load_model_weights(ours, step)
    theirs = transformers.LlamaForCausalLM.from_pretrained(root / "exported", torch_dtype=torch.float32)
    tokens = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)


def test_flex_attention_path_equals_the_exact_mask():
    """The CUDA path (FlexAttention block mask) computes the same attention as the CPU path; checked
    forward-only on the CPU, where FlexAttention has no backward (PyTorch 2.13)."""
    from weft.layers.attention import document_attention, document_block_mask, masked_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 48, 16), torch.randn(2, 2, 48, 16), torch.randn(2, 2, 48, 16)
    docs = torch.tensor([[0] * 10 + [1] * 30 + [2] * 8, [0] * 48])
    with torch.no_grad():
        for start in (0, 16):  # the whole sequence, and a query chunk aligned to the end (as under CP)
            got = masked_attention(q[..., start:, :], k, v, document_block_mask(docs[:, start:], docs))
            want = document_attention(q[..., start:, :], k, v, docs[:, start:], docs)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_train_resumes_mid_epoch_on_the_same_samples(tokenizer_folder, tmp_path):
    """Resuming packed chat training from a mid-run checkpoint gives the losses of the uninterrupted run."""
    import shutil

    from weft import train

    files = {"chat": str(write_jsonl(tmp_path / "chat.jsonl", make_chats(60))),
             "validation": str(write_jsonl(tmp_path / "validation.jsonl", make_chats(4, seed=1)))}
    args = sft_args(str(tmp_path / "run"), files, tokenizer_folder,
                    ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
                     "--training.local_batch_size", "2", "--no-validation.enable"])
    whole = train.train(parse_args(args))
    shutil.rmtree(tmp_path / "run/checkpoint/step-6")
    resumed = train.train(parse_args(args))
    assert len(whole) == 6 and resumed == pytest.approx(whole[3:], rel=1e-6)


def test_prompt_completion_trains_with_a_sentencepiece_tokenizer(tmp_path):
    """prompt_completion needs no chat template: the shipped SentencePiece tokenizer works, Alpaca
    records included, and only completions are supervised."""
    from weft import train

    records = [{"prompt": f"Q{i}: who is there?\n", "completion": "Nay, answer me." * (1 + i % 5)} for i in range(20)]
    records += [{"instruction": "Stand.", "input": "Unfold yourself.", "output": "Long live the king!"}] * 5
    files = {"chat": str(write_jsonl(tmp_path / "pc.jsonl", records)), "validation": str(tmp_path / "pc.jsonl")}
    losses = train.train(parse_args(sft_args(str(tmp_path / "run"), files, REPO / "assets/tokenizer/shakespeare.model",
                                             ["--data.format", "prompt_completion", "--training.steps", "2"])))
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_train_refuses_a_folder_without_tokenizer_json(tmp_path, capsys):
    from weft import train

    (tmp_path / "tok").mkdir()
    code = train.main(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "out"),
                       "--model.tokenizer_path", str(tmp_path / "tok")])
    err = capsys.readouterr().err
    assert code == 2 and err == f"weft: error: model.tokenizer_path: '{tmp_path / 'tok'}' is a folder without " \
                                "tokenizer.json (a Hugging Face tokenizer folder has one)\n"
    assert not (tmp_path / "out").exists()


def test_validation_leaves_training_untouched(tokenizer_folder, tmp_path):
    """Evaluating every 2 steps changes no training loss: the data cursor and random state are untouched."""
    from weft import train

    files = {"chat": str(write_jsonl(tmp_path / "chat.jsonl", make_chats(60))),
             "validation": str(write_jsonl(tmp_path / "validation.jsonl", make_chats(8, seed=1)))}
    common = ["--training.steps", "4", "--training.local_batch_size", "2"]
    plain = train.train(parse_args(sft_args(str(tmp_path / "plain"), files, tokenizer_folder,
                                            [*common, "--no-validation.enable"])))
    evaluated = train.train(parse_args(sft_args(str(tmp_path / "evaluated"), files, tokenizer_folder,
                                                [*common, "--validation.freq", "2", "--validation.steps", "1"])))
    assert evaluated == plain
    assert len(validation_losses(tmp_path / "evaluated")) == 2
