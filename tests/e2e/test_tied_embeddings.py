"""Tied embeddings stay tied on the whole path: meta -> materialize -> train -> checkpoint ->
export -> transformers logits, single-process (with the seed checkpoint) and under FSDP.

`to_empty` used to give the token embedding and the output projection separate storage: the
run then trained two matrices, the seed checkpoint held two different ones, and the (tied)
Hugging Face export disagreed with the trained model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from weft import train
from weft.components.checkpoint.checkpointer import load_model_weights
from weft.components.hf import export_to_hf
from weft.models.llama import LLAMA_FLAVORS, Transformer
from weft.parallelisms.materialize import materialize

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run_args

TIED = replace(LLAMA_FLAVORS["debugmodel"], tie_embeddings=True)


def tied_args(dump: Path, *extra: str) -> list[str]:
    """3 steps at a learning rate of 1e-2, then a checkpoint."""
    return run_args(dump, "--optimizer.lr", "1e-2", *extra, steps=3, checkpoint_every=3)


def saved_embedding_and_output(step: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """model.tok_embeddings.weight and (if saved) model.output.weight of a DCP checkpoint."""
    keys = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    state = {key: torch.empty(keys[key].size) for key in ("model.tok_embeddings.weight", "model.output.weight")
             if key in keys}
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    return state["model.tok_embeddings.weight"], state.get("model.output.weight")


def assert_one_matrix(step: Path) -> None:
    embedding, output = saved_embedding_and_output(step)
    assert output is None or torch.equal(embedding, output)


def test_materialize_keeps_tied_parameters_shared():
    with torch.device("meta"):
        model = Transformer(TIED)
    materialize(model, "cpu", seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in Transformer(TIED).parameters())


def test_tied_run_trains_saves_and_exports_one_matrix(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(LLAMA_FLAVORS, "debugmodel", TIED)
    seed = tmp_path / "seed"
    assert train.main(tied_args(seed, "--checkpoint.create_seed_checkpoint")) == 0
    assert_one_matrix(seed / "checkpoint" / "step-0")

    run = tmp_path / "run"
    assert train.main(tied_args(run, "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"))) == 0
    n = sum(p.numel() for p in Transformer(TIED).parameters())
    assert f"{n:,} parameters, {n:,} on each rank" in capsys.readouterr().out
    step = run / "checkpoint" / "step-3"
    assert_one_matrix(step)

    # The trained weights, as weft loads them, and their Hugging Face export give the same logits.
    transformers = pytest.importorskip("transformers")
    export_to_hf(step, tmp_path / "hf", model_args=TIED)
    weft = Transformer(TIED)
    load_model_weights(weft, step)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, TIED.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, weft.eval()(tokens), atol=1e-4, rtol=0)


def fsdp_tied_run(dump: str) -> bool:
    """Worker: a tied FSDP run; whether its sharded parameters are still shared after training."""
    LLAMA_FLAVORS["debugmodel"] = TIED
    train.train(train.parse_args(tied_args(Path(dump))))
    return True


@pytest.mark.slow
def test_tied_run_under_fsdp_saves_one_matrix(tmp_path):
    run_distributed(fsdp_tied_run, 2, str(tmp_path))
    assert_one_matrix(tmp_path / "checkpoint" / "step-3")
