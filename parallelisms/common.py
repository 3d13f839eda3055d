"""What every transform needs to know about a model it has never seen: where its repeated blocks
are, and whether data parallelism has already wrapped it."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from weft.errors import TransformError

# Where common model families keep their repeated blocks, as attribute paths from the root:
# weft's Llama and most hand-written models, transformers' *ForCausalLM (the base model sits in
# `.model`), and GPT-2 / nanoGPT.
BLOCK_CONTAINERS = ("layers", "model.layers", "transformer.h")


def transformer_blocks(model: nn.Module, function: str, blocks: Iterable[nn.Module] | None = None) -> list[nn.Module]:
    """The model's repeated blocks: `blocks` if given, else the first container of
    BLOCK_CONTAINERS the model has (a ModuleList or ModuleDict)."""
    if blocks is not None:
        found = list(blocks)
        if not found or not all(isinstance(b, nn.Module) for b in found):
            raise TransformError(function, "blocks", "blocks must be a non-empty sequence of modules")
        return found
    for path in BLOCK_CONTAINERS:
        container = _attribute(model, path)
        if isinstance(container, nn.ModuleDict):
            return list(container.values())
        if isinstance(container, nn.ModuleList):
            return list(container)
    raise TransformError(
        function,
        "blocks",
        f"found no transformer blocks in {type(model).__name__} (looked for "
        f"{', '.join('model.' + p for p in BLOCK_CONTAINERS)}); pass blocks=[...] explicitly",
    )


def _attribute(model: nn.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
