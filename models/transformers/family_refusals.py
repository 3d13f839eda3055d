"""Families the transformers backend refuses because transformers computes them two ways, so a model
weft trains (transformers' forward, as its own training runs it) is not the one transformers loads
or generates with. Each cause was measured by benchmarks/hf_families.py (docs/transformers-families.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weft.models.common.spec import HFConfigError


def _moshi(config) -> str | None:
    window, longest = getattr(config, "sliding_window", None), getattr(config, "max_position_embeddings", None)
    if isinstance(window, int) and isinstance(longest, int) and window < longest:
        return (f"transformers' forward (which training runs) attends every earlier token, but its generate's cache "
                f"keeps the last sliding_window ({window}) of the max_position_embeddings ({longest}) it takes")
    return None


def _youtu(config) -> str | None:
    if getattr(config, "pad_token_id", None) is not None:
        return (f"transformers zeroes the token embedding's padding row (pad_token_id {config.pad_token_id}) "
                "whenever it loads a youtu folder: what the folder or training puts there is lost on loading "
                "(a folder without pad_token_id trains)")
    return None


# model_type -> why transformers computes a folder of it two ways (None where this folder is not affected)
REFUSALS: dict[str, Callable[[Any], str | None]] = {"moshi": _moshi, "youtu": _youtu}


def refuse_family(config) -> None:
    """HFConfigError, one line naming the family and what differs, where `config` (transformers'
    config object of a folder) is of a family transformers computes two ways (`REFUSALS`)."""
    why = REFUSALS.get(config.model_type, lambda _: None)(config)
    if why is not None:
        raise HFConfigError(f"model_type {config.model_type}: {why}")
