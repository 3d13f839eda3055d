"""Any Llama-architecture Hugging Face folder in, a complete Hugging Face folder out (components/hf).

Three transformers `LlamaForCausalLM` folders whose shapes are none of weft's flavors are fine-tuned
by train.py under fsdp 2 x tp 2 (one 4-process group trains all three; each step's loss equals a
single-device run's), exported at the end of the run (export.hf_folder) and by
`weft export` without --flavor, and checked against transformers itself:
logits, tokenizer ids, chat rendering and `pipeline` generation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from weft.components.config import parse_args

from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.hf_tokenizer import build_tokenizer_folder
from tests.support.train_runs import run_args

transformers = pytest.importorskip("transformers")

VOCAB = 320
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
# None of weft's flavors: each exercises what a flavor cannot say.
FOLDERS = {
    "tied_llama3": dict(BASE, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "eps_head_dim": dict(BASE, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6, intermediate_size=72),
    "gqa": dict(BASE, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3,
                rms_norm_eps=1e-5, intermediate_size=96),
}
STEPS = 12
CHAT = [{"role": "user", "content": "Who's there?"}]
ANSWER = "I"


def hf_folder(folder: Path, config: dict, tokenizer: Path) -> Path:
    """A randomly initialised LlamaForCausalLM saved by transformers, with the tokenizer beside it."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def chats(n: int) -> list[dict]:
    """Questions from a small set, always answered ANSWER (one token) then <|eot_id|>: a few steps teach it."""
    questions = ["Who's there?", "Nay, answer me.", "Long live the king!", "Stand, and unfold yourself.",
                 "What, has this thing appeared again tonight?"]
    return [{"messages": [{"role": "user", "content": questions[i % len(questions)]},
                          {"role": "assistant", "content": ANSWER}]} for i in range(n)]


def roundtrip_args(dump: Path, folder: Path, data: Path, *, layout: bool = True) -> list[str]:
    """12 chat steps from `folder` at a constant learning rate; with `layout`, under fsdp 2 x tp 2
    with a checkpoint and the export at the end, else on one device alone (the reference)."""
    args = ["--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(folder),
            "--model.tokenizer_path", "", "--training.mixed_precision_param", "float32",
            "--training.mixed_precision_reduce", "float32",
            "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_ratio", "1.0",
            "--data.format", "chat", "--data.dataset_path", str(data)]
    if not layout:  # the same global batch of 8 sequences
        return run_args(dump, *args, steps=STEPS, seq_len=64, batch=8)
    return run_args(dump, *args, "--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--export.hf_folder", "hf",
                    steps=STEPS, seq_len=64, batch=4, checkpoint_every=100)


def train_all(jobs: list[list[str]]) -> list[list[float]]:
    import torch.distributed as dist

    from weft import train

    losses = []
    for job in jobs:
        losses.append(train.train(parse_args(job)))
        dist.barrier()
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    from weft import train

    from tests.support.dist_utils import run_distributed

    root = tmp_path_factory.mktemp("hf_roundtrip")
    tokenizer = build_tokenizer_folder(root / "tokenizer", vocab_size=VOCAB)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats(64)))
    found = {name: {"source": hf_folder(root / name, config, tokenizer), "dump": root / f"{name}_run"}
             for name, config in FOLDERS.items()}
    losses = run_distributed(train_all, 4, [roundtrip_args(f["dump"], f["source"], data) for f in found.values()],
                             timeout=600)[0]
    for (name, f), layout_losses in zip(found.items(), losses):
        f["losses"] = layout_losses
        reference = roundtrip_args(root / f"{name}_reference", f["source"], data, layout=False)
        f["reference"] = train.train(parse_args(reference))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOLDERS))
def test_layout_trains_as_one_device(runs, name):
    """Every step's loss under fsdp 2 x tp 2 (tied embeddings split over TP included) equals the
    single-device run's, and the runs learn."""
    reference, losses = runs[name]["reference"], runs[name]["losses"]
    assert len(losses) == STEPS and reference[-1] < reference[0] / 2
    assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOLDERS))
