"""generate.py: loading a checkpoint or a folder, and the command line's single prompt (batch mode:
test_generate_batch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from weft.components.checkpoint.checkpointer import load_model_weights
from weft.components.data import Tokenizer
from weft.components.hf import export_to_hf, load_hf_into_model
from weft.generate import main
from weft.models.llama import LLAMA_FLAVORS, ModelArgs, Transformer

from tests.support import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
TOKENIZER = REPO / "assets" / "tokenizer" / "shakespeare.model"
TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, max_seq_len=64)
PROMPT = [1, 17, 42, 99]


@pytest.fixture(scope="module")
def model() -> Transformer:
    model = Transformer(TINY)
    model.init_weights(seed=0)
    return model.eval()


def greedy(model, ids: list[int], tokens: int, stop_ids: set[int]) -> list[int]:
    """The reference: the most likely token, the whole context recomputed for each, until a stop id."""
    new: list[int] = []
    with torch.no_grad():
        while len(new) < tokens and not (new and new[-1] in stop_ids):
            new.append(int(model(torch.tensor([ids + new]))[0, -1].argmax()))
    return new


def test_load_checkpoint_restores_weights(tmp_path, model):
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / "COMPLETE").write_text("done\n")
    fresh = Transformer(TINY)
    load_model_weights(fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


@pytest.fixture(scope="module")
def debug_checkpoint(tmp_path_factory) -> tuple[Path, str]:
    """(a complete DCP checkpoint of the debug model, the greedy continuation of 'ROMEO:')."""
    folder = tmp_path_factory.mktemp("debug") / "step-1"
    model = Transformer(LLAMA_FLAVORS["debugmodel"])
    model.init_weights(seed=0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    (folder / "COMPLETE").write_text("done\n")
    tokenizer = Tokenizer(TOKENIZER)
    prompt = tokenizer.encode("ROMEO:", bos=True, eos=False)
    text = tokenizer.decode(prompt + greedy(model, prompt, 8, {tokenizer.eos_id}))
    return folder, text


def test_command_line_prints_the_continuation(debug_checkpoint):
    folder, text = debug_checkpoint
    result = subprocess.run(
        [sys.executable, "generate.py", "--checkpoint", str(folder), "--flavor", "debugmodel",
         "--tokenizer", str(TOKENIZER), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0"],
        cwd=REPO, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n" and text.startswith("ROMEO:") and len(text) > len("ROMEO:")


def test_command_line_samples_from_a_hugging_face_folder(tmp_path, debug_checkpoint, capsys):
    folder, text = debug_checkpoint
    export_to_hf(folder, tmp_path / "hf", flavor="debugmodel")
    assert main(["--hf", str(tmp_path / "hf"), "--tokenizer", str(TOKENIZER), "--prompt", "ROMEO:",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == text + "\n"
    assert main(["--hf", str(tmp_path / "hf"), "--tokenizer", str(TOKENIZER), "--prompt", "ROMEO:",
                 "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "50", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_a_folder_with_its_own_tokenizer_prints_the_text_as_the_checkpoint_does(tmp_path, debug_checkpoint, capsys):
    """A run's export carries its tokenizer as tokenizer.json, whose decoding keeps special tokens
    (chat masks read them): the printed continuation still starts at the prompt, without BOS/EOS."""
    from weft.components.hf.model_files import write_hf_files

    folder, text = debug_checkpoint
    write_hf_files(tmp_path / "recorded", LLAMA_FLAVORS["debugmodel"], TOKENIZER, None)
    export_to_hf(folder, tmp_path / "hf", flavor="debugmodel", hf_files=tmp_path / "recorded")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert main(["--hf", str(tmp_path / "hf"), "--prompt", "ROMEO:", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_command_line_errors_are_one_line(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "missing"), "--tokenizer", str(TOKENIZER), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weft: error: no checkpoint folder at {tmp_path / 'missing'}") and err.count("\n") == 1

    (tmp_path / "unfinished").mkdir()
    assert main(["--checkpoint", str(tmp_path / "unfinished"), "--tokenizer", str(TOKENIZER), "--prompt", "x"]) == 2
    assert "has no COMPLETE file" in capsys.readouterr().err

    for argv in ([], ["--checkpoint", "a", "--hf", "b", "--prompt", "x"], ["--hf", "b", "--prompt", "x", "--top-k", "-1"],
                 ["--hf", "b"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_chat_from_a_hugging_face_folder(tmp_path, capsys):
    """--chat renders the user message with the folder's own tokenizer and template, and prints
    only the reply, which ends before the end-of-turn token."""
    from weft.components.data import HFTokenizer

    from tests.support.hf_folders import tiny_hf_folder
    from tests.support.hf_tokenizer import build_tokenizer_folder

    folder = tiny_hf_folder(tmp_path / "hf", build_tokenizer_folder(tmp_path / "tok"))
    # No --tokenizer: the folder's own is the default.
    assert main(["--hf", str(folder), "--chat", "--prompt", "Who's there?", "--max-new-tokens", "6"]) == 0
    reply = capsys.readouterr().out
    tok = HFTokenizer(folder)
    model = Transformer(LLAMA_FLAVORS["debugmodel"])
    load_hf_into_model(model, folder)
    ids = tok.encode_chat([{"role": "user", "content": "Who's there?"}], add_generation_prompt=True)
    new = greedy(model, ids, 6, set(tok.stop_ids))
    assert reply == tok.decode([t for t in new if t not in tok.stop_ids]) + "\n"


def test_chat_needs_a_chat_template(tmp_path, capsys):
    assert main(["--hf", str(tmp_path), "--chat", "--tokenizer", str(TOKENIZER), "--prompt", "x"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_bfloat16_model_matches_transformers_in_bfloat16(tmp_path, debug_checkpoint, capsys):
    """--dtype bfloat16 (the default on a GPU): weights and compute in bf16, the rotary table still
    complex; the logits agree with transformers' LlamaForCausalLM run in bf16 on the same weights,
    and the command line samples in it."""
    from transformers import LlamaForCausalLM

    from weft.generate import load_model

    folder, _ = debug_checkpoint
    export_to_hf(folder, tmp_path / "hf", flavor="debugmodel")
    model = load_model(LLAMA_FLAVORS["debugmodel"], hf=None, checkpoint=str(folder), device=torch.device("cpu"),
                       dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_rotations.dtype == torch.complex64
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    ids = torch.tensor([[1, 17, 42, 99, 5, 300, 7, 1000]])
    with torch.no_grad():
        ours, theirs = model(ids), reference(ids).logits
    assert ours.dtype == theirs.dtype == torch.bfloat16
    fp32 = load_model(LLAMA_FLAVORS["debugmodel"], hf=None, checkpoint=str(folder), device=torch.device("cpu"),
                      dtype=torch.float32)
    with torch.no_grad():
        exact = fp32(ids)
    # bf16 keeps 8 bits of mantissa: the two bf16 runs agree with each other as with the fp32 logits
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=0.05)  # seen: 0.016, logits up to 4.3
    assert (ours.float() - exact).abs().max() < 0.05  # seen: 0.025
    assert main(["--checkpoint", str(folder), "--tokenizer", str(TOKENIZER), "--prompt", "ROMEO:",
                 "--max-new-tokens", "4", "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_load_model_keeps_tied_embeddings_tied(tmp_path):
    """Reading into an uninitialised model must re-tie the output to the embedding, as building does."""
    from dataclasses import replace

    from weft.generate import load_model

    args = replace(TINY, tie_embeddings=True)
    original = Transformer(args)
    original.init_weights(seed=0)
    dcp.save({"model": original.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / "COMPLETE").write_text("done\n")
    model = load_model(args, hf=None, checkpoint=str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([PROMPT])), original(torch.tensor([PROMPT])), rtol=0, atol=0)


def test_greedy_decoding_of_a_llama4_folder_equals_transformers(tmp_path, capsys):
    """--hf with a Llama4ForCausalLM folder builds weft's Llama 4 (by its spec) and decodes greedily
    the tokens transformers' generate(do_sample=False) gives: 48 tokens across 6 attention chunks,
    through NoPE layers, QK norm and two routed experts per token."""
    from tests.support.greedy_decoding import assert_greedy_decoding_equals_transformers
    from tests.support.hf_folders import tiny_llama4_hf_folder

    reference = tiny_llama4_hf_folder(tmp_path / "hf")
    assert_greedy_decoding_equals_transformers(reference, tmp_path / "hf", "Llama 4", 48, 10, capsys)


@pytest.fixture(scope="module")
def debug_moe_checkpoint(tmp_path_factory) -> Path:
    """The dump folder of 4 steps of train_configs/debug_moe.toml, checkpointed at step 4 (no routing
    bias: transformers' Llama 4 has none, so the exported folder routes as the checkpoint does)."""
    from tests.support.train_runs import run

    dump = tmp_path_factory.mktemp("debug_moe")
    run(["--job.config_file", "debug_moe", "--job.dump_folder", str(dump), "--training.steps", "4",
         "--training.seq_len", "32", "--training.local_batch_size", "2", "--checkpoint.enable",
         "--checkpoint.interval", "4", "--no-metrics.enable_tensorboard"])
    return dump


@pytest.mark.slow
def test_sampling_from_a_debug_moe_checkpoint(tmp_path, debug_moe_checkpoint, capsys):
    """A debug_moe.toml checkpoint samples without --flavor (the model its run recorded) as with
    --flavor debugmodel_moe; greedy, it gives transformers' greedy tokens on the exported folder;
    sampling is reproducible by seed."""
    from transformers import Llama4ForCausalLM

    step = debug_moe_checkpoint / "checkpoint" / "step-4"
    tokenizer = Tokenizer(TOKENIZER)
    prompt = tokenizer.encode("ROMEO:", bos=True, eos=False)
    export_to_hf(step, tmp_path / "hf", flavor="debugmodel_moe")
    reference = Llama4ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float().eval()
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                 eos_token_id=tokenizer.eos_id, pad_token_id=0)
    greedy = tokenizer.decode(out[0].tolist()) + "\n"

    common = ["--checkpoint", str(step), "--tokenizer", str(TOKENIZER), "--prompt", "ROMEO:", "--max-new-tokens", "12"]
    for flavor in ([], ["--flavor", "debugmodel_moe"]):
        assert main(common + flavor + ["--temperature", "0"]) == 0
        assert capsys.readouterr().out == greedy
    sampled = ["--temperature", "0.8", "--top-k", "50", "--seed", "3"]
    assert main(common + sampled) == 0
    text = capsys.readouterr().out
    assert main(common + sampled) == 0
    assert capsys.readouterr().out == text and text.startswith("ROMEO:") and text != greedy
