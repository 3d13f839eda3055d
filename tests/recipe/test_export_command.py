"""`weft export` and `weft generate --checkpoint` on the checkpoint of a LoRA and of a QLoRA run
(adapters only), dense Qwen3 and Qwen3-MoE (adapters on the routed experts too), each trained from
a Hugging Face folder written by transformers.

The reference is PEFT: the export's PEFT folder loaded by `peft` onto the base in transformers has
the logits of transformers on the export's merged folder, within 1e-5 in fp32. A QLoRA run's base
is the NF4 one it trained on, so its reference base is the source folder with every weight QLoRA
quantizes put through torchao's NF4 and back (each alone, in weft's blocks): the same 1e-5 then,
where the source folder itself would differ by NF4's rounding (about 1e-2 of a weight)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weft import train
from weft.cli import main as weft
from weft.components.config import parse_args
from weft.components.hf import model_args_from_hf_folder
from weft.generate import cast_model, load_model, logits
from weft.parallelisms.lora import NF4_BLOCK, merge_adapters, nf4_scaler_block
from weft.recipe.export import adapter_model

from tests.support import REPO
from tests.support.hf_folders import tiny_qwen3_hf_folder
from tests.support.train_runs import run_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEPS = 2
TOKENIZER = str(REPO / "assets" / "tokenizer" / "shakespeare.model")
# Small, with weights NF4 can hold in whole groups of scales; the MoE's layer 1 is dense.
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=256,
             num_hidden_layers=2)
MOE_SHAPE = SHAPE | dict(moe_intermediate_size=256, num_experts=8, mlp_only_layers=[1])
# PEFT holds no adapter on a Qwen3-MoE dense layer's SwiGLU (tests/e2e/test_qwen3_lora.py).
TARGETS = {False: "wq,wk,wv,wo,w1,w2,w3", True: "wq,wk,wv,wo,experts"}
RUNS = {"qwen3_lora": (False, False), "qwen3_qlora": (False, True), "qwen3_moe_lora": (True, False),
        "qwen3_moe_qlora": (True, True)}
SLOW = {"qwen3_moe_lora", "qwen3_moe_qlora"}
ALL_RUNS = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in RUNS]


class Runs:
    """Each run trained and exported once, when a test first asks for it."""

    def __init__(self, root: Path):
        self.root, self.done = root, set()

    def base(self, moe: bool) -> Path:
        folder = self.root / ("base_moe" if moe else "base")
        if not folder.exists():
            tiny_qwen3_hf_folder(folder, moe=moe, **(MOE_SHAPE if moe else SHAPE))
        return folder

    def __call__(self, name: str) -> Path:
        moe, qlora = RUNS[name]
        run = self.root / name
        if name not in self.done:
            train.train(parse_args(run_args(
                run, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(self.base(moe)),
                "--lora.enable", "--lora.rank", "4", "--lora.dropout", "0", "--lora.target_modules", TARGETS[moe],
                *(["--lora.quantize_base", "nf4"] if qlora else []), "--optimizer.lr", "1e-2",
                "--lr_scheduler.warmup_steps", "0", "--no-validation.enable", steps=STEPS, checkpoint_every=STEPS)))
            assert weft(["export", "--checkpoint", str(checkpoint(run)), "--out", str(run / "merged"),
                         "--peft-out", str(run / "adapter")]) == 0
            self.done.add(name)
        return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("export_command"))


def checkpoint(run: Path) -> Path:
    return run / "checkpoint" / f"step-{STEPS}"


def nf4_base(base: Path, out: Path, moe: bool) -> Path:
    """`base` with the weights a QLoRA run holds in NF4 (its targets' linears, every routed expert)
    quantized by torchao and dequantized, each alone, q_proj and k_proj in weft's row order
    (each head's rotary pairs interleaved; NF4's scales depend on the order)."""
    from torchao.quantization import to_nf4

    quantized = ("q_proj", "k_proj", "v_proj", "o_proj") + (() if moe else ("gate_proj", "up_proj", "down_proj"))
    head_dim = SHAPE["head_dim"]
    tensors = load_file(base / "model.safetensors")
    for key, tensor in tensors.items():
        if ".mlp.experts." not in key and key.rsplit(".", 2)[-2] not in quantized:
            continue
        rotary = key.rsplit(".", 2)[-2] in ("q_proj", "k_proj")
        if rotary:
            tensor = tensor.view(-1, 2, head_dim // 2, tensor.shape[1]).transpose(1, 2).reshape(tensor.shape)
        tensor = to_nf4(tensor, NF4_BLOCK, nf4_scaler_block(tensor.numel())).get_original_weight()
        if rotary:
            tensor = tensor.view(-1, head_dim // 2, 2, tensor.shape[1]).transpose(1, 2).reshape(tensor.shape)
        tensors[key] = tensor.contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(base / "config.json", out / "config.json")
    return out


def load(folder: Path):
    """A Hugging Face folder in transformers, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()


@pytest.mark.parametrize("name", ALL_RUNS)
def test_the_peft_folder_on_the_base_in_peft_has_the_merged_folders_logits(runs, name, tmp_path):
    from peft import PeftModel

    moe, qlora = RUNS[name]
    run, source = runs(name), runs.base(moe)
    base_folder = nf4_base(source, tmp_path / "nf4_base", moe) if qlora else source
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(load(base_folder), run / "adapter").eval()(input_ids=tokens).logits
        merged = load(run / "merged")(input_ids=tokens).logits
        plain = load(base_folder)(input_ids=tokens).logits
    torch.testing.assert_close(peft, merged, rtol=0, atol=1e-5)
    assert (peft - plain).abs().max() > 1e-3, "the adapters must have trained"
    if qlora:  # the export's base is the NF4 one, not the source folder's
        with torch.no_grad():
            assert (load(source)(input_ids=tokens).logits - plain).abs().max() > 1e-3


@pytest.mark.parametrize("name", ALL_RUNS)
def test_generate_from_the_checkpoint_samples_the_merged_folder(runs, name, capsys):
    run = runs(name)
    common = ["--tokenizer", TOKENIZER, "--prompt", "ROMEO:", "--max-new-tokens", "12"]
    capsys.readouterr()
    assert weft(["generate", "--checkpoint", str(checkpoint(run)), *common]) == 0
    from_checkpoint = capsys.readouterr().out.splitlines()[-1]
    assert weft(["generate", "--hf", str(run / "merged"), *common]) == 0
    assert from_checkpoint == capsys.readouterr().out.splitlines()[-1]
    # the model generate samples from, built in memory, is the merged folder's to the bit
    in_memory = cast_model(merge_adapters(adapter_model(checkpoint(run))[0]), torch.float32, torch.device("cpu"))
    folder = load_model(model_args_from_hf_folder(run / "merged"), hf=str(run / "merged"), checkpoint=None,
                        device=torch.device("cpu"), dtype=torch.float32)
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(in_memory.eval(), tokens), logits(folder.eval(), tokens))
    assert not any(".lora_" in name for name, _ in in_memory.named_parameters())