def test_export_has_transformers_logits(runs, name, tmp_path):
    """The folder exported at the end of the run and the one `weft export` writes
    from the last checkpoint without --flavor hold the same tensors, and transformers' logits on it
    equal weft's on the checkpoint within 1e-5."""
    from safetensors.torch import load_file

    from weft.components.checkpoint.checkpointer import load_model_weights
    from weft.components.hf import model_args_from_hf_folder
    from weft.models.llama import Transformer
    from weft.recipe.export import main as export_main

    source, dump = runs[name]["source"], runs[name]["dump"]
    exported = dump / "hf"
    step = dump / "checkpoint" / f"step-{STEPS}"
    assert export_main(["--checkpoint", str(step), "--out", str(tmp_path / "cli")]) == 0
    at_end, from_cli = load_file(exported / "model.safetensors"), load_file(tmp_path / "cli" / "model.safetensors")
    assert at_end.keys() == from_cli.keys() and all(torch.equal(at_end[k], from_cli[k]) for k in at_end)
    assert not torch.equal(at_end["model.norm.weight"], load_file(source / "model.safetensors")["model.norm.weight"])

    args = model_args_from_hf_folder(source)
    ours = Transformer(args)
    ours.init_weights(0)
    load_model_weights(ours, step)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert theirs.config.to_dict() | {} and theirs.num_parameters() == sum(p.numel() for p in ours.parameters())
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOLDERS))
def test_export_tokenizer_and_generation(runs, name):
    """AutoTokenizer on the export gives the source's ids and chat rendering; `pipeline` runs on the
    export and stops at the end-of-turn token, which generation_config.json lists among the EOS ids."""
    source, exported = runs[name]["source"], runs[name]["dump"] / "hf"
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    ours = transformers.AutoTokenizer.from_pretrained(exported)
    text = "O, that this too too solid flesh would melt, thaw and resolve itself into a dew!"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    eot = ours.convert_tokens_to_ids("<|eot_id|>")
    assert eot in json.loads((exported / "generation_config.json").read_text())["eos_token_id"]

    generate = transformers.pipeline("text-generation", model=str(exported), dtype=torch.float32)
    out = generate(CHAT, max_new_tokens=20, do_sample=False, return_full_text=False)
    assert out[0]["generated_text"] == ANSWER
    prompt = ours.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = generate.model.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert ids[-1].item() == eot and len(ids) < 20


def test_unsupported_folder_refused_at_start(tmp_path, capsys):
    """attention_bias: true (and an unsupported rope type) stop train.py before anything is written:
    one line naming the field and value, exit 2."""
    from weft.train import main

    for key, value, shown in [("attention_bias", True, "attention_bias is True"),
                              ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type is yarn")]:
        folder = tmp_path / key
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **BASE, key: value}))
        before = snapshot(tmp_path)
        argv = ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "run"),
                "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(folder)]
        assert_clean_failure(run_in_process(main, argv, capsys), shown, before=before, root=tmp_path)


def test_dry_run_from_config_only_folder(tmp_path, capsys):
    """A folder holding only a Llama 3.1 8B-shaped config.json (explicit head_dim, tied, bias-free)
    is enough to plan a run; the dry run counts transformers' num_parameters()."""
    from weft.train import main

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=160, tie_word_embeddings=True, max_position_embeddings=131072)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        expected = transformers.LlamaForCausalLM(config).num_parameters()
    argv = ["--job.config_file", "debug_model", "--job.dry_run", "--job.dry_run_world_size", "8",
            "--parallelism.dp_shard", "4", "--parallelism.tp", "2", "--model.flavor", "from_hf_config",
            "--checkpoint.initial_load_path", str(tmp_path), "--training.seq_len", "4096"]
    assert main(argv) == 0
    assert f": {expected:,} parameters" in capsys.readouterr().out


def test_nonempty_export_folder_refused_at_start(tmp_path, capsys):
    """export.hf_folder that already holds files stops the run before anything is written."""
    from weft.train import main

    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    argv = ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "run"), "--export.hf_folder", "hf"]
    assert_clean_failure(run_in_process(main, argv, capsys), "export.hf_folder: output folder", before=before,
                         root=tmp_path)
