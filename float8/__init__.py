"""Float8 training through torchao: layer conversion, support checks, tensor-parallel styles.

Importing this package does not import torchao; the functions that need it do (float8/float8.py).
"""

from weft.float8.float8 import (
    DEFAULT_MIN_DIM,
    RECIPES,
    Float8Options,
    Float8Unavailable,
    apply_float8,
    check_float8_composes,
    check_float8_compute,
    check_float8_support,
    converted_modules,
    float8_tp_all_gather,
    float8_tp_styles,
    precompute_float8_scales,
)

__all__ = [
    "DEFAULT_MIN_DIM",
    "RECIPES",
    "Float8Options",
    "Float8Unavailable",
    "apply_float8",
    "check_float8_composes",
    "check_float8_compute",
    "check_float8_support",
    "converted_modules",
    "float8_tp_all_gather",
    "float8_tp_styles",
    "precompute_float8_scales",
]
