"""The files of a Hugging Face model folder besides its weights: config.json, the tokenizer the run
used (with its chat template) and generation_config.json, so that the folder loads in
`AutoTokenizer`, `pipeline` or a serving engine as it is.

A run records them in `<dump_folder>/hf_files/` with its config.toml (`write_hf_files`), so that an
export of any of its checkpoints finds them there, even if the folder it started from is gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import sentencepiece
import torch

from weft.components.config.parser import read_toml
from weft.components.data import load_tokenizer
from weft.errors import one_line
from weft.models import spec_for_args

logger = logging.getLogger("weft")

HF_FILES = "hf_files"
# What a Hugging Face tokenizer folder may hold (transformers 4 and 5 names): copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model")
# A multimodal folder's image (and video) processor settings: copied as they are, for its other towers.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
_ROTARY_KEYS = ("rope_scaling", "rope_parameters", "rope_theta")
_DTYPE_KEYS = ("torch_dtype", "dtype")


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def model_config(args: Any, dtype: torch.dtype, source: dict[str, Any], tokenizer) -> dict[str, Any]:
    """config.json of the exported model: the source folder's (token ids, transformers version and
    anything else it said) with weft's description of the model over it; token ids from the
    tokenizer where the source gave none."""
    config = {k: v for k, v in source.items() if k not in _ROTARY_KEYS + _DTYPE_KEYS}
    config.update(spec_for_args(args).hf.hf_config(args, dtype))
    if "text_config" not in config:  # a multimodal folder's config stays as it was
        config.setdefault("bos_token_id", tokenizer.bos_id)
        config.setdefault("eos_token_id", tokenizer.eos_id)
    return config


def generation_config(source: dict[str, Any], tokenizer) -> dict[str, Any]:
    """generation_config.json: the source folder's, with every token that ends a turn (EOS, and
    Llama 3's <|eot_id|> where the tokenizer has it) among the EOS ids, so generation stops there."""
    config = dict(source)
    eos = config.get("eos_token_id", tokenizer.eos_id)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    stops = getattr(tokenizer, "stop_ids", [tokenizer.eos_id])
    config["eos_token_id"] = eos + [i for i in stops if i not in eos]
    config.setdefault("bos_token_id", tokenizer.bos_id)
    return config


def copy_tokenizer(tokenizer_path: Path, out: Path) -> None:
    """The tokenizer files of a Hugging Face folder, copied as they are; a SentencePiece model file
    copied as tokenizer.model (converted by `finish_tokenizer` on export)."""
    if tokenizer_path.is_dir():
        for name in TOKENIZER_FILES:
            if (tokenizer_path / name).is_file():
                shutil.copy2(tokenizer_path / name, out / name)
    else:
        shutil.copy2(tokenizer_path, out / "tokenizer.model")


_SAMPLE = "ROMEO: But, soft! what light through yonder window breaks?\n\n  It is the east, é 🙂 x  "


def finish_tokenizer(out: Path) -> str | None:
    """Make a SentencePiece `out/tokenizer.model` without a tokenizer.json loadable by AutoTokenizer:
    transformers' Llama tokenizer converts it, and the result is kept only if it encodes a sample
    as SentencePiece does. None if done (or nothing to do), else a one-line note saying why not."""
    if not (out / "tokenizer.model").is_file() or (out / "tokenizer.json").is_file():
        return None
    settings = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_prefix_space": False,
                "add_bos_token": True, "add_eos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    try:
        from transformers import AutoTokenizer

        converted = AutoTokenizer.from_pretrained(str(out))
        reference = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        if converted.encode(_SAMPLE, add_special_tokens=False) != reference.encode(_SAMPLE):
            raise ValueError("the converted tokenizer encodes a sample differently from SentencePiece")
        converted.save_pretrained(str(out))
        return None
    except Exception as e:  # noqa: BLE001 - any failure leaves the model file and a note
        (out / "tokenizer_config.json").unlink(missing_ok=True)
        return (f"tokenizer.model (SentencePiece) copied but not converted for AutoTokenizer "
                f"({type(e).__name__}: {one_line(e) or 'no message'})")


def write_hf_files(out: Path, args: Any, tokenizer_path: str | Path, source: str | Path | None) -> None:
    """config.json (float32), the tokenizer and generation_config.json of the model `args` into the
    folder `out` (created). `source`: the Hugging Face folder the run started from, whose config.json
    and generation_config.json are kept where weft does not define a value; None for a flavor.
    Imports no transformers: a run records these at every start, in a moment."""
    out.mkdir(parents=True, exist_ok=True)
    source_folder = Path(source) if source else None
    source_config = _json(source_folder / "config.json") if source_folder else {}
    source_generation = _json(source_folder / "generation_config.json") if source_folder else {}
    tokenizer = load_tokenizer(tokenizer_path)
    copy_tokenizer(Path(tokenizer_path), out)
    config = model_config(args, torch.float32, source_config, tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = generation_config(source_generation, tokenizer)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if "text_config" in source_config:
        for name in PROCESSOR_FILES:
            if (source_folder / name).is_file():
                shutil.copy2(source_folder / name, out / name)


def finish_hf_folder(recorded: Path, out: Path, args: Any, dtype: torch.dtype) -> None:
    """A run's recorded files (see write_hf_files) into the export `out`: config.json describing
    `args` in `dtype` over the recorded one, the tokenizer made loadable (or a warning and
    TOKENIZER_NOTE.txt saying why not)."""
    for path in recorded.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, out / path.name)
    recorded_config = _json(recorded / "config.json")
    config = {k: v for k, v in recorded_config.items() if k not in _ROTARY_KEYS + _DTYPE_KEYS}
    config.update(spec_for_args(args).hf.hf_config(args, dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    note = finish_tokenizer(out)
    if note:
        logger.warning(f"export: {note}")
        (out / "TOKENIZER_NOTE.txt").write_text(note + "\n")


def run_hf_files(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The files a run recorded for export (`<dump_folder>/hf_files`, see model_files) above one of
    its checkpoint step folders; None for a checkpoint without them (an older run, a copied folder)."""
    for above in list(Path(checkpoint_dir).resolve().parents)[:4]:
        if (above / HF_FILES / "config.json").is_file():
            return above / HF_FILES
    return None


def recorded_backend(hf_files: Path) -> str:
    """The model.backend of the run that recorded `hf_files` (its config.toml beside them), so that a
    checkpoint is read by the code that wrote it (gpt-oss trains under both); "auto" without one."""
    config = hf_files.parent / "config.toml"
    if not config.is_file():
        return "auto"
    return read_toml(config, label=str(config)).get("model", {}).get("backend", "auto")


def recorded_source(hf_files: Path) -> str:
    """The Hugging Face folder the run that recorded `hf_files` started from (its config.toml's
    checkpoint.initial_load_path, or where a DCP step there was started from): a multimodal folder's export names and copies its tensors; ""
    without one."""
    config = hf_files.parent / "config.toml"
    if not config.is_file():
        return ""
    source = read_toml(config, label=str(config)).get("checkpoint", {}).get("initial_load_path", "")
    earlier = run_hf_files(source) if source and not (Path(source) / "config.json").is_file() else None
    return recorded_source(earlier) if earlier is not None else source  # a run started from another's checkpoint
