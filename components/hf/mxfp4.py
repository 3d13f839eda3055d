"""MXFP4 tensors of a Hugging Face folder (gpt-oss's experts as published) dequantized on load.

The OCP microscaling format: FP4 E2M1 values, two per byte (the low nibble first), and one E8M0
scale (a power of two, exponent biased by 127) per 32 values. A folder holds a weight W
[experts, in, out] as `W_blocks` [experts, out, in/32, 16] and `W_scales` [experts, out, in/32],
and says so in config.json's `quantization_config` (`quant_method` "mxfp4")."""

from __future__ import annotations

from typing import Any

import torch

from weft.components.hf.safetensors_io import ConversionError

# E2M1: sign, two exponent bits, one mantissa bit; index = the nibble.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PARTS = ("_blocks", "_scales")


def quantized(config: dict[str, Any], source: str) -> bool:
    """Whether config.json says the folder holds MXFP4 tensors; ConversionError for another method."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ConversionError(f"{source}: quantization_config.quant_method is {method}; weft reads unquantized "
                              "folders and mxfp4 ones (dequantized to bfloat16)")
    return method == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [experts, in, out] from its `blocks` [experts, out, in/32, 16] (uint8) and `scales`
    [experts, out, in/32], one expert at a time (float32 values of one expert at most beside W)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ConversionError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                              "(expected [..., n, 16] and [..., n])")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, groups * 32, rows, dtype=dtype)
    for e in range(experts):
        codes = blocks[e].to(torch.uint8)
        values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1).flatten(-2)
        values = torch.ldexp(values, (scales[e].to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
        out[e] = values.flatten(-2).transpose(0, 1).to(dtype)  # [in, out]
    return out
