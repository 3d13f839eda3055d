"""Float8 on Llama 4: the dense linears (attention, dense feed-forwards, shared experts) become
Float8Linear, the router and the stacked routed experts stay in high precision, and the debug MoE
trains like its fp32 run. Float8 matmuls are emulated (see tests/float8/test_float8.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("torchao", reason="float8 needs torchao")

from weft.float8 import converted_modules  # noqa: E402
from weft.models.llama4 import LLAMA4_FLAVORS, Transformer  # noqa: E402

from tests.support.float8_runs import float8_model  # noqa: E402
from tests.support.float8_runs import train_losses as losses

ARGS = LLAMA4_FLAVORS["debugmodel_moe"]


def build(float8: str | None, monkeypatch) -> Transformer:
    return float8_model(Transformer, ARGS, float8, monkeypatch)


def test_dense_linears_go_float8_routers_and_routed_experts_stay(monkeypatch):
    model = build("tensorwise", monkeypatch)
    converted = set(converted_modules(model))
    moe_layers = [i for i in range(ARGS.n_layers) if ARGS.is_moe_layer(i)]
    expected = {f"layers.{i}.attention.{w}" for i in range(ARGS.n_layers) for w in ("wq", "wk", "wv", "wo")}
    expected |= {f"layers.{i}.feed_forward.{w}" for i in range(ARGS.n_layers) if i not in moe_layers
                 for w in ("w1", "w2", "w3")}
    expected |= {f"layers.{i}.feed_forward.shared_expert.{w}" for i in moe_layers for w in ("w1", "w2", "w3")}
    assert converted == expected  # routers (kept by name) and stacked experts (not Linear) stay


@pytest.mark.slow
def test_float8_debug_moe_trains_like_fp32(monkeypatch):
    reference = losses(build(None, monkeypatch))
    float8 = losses(build("tensorwise", monkeypatch))
    for step in (5, 10, 15, 20):
        assert float8[step - 1] == pytest.approx(reference[step - 1], rel=0.02), step
    assert float8[-1] < float8[0] - 1.0


def test_a_router_stays_in_high_precision_whatever_its_size():
    """16 experts: the router (256 → 16) passes the size rules at min_dim 16 and is still kept."""
    from weft.float8 import Float8Options, apply_float8

    with torch.device("meta"):
        model = Transformer(replace(ARGS, n_experts=16))
    apply_float8(model, Float8Options(min_dim=16, filter_fqns=["output"]))
    converted = set(converted_modules(model))
    assert "layers.1.feed_forward.shared_expert.w1" in converted
    assert not any(name.endswith("router") for name in converted)
