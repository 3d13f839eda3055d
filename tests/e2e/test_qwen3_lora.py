"""LoRA runs of Qwen3 and Qwen3-MoE folders written by transformers (train.py, model.flavor
from_hf_config): the PEFT adapter exported at the end loads in `peft` onto transformers'
Qwen3ForCausalLM / Qwen3MoeForCausalLM (read from the source folder) with the logits of weft's
model holding the merged export. The adapters sit on the attention (q/k rows permuted as the base's)
and dense Qwen3's SwiGLU, never on Qwen3-MoE's router or stacked experts. The MoE folder has experts
in every layer, as the published Qwen3-MoE models do: PEFT 0.21 maps a Qwen3-MoE adapter's
`gate_proj`/`up_proj`/`down_proj` targets onto transformers 5's fused experts, so it cannot hold an
adapter on a dense layer's SwiGLU (`mlp_only_layers`) of a Qwen3-MoE model. And QLoRA
(an NF4 base) trains dense Qwen3 as LoRA on the full-precision base does, within NF4's error."""

import pytest
import torch
from safetensors.torch import load_file

from weft import train
from weft.components.config import parse_args
from weft.components.hf import model_args_from_hf_folder
from weft.generate import load_model

from tests.support.hf_folders import tiny_qwen3_hf_folder
from tests.support.train_runs import run_args

LORA = ["--lora.enable", "--lora.rank", "4", "--lora.dropout", "0", "--optimizer.lr", "1e-2"]


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_the_peft_adapter_of_a_lora_run_loads_in_peft_with_weft_logits(tmp_path, moe):
    from peft import LoraConfig, PeftModel
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    tiny_qwen3_hf_folder(tmp_path / "source", moe=moe, **({"mlp_only_layers": []} if moe else {}))
    train.train(parse_args(run_args(
        tmp_path / "run", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(tmp_path / "source"),
        *LORA, "--export.peft_folder", "adapter", "--export.hf_folder", "merged", steps=4)))

    adapter = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    targets = {key.split(".layers.", 1)[1].split(".", 1)[1].rsplit(".lora_", 1)[0] for key in adapter}
    mlp = set() if moe else {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert targets == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", *mlp}
    assert LoraConfig.from_pretrained(tmp_path / "run" / "adapter").r == 4

    hf_class = Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM
    base = hf_class.from_pretrained(tmp_path / "source", attn_implementation="eager").float().eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
    merged_folder = tmp_path / "run" / "merged"
    ours = load_model(model_args_from_hf_folder(merged_folder), hf=str(merged_folder), checkpoint=None,
                      device=torch.device("cpu"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, merged = peft_model(input_ids=tokens).logits, ours(tokens)
        torch.testing.assert_close(theirs, merged, rtol=0, atol=1e-5)
        peft_model.unload()  # the base as the source folder holds it
        assert (base(input_ids=tokens).logits - merged).abs().max() > 1e-3, "the adapters must change the logits"


@pytest.mark.slow
def test_qlora_trains_dense_qwen3_as_lora_on_the_full_base_does(tmp_path):
    def losses(name: str, *extra: str) -> list[float]:
        return train.train(parse_args(run_args(tmp_path / name, "--model.flavor", "debugmodel_qwen3", *LORA, *extra,
                                               "--no-checkpoint.enable", steps=8, batch=4)))

    lora, qlora = losses("lora"), losses("qlora", "--lora.quantize_base", "nf4")
    assert qlora[-1] < qlora[0] - 1.0, "the adapters on the NF4 base must learn"
    assert qlora[0] == pytest.approx(lora[0], rel=2e-2)  # the same start, up to NF4's rounding of the base
    assert qlora != lora  # the base was quantized
    assert all(abs(q - r) < 0.1 * r for q, r in zip(qlora, lora)), (qlora, lora)


def test_a_peft_export_of_adapters_on_a_qwen3_moe_dense_layer_is_refused_before_training(tmp_path, capsys):
    """The MoE folder's layer 1 is dense (mlp_only_layers): PEFT could not load adapters on its
    SwiGLU, so a LoRA run asking for a PEFT export with them is refused in one line at start; on the
    attention alone it is planned."""
    tiny_qwen3_hf_folder(tmp_path / "source", moe=True)
    argv = run_args(tmp_path / "run", "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path",
                    str(tmp_path / "source"), *LORA, "--export.peft_folder", "adapter", steps=1)
    capsys.readouterr()  # transformers' progress bars while writing the folder
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("weft: error: export.peft_folder = 'adapter': PEFT reads a Qwen3-MoE adapter's "
                   "gate_proj/up_proj/down_proj as its fused experts', so the adapter on layers.1.feed_forward.w1 "
                   "(a dense layer's SwiGLU) would not load there; set lora.target_modules to the attention "
                   "(wq, wk, wv, wo)\n")
    assert not (tmp_path / "run" / "adapter").exists() and not (tmp_path / "run" / "checkpoint").exists()
    assert train.main([*argv, "--lora.target_modules", "wq,wk,wv,wo", "--job.dry_run"]) == 0
