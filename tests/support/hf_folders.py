"""A Hugging Face model folder of the debug model's shape, for tests that load or fine-tune one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def tiny_hf_folder(folder: Path, tokenizer_folder: Path) -> Path:
    """A randomly initialised transformers LlamaForCausalLM of the debug model's shape, with the tokenizer."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from weft.models.llama.hf_mapping import hf_config
    from weft.models.llama import LLAMA_FLAVORS

    torch.manual_seed(0)
    config = {k: v for k, v in hf_config(LLAMA_FLAVORS["debugmodel"]).items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder
