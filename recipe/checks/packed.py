"""Packed documents (chat and prompt/completion samples, text with document masking) against a model
in which they would see each other."""

from __future__ import annotations

from weft.components.config import ConfigError, JobConfig
from weft.models import ModelSpec


def check_packed_documents(cfg: JobConfig, spec: ModelSpec, args) -> None:
    """Documents packed into one row (chat and prompt/completion samples, text with document masking,
    and their validation) must not see each other: refused, naming the key, for a model whose spec says
    they would (transformers' gpt-oss, linear-attention models)."""
    refuse = spec.refusals.packed_documents
    if refuse is None or (refusal := refuse(args)) is None:
        return
    formats = {"data.format": cfg.data.format, "validation.format": cfg.validation.format or cfg.data.format}
    for key, value in formats.items():
        if value in ("chat", "prompt_completion") and (key == "data.format" or cfg.validation.enable):
            raise ConfigError(f"{key} = {value}: packs samples into rows, and {refusal}; "
                              "train it on data.format = text without data.document_masking")
    if cfg.data.document_masking:
        raise ConfigError(f"data.document_masking = true: {refusal}; set it to false")
