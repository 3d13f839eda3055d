"""The text model of a multimodal folder on the transformers backend (models/transformers/multimodal.py):
tiny Gemma 3 (SigLIP vision tower, tied head) and Mistral 3 (Pixtral vision tower, its own head)
folders written by transformers around a text folder's causal LM (tests/support/hf_multimodal.py).
The references are transformers' own: the ConditionalGeneration class on the folder, and the text
folder, which the backend trains as any text folder, with the same losses and trained weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from weft import generate
from weft.components.config.shipped import SHIPPED_TOKENIZER
from weft.components.data import load_tokenizer

from tests.support.hf_multimodal import write_multimodal_folder
from tests.support.train_runs import run, run_args

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
TEXT_CONFIGS = {
    # Gemma 3 4B's layout: a sliding and a global layer, the head tied to the embedding (and a SigLIP tower)
    "gemma3": lambda: transformers.Gemma3TextConfig(**TEXT, sliding_window=8, pad_token_id=0,
                                                    layer_types=["sliding_attention", "full_attention"]),
    # Mistral Small 3.1's: a Mistral text model with its own head (and a Pixtral tower)
    "mistral3": lambda: transformers.MistralConfig(**TEXT, sliding_window=None, tie_word_embeddings=False),
}
# Decoded only (its linear-attention layers refuse packed samples): Qwen3.5, whose folder transformers
# writes under its newer names (`model.language_model.`, `lm_head.`) where the others keep the older ones.
DECODED = {"qwen3_5": lambda: transformers.Qwen3_5TextConfig(
    **TEXT, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)}
CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration",
           "qwen3_5": "Qwen3_5ForConditionalGeneration"}
FP32 = ("--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3")
TOKENS = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))


def write_folders(root: Path, family: str) -> None:
    """<family>_text: a text model, as transformers' causal LM; <family>: the multimodal folder around it."""
    torch.manual_seed(0)
    config = (TEXT_CONFIGS | DECODED)[family]()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / f"{family}_text")
    write_multimodal_folder(root / f"{family}_text", root / family)
    (root / family / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": family}))


def sft_args(root: Path, folder: str, dump: Path, *extra: str) -> list[str]:
    return run_args(dump, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(root / folder),
                    "--data.format", "prompt_completion", "--data.dataset_path", str(root / "sft.jsonl"), *FP32,
                    *extra, steps=6, batch=4)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_multimodal")
    for family in (*TEXT_CONFIGS, *DECODED):
        write_folders(root, family)
    records = [{"prompt": f"Q{i}: who is there?\n", "completion": "Nay, answer me." * (1 + i % 4)} for i in range(64)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture(scope="module")
def runs(root) -> dict[str, list[float]]:
    """6 steps from each multimodal folder (checkpointed at 3 and 6) and from its text-only twin,
    each exported at the end (<run>/hf)."""
    return {folder: run(sft_args(root, folder, root / f"run_{folder}", "--export.hf_folder", "hf",
                                 *(("--checkpoint.enable", "--checkpoint.interval", "3") if folder == "gemma3" else ())))
            for family in TEXT_CONFIGS for folder in (family, f"{family}_text")}


def logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).logits


def load_multimodal(family: str, folder: Path):
    model, info = getattr(transformers, CLASSES[family]).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return model


@pytest.mark.parametrize("family", TEXT_CONFIGS)
def test_the_text_model_trains_as_its_text_folder_and_exports_the_source_folder_with_the_trained_weights(
        root, runs, family):
    torch.testing.assert_close(runs[family], runs[f"{family}_text"], rtol=0, atol=1e-5)
    source, exported = load_file(root / family / "model.safetensors"), load_file(root / f"run_{family}/hf/model.safetensors")
    assert sorted(exported) == sorted(source)
    towers = [k for k in source if not k.startswith("language_model.")]
    assert towers and all(torch.equal(exported[k], source[k]) for k in towers)  # copied as they were
    assert all(not torch.equal(exported[k], source[k]) for k in source if k not in towers and "norm" not in k)
    config = json.loads((root / family / "config.json").read_text())
    assert json.loads((root / f"run_{family}" / "hf" / "config.json").read_text()) == config
    processor = "preprocessor_config.json"  # the towers' settings too
    assert (root / f"run_{family}" / "hf" / processor).read_text() == (root / family / processor).read_text()
    # The ConditionalGeneration class reads every tensor, and computes the text-only run's model.
    ours = logits(load_multimodal(family, root / f"run_{family}" / "hf"))
    text = transformers.AutoModelForCausalLM.from_pretrained(root / f"run_{family}_text" / "hf")
    torch.testing.assert_close(ours, logits(text), rtol=0, atol=1e-5)
    assert (ours - logits(load_multimodal(family, root / family))).abs().max() > 1e-3


@pytest.mark.parametrize("family", [*TEXT_CONFIGS, *DECODED])
def test_generate_decodes_greedily_as_the_multimodal_class(root, family, capsys):
    prompt = "ROMEO: But, soft!"
    assert generate.main(["--hf", str(root / family), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    tokenizer = load_tokenizer(str(SHIPPED_TOKENIZER))
    ids = tokenizer.encode(prompt, bos=True, eos=False)
    out = load_multimodal(family, root / family).eval().generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.eos_id)
    assert ours == tokenizer.decode(out[0].tolist())


def test_checkpoints_keep_the_text_model_s_names_and_export_as_the_end_of_run(root, runs, tmp_path, capsys):
    from weft.recipe.export import main as export_main

    checkpoint = root / "run_gemma3" / "checkpoint" / "step-6"
    saved = [k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata if k.startswith("model.")]
    text = transformers.AutoModelForCausalLM.from_pretrained(root / "gemma3_text")
    assert sorted(saved) == sorted(f"model.{name}" for name in text.state_dict())
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "cli")]) == 0
    cli, at_end = load_file(tmp_path / "cli" / "model.safetensors"), load_file(root / "run_gemma3/hf/model.safetensors")
    assert cli.keys() == at_end.keys() and all(torch.equal(cli[k], at_end[k]) for k in cli)
    capsys.readouterr()
    decoded = []
    for source in (["--checkpoint", str(checkpoint)], ["--hf", str(root / "run_gemma3" / "hf")]):
        assert generate.main([*source, "--prompt", "ROMEO:", "--max-new-tokens", "12"]) == 0
        decoded.append(capsys.readouterr().out)
    assert decoded[0] == decoded[1]
    # Without the source folder (moved), the export of its other towers is refused in one line.
    moved = tmp_path / "moved"
    shutil.copytree(root / "run_gemma3", moved, ignore=shutil.ignore_patterns("hf", "step-3"))
    toml = moved / "config.toml"
    toml.write_text(toml.read_text().replace(str(root / "gemma3"), str(tmp_path / "gone")))
    capsys.readouterr()
    assert export_main(["--checkpoint", str(moved / "checkpoint" / "step-6"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is multimodal (config.json has text_config)" in err and str(tmp_path / "gone") in err


def test_a_lora_run_s_peft_folder_loads_on_the_multimodal_class_as_the_merged_export(root, tmp_path):
    peft = pytest.importorskip("peft")
    run(sft_args(root, "gemma3", tmp_path / "run", "--lora.enable", "--lora.rank", "4", "--export.peft_folder", "peft",
                 "--export.hf_folder", "merged"))
    adapted = peft.PeftModel.from_pretrained(load_multimodal("gemma3", root / "gemma3"), tmp_path / "run" / "peft")
    wrapped = [name for name, module in adapted.named_modules() if hasattr(module, "lora_A")]
    assert len(wrapped) == 2 * 7 and all(".language_model.layers." in name for name in wrapped)  # the text model's only
    merged = logits(load_multimodal("gemma3", tmp_path / "run" / "merged"))
    torch.testing.assert_close(logits(adapted), merged, rtol=0, atol=1e-5)
    assert (merged - logits(load_multimodal("gemma3", root / "gemma3"))).abs().max() > 1e-3  # the adapters trained


def test_a_multimodal_folder_whose_text_tensors_transformers_converts_is_refused_naming_it(tmp_path):
    from weft.components.hf import ConversionError
    from weft.components.hf.load import model_args_from_hf_folder

    text = transformers.Qwen3_5MoeTextConfig(**TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                             layer_types=["full_attention", "full_attention"])
    config = transformers.Qwen3_5MoeConfig(text_config=text.to_dict())
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ConversionError, match=r"^HF folder .*: model_type qwen3_5_moe: transformers converts its text "
                                              r"model's \(qwen3_5_moe_text\) tensors on load") as refused:
        model_args_from_hf_folder(tmp_path, "auto")
    assert "\n" not in str(refused.value)