def test_a_moved_base_is_one_line_naming_it_and_found_again_with_base(runs, tmp_path, capsys):
    run = runs("qwen3_lora")
    base = runs.base(False)
    moved = tmp_path / "moved_base"
    out = tmp_path / "out"
    out.mkdir()  # an existing empty folder: a failed export leaves it as it was
    base.rename(moved)
    try:
        capsys.readouterr()
        for argv in (["export", "--checkpoint", str(checkpoint(run)), "--out", str(out)],
                     ["generate", "--checkpoint", str(checkpoint(run)), "--tokenizer", TOKENIZER, "--prompt", "R"]):
            assert weft(argv) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [(f"weft: error: checkpoint.initial_load_path = '{base}' in {run / 'config.toml'}: the run's "
                            "base is not there (moved or removed); `weft export --base` reads it from where it is now")]
        assert out.is_dir() and not any(out.iterdir())
        assert weft(["export", "--checkpoint", str(checkpoint(run)), "--out", str(out), "--base", str(moved)]) == 0
    finally:
        moved.rename(base)
    merged, again = load_file(run / "merged" / "model.safetensors"), load_file(out / "model.safetensors")
    assert merged.keys() == again.keys() and all(torch.equal(merged[k], again[k]) for k in merged)


def test_a_refused_export_writes_nothing_and_leaves_existing_folders_as_they_were(runs, tmp_path, capsys):
    run = runs("qwen3_lora")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    new = tmp_path / "new"
    cases = [
        (["--out", str(new), "--peft-out", str(full)], f"output folder {full} exists and is not empty"),
        (["--out", str(new), "--peft-out", str(new)], f"--out and --peft-out: both are {new}"),
        (["--out", str(new), "--flavor", "debugmodel_qwen3"], "--flavor: "),
    ]
    for extra, message in cases:
        capsys.readouterr()
        assert weft(["export", "--checkpoint", str(checkpoint(run)), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("weft: error: ") and message in err[0], err
    assert weft(["generate", "--checkpoint", str(checkpoint(run)), "--flavor", "debugmodel_qwen3", "--prompt", "R"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # generate names the option too
    assert len(err) == 1 and err[0].startswith("weft: error: --flavor: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"] and (full / "keep.txt").read_text() == "mine"
