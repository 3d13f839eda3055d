"""Float8 on gpt-oss: attention's four biased projections become Float8Linear; the sinks, the router
and the stacked experts (with their biases and clamped SwiGLU) stay in high precision; and two
blocks train like their fp32 run. Float8 matmuls are emulated (see tests/float8/test_float8.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torchao", reason="float8 needs torchao")

from weft.float8 import converted_modules  # noqa: E402
from weft.models.gpt_oss import GPT_OSS_FLAVORS, Transformer  # noqa: E402

from tests.support.float8_runs import float8_model, train_losses  # noqa: E402

# 2 blocks (a sliding and a full one), 16 experts: the router (256 -> 16) passes float8's size rules
# at min_dim 16, so only its name keeps it in high precision.
ARGS = replace(GPT_OSS_FLAVORS["debugmodel_gpt_oss"], n_layers=2, n_experts=16)


def test_attention_goes_float8_the_router_and_experts_stay_and_it_trains_like_fp32(monkeypatch):
    model = float8_model(Transformer, ARGS, "tensorwise", monkeypatch)
    expected = {f"layers.{i}.attention.{w}" for i in range(ARGS.n_layers) for w in ("wq", "wk", "wv", "wo")}
    assert set(converted_modules(model)) == expected
    assert all(model.get_submodule(name).bias is not None for name in expected)  # biases kept
    kept = {name for name, module in model.named_modules() if type(module).__name__ == "Linear"}
    assert kept == {"output"} | {f"layers.{i}.feed_forward.router" for i in range(ARGS.n_layers)}
    reference = train_losses(float8_model(Transformer, ARGS, None, monkeypatch), steps=8)
    float8 = train_losses(model, steps=8)
    for step in (4, 8):
        assert float8[step - 1] == pytest.approx(reference[step - 1], rel=0.02), step
    assert float8[-1] < float8[0] - 1.0
