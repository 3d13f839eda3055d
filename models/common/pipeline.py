"""How a decoder (models/common/decoder.py) is cut into pipeline stages: the units a split may not
cut, its `ModelSpec`'s `pipeline_units`. A stage runs as the model does: its forward skips the
embedding, blocks and output the stage does not hold (`Decoder.run_blocks`)."""

from __future__ import annotations

from torch import nn


def decoder_units(model: nn.Module) -> list[list[str]]:
    """The token embedding, each block, the norm with the output."""
    return [["tok_embeddings"], *([f"layers.{key}"] for key in model.layers.keys()), ["norm", "output"]]
