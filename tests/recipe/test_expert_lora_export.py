"""LoRA runs with adapters on the routed experts (`--lora.target_modules wq,wv,experts`) and their
exports: on the debug MoE (Llama 4) under ep 2, the end-of-run PEFT and merged folders equal, tensor
for tensor, what `python -m weft.recipe.export` writes of the run's last checkpoint in one process,
and the PEFT folder loads in PEFT onto transformers' Llama4ForCausalLM (the seeded base exported)
with the merged folder's logits and weft's; on a tiny Qwen3-MoE folder written by transformers, in
one process, likewise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weft import train
from weft.components.config import parse_args
from weft.components.hf import export_to_hf, load_hf_into_model, model_args_from_hf_folder
from weft.recipe.export import main as export_main

from tests.support.dist_utils import run_distributed
from tests.support.hf_folders import assert_same_tensors, tiny_qwen3_hf_folder
from tests.support.train_runs import run_args

STEPS = 3
EXPERT_LORA = ["--lora.enable", "--lora.rank", "4", "--lora.dropout", "0", "--lora.target_modules", "wq,wv,experts",
               "--optimizer.lr", "1e-2", "--no-validation.enable", "--export.peft_folder", "adapter",
               "--export.hf_folder", "merged"]


def _train(dump: str, *extra: str) -> None:
    train.train(parse_args(run_args(dump, *EXPERT_LORA, *extra, steps=STEPS, batch=4, checkpoint_every=STEPS)))


def _export_checkpoint(run: Path) -> None:
    assert export_main(["--checkpoint", str(run / "checkpoint" / f"step-{STEPS}"), "--peft-out",
                        str(run / "one" / "adapter"), "--merged-out", str(run / "one" / "merged")]) == 0


def _logits(base, adapter: Path, merged: Path, weft_base, tokens) -> tuple[torch.Tensor, ...]:
    """(base's, PEFT's on the base, the merged folder's in transformers, weft's base with the adapter) logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from weft.components.hf.adapters import load_peft_adapter

    with torch.no_grad():
        plain = base(input_ids=tokens).logits
        peft = PeftModel.from_pretrained(base, adapter).eval()(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").float().eval()
        return plain, peft, merged(input_ids=tokens).logits, load_peft_adapter(weft_base, adapter)(tokens)


def _assert_experts_trained(adapter: Path) -> None:
    """The expert adapters' B left zero, their init, in no layer."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    experts_b = [t for key, t in tensors.items() if ".experts." in key and ".lora_B." in key]
    assert experts_b and all(t.abs().max() > 0 for t in experts_b)


def _assert_agree(plain, peft, merged, weft) -> None:
    assert (peft - plain).abs().max() > 1e-3, "the adapters must have trained"
    torch.testing.assert_close(peft, merged, rtol=0, atol=1e-5)
    torch.testing.assert_close(weft, peft, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_ep2_expert_lora_exports_equal_one_process_and_load_in_peft(tmp_path):
    from transformers import Llama4ForCausalLM

    from weft.models.llama4 import LLAMA4_FLAVORS, Transformer

    small = ["--training.seq_len", "32", "--training.local_batch_size", "4"]
    train.train(parse_args(["--job.config_file", "debug_moe", "--job.dump_folder", str(tmp_path / "seed"),
                            "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", *small]))
    seed = tmp_path / "seed" / "checkpoint" / "step-0"
    export_to_hf(seed, tmp_path / "base_hf", flavor="debugmodel_moe")
    run = tmp_path / "ep2"
    run_distributed(_train, 2, str(run), "--job.config_file", "debug_moe", f"--checkpoint.initial_load_path={seed}",
                    "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.local_batch_size", "2",
                    timeout=600)
    _export_checkpoint(run)
    for folder, file in (("adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        assert_same_tensors(run / "one" / folder / file, run / folder / file)
    assert (run / "one" / "adapter" / "adapter_config.json").read_text() == (run / "adapter" / "adapter_config.json").read_text()
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
    _assert_experts_trained(run / "adapter")

    weft = Transformer(LLAMA4_FLAVORS["debugmodel_moe"])
    load_hf_into_model(weft, tmp_path / "base_hf")
    base = Llama4ForCausalLM.from_pretrained(tmp_path / "base_hf", attn_implementation="eager").float().eval()
    tokens = torch.randint(0, weft.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    _assert_agree(*_logits(base, run / "adapter", run / "merged", weft.eval(), tokens))


@pytest.mark.slow
def test_a_qwen3_moe_folder_expert_lora_run_loads_in_peft_with_the_merged_logits(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from weft.models.qwen3 import Transformer

    tiny_qwen3_hf_folder(tmp_path / "source", moe=True)  # layer 1 dense: no adapters on its SwiGLU
    _train(str(tmp_path / "run"), "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path",
           str(tmp_path / "source"))
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    _assert_experts_trained(tmp_path / "run" / "adapter")
    weft = Transformer(model_args_from_hf_folder(tmp_path / "source"))
    load_hf_into_model(weft, tmp_path / "source")
    base = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "source", attn_implementation="eager").float().eval()
    tokens = torch.randint(0, weft.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    _assert_agree(*_logits(base, tmp_path / "run" / "adapter", tmp_path / "run" / "merged", weft.eval(), tokens))


def test_a_peft_export_of_expert_adapters_that_differ_by_layer_is_refused_before_training(tmp_path, capsys):
    """PEFT's target_parameters adapt every layer's experts alike: w1 in one MoE layer and w3 in the
    other cannot be written, so the run is refused in one line at start, not after training."""
    argv = run_args(tmp_path / "run", *EXPERT_LORA, "--lora.target_modules",
                    "layers.1.feed_forward.experts.w1,layers.3.feed_forward.experts.w3", config="debug_moe", steps=1)
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("weft: error: export.peft_folder = 'adapter': PEFT's target_parameters adapt every "
                              "layer's feed_forward.experts.gate_up_proj alike")
    assert not (tmp_path / "run" / "checkpoint").exists()
