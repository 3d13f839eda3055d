"""Float8 on Qwen3 and Qwen3-MoE: attention's four projections and the dense SwiGLUs become
Float8Linear; the q/k norms, the router and the stacked routed experts stay in high precision;
and the debug MoE trains like its fp32 run. Float8 matmuls are emulated (see
tests/float8/test_float8.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torchao", reason="float8 needs torchao")

from weft.float8 import converted_modules  # noqa: E402
from weft.models.qwen3 import QWEN3_FLAVORS, Transformer  # noqa: E402

from tests.support.float8_runs import float8_model, train_losses  # noqa: E402

# 16 experts in the MoE flavor: its router (256 -> 16) passes float8's size rules at min_dim 16, so
# only its name keeps it in high precision.
FLAVORS = {"dense": QWEN3_FLAVORS["debugmodel_qwen3"],
           "moe": replace(QWEN3_FLAVORS["debugmodel_qwen3_moe"], n_experts=16)}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_attention_and_dense_swiglu_go_float8_the_rest_stays(flavor, monkeypatch):
    args = FLAVORS[flavor]
    model = float8_model(Transformer, args, "tensorwise", monkeypatch)
    expected = {f"layers.{i}.attention.{w}" for i in range(args.n_layers) for w in ("wq", "wk", "wv", "wo")}
    expected |= {f"layers.{i}.feed_forward.{w}" for i in range(args.n_layers) if not args.is_moe_layer(i)
                 for w in ("w1", "w2", "w3")}
    assert set(converted_modules(model)) == expected
    assert (flavor == "moe") == any(args.is_moe_layer(i) for i in range(args.n_layers))
    # the output head (filtered) and, in Qwen3-MoE, the routers (by name) are Linear too, and kept
    kept = {name for name, module in model.named_modules()
            if type(module).__name__ == "Linear" and name not in expected}
    routers = {f"layers.{i}.feed_forward.router" for i in range(args.n_layers) if args.is_moe_layer(i)}
    assert kept == {"output"} | routers


@pytest.mark.slow
def test_float8_debug_qwen3_moe_trains_like_fp32(monkeypatch):
    """Two blocks of Qwen3-MoE (one MoE, one dense SwiGLU: every kind of linear dense Qwen3 has
    too), 20 steps, within 2% of fp32 at every 5th."""
    args = replace(FLAVORS["moe"], n_layers=2)
    reference = train_losses(float8_model(Transformer, args, None, monkeypatch))
    float8 = train_losses(float8_model(Transformer, args, "tensorwise", monkeypatch))
    for step in (5, 10, 15, 20):
        assert float8[step - 1] == pytest.approx(reference[step - 1], rel=0.02), step
    assert float8[-1] < float8[0] - 1.0
