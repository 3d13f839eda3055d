"""What weft ships beside its code, found through the package so that an installed weft runs from
any folder: the TOML configs of train_configs/, and under assets/ the Shakespeare tokenizer and
corpus (pyproject.toml's package-data installs them inside the package).

The shipped configs name the assets as the checkout does, relative to the current folder
(`assets/data/shakespeare`). `shipped_path` keeps that meaning where it holds (a checkout, or a
project with its own assets/ folder) and otherwise gives weft's own copy.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
TRAIN_CONFIGS = PACKAGE_ROOT / "train_configs"
SHIPPED_TOKENIZER = PACKAGE_ROOT / "assets" / "tokenizer" / "shakespeare.model"


def shipped_path(path: str) -> str:
    """`path`, unless it is a relative path under assets/ that is missing from the current folder
    and that weft ships: then weft's own copy of it (an absolute path)."""
    relative = Path(path)
    if relative.is_absolute() or relative.parts[:1] != ("assets",) or relative.exists():
        return path
    ours = PACKAGE_ROOT / relative
    return str(ours) if ours.exists() else path
