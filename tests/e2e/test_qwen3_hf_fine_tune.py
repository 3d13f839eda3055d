"""A Qwen3-MoE folder written by transformers, fine-tuned by train.py under FSDP 2 (model.flavor
from_hf_config): the end-of-run export has exactly transformers' key set (one tensor per expert),
equals the command-line export of the run's checkpoint, and loads in transformers with the logits
of weft's model read from that checkpoint."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeForCausalLM

from weft import train
from weft.components.config import parse_args
from weft.components.hf import model_args_from_hf_folder
from weft.generate import load_model
from weft.recipe.export import main as export_main

from tests.support.dist_utils import run_distributed
from tests.support.hf_folders import tiny_qwen3_hf_folder
from tests.support.train_runs import run_args


def fine_tune(folder: str, dump: str) -> list[float]:
    """Worker: 3 steps from the folder, exported at the end (dump/hf) and checkpointed at step 3."""
    return train.train(parse_args(run_args(
        dump, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", folder,
        "--parallelism.dp_shard", "2", "--export.hf_folder", "hf", steps=3, checkpoint_every=3)))


@pytest.mark.slow
def test_a_moe_folder_fine_tuned_under_fsdp2_exports_transformers_keys_and_weft_logits(tmp_path):
    tiny_qwen3_hf_folder(tmp_path / "source", moe=True)
    losses = run_distributed(fine_tune, 2, str(tmp_path / "source"), str(tmp_path / "run"), timeout=600)[0]
    assert len(losses) == 3
    source = load_file(tmp_path / "source" / "model.safetensors")
    exported = load_file(tmp_path / "run" / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert any(not torch.equal(exported[key], source[key]) for key in source)  # it trained
    checkpoint = tmp_path / "run" / "checkpoint" / "step-3"
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "cli")]) == 0
    cli = load_file(tmp_path / "cli" / "model.safetensors")
    assert cli.keys() == exported.keys() and all(torch.equal(cli[k], exported[k]) for k in cli)

    ours = load_model(model_args_from_hf_folder(tmp_path / "source"), hf=None, checkpoint=str(checkpoint),
                      device=torch.device("cpu"), dtype=torch.float32).eval()
    theirs = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "run" / "hf", attn_implementation="eager").float().eval()
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)
