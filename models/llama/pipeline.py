"""How weft's Llama is cut into pipeline stages: the units a split may not cut (its `ModelSpec`'s
`pipeline_units`). A stage runs as the model does: its forward skips the embedding, blocks and
output a stage does not hold (models/llama/model.py)."""

from __future__ import annotations

from torch import nn


def llama_units(model: nn.Module) -> list[list[str]]:
    """weft's Llama as units: the token embedding, each block, the norm with the output."""
    return [["tok_embeddings"], *([f"layers.{key}"] for key in model.layers.keys()), ["norm", "output"]]
