"""components/training/moe_balance.py: the load imbalance it reports, and that its bias evens the load."""

import pytest
import torch

from weft.components.training.moe_balance import balance_experts, moe_layers
from weft.models.common.moe import MoE, route


def skewed() -> tuple[MoE, torch.Tensor]:
    """A layer of 4 experts (top 1) whose router sends most of these 256 tokens to expert 0."""
    torch.manual_seed(0)
    layer = MoE(16, 32, n_experts=4, top_k=1)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(256, 16) + 1.0
    with torch.no_grad():
        layer.router.weight[0] = 0.25  # a positive logit for every token's (positive-mean) features
    return layer, x


def test_imbalance_is_the_busiest_experts_load_over_the_mean():
    layer, x = skewed()
    counts = torch.bincount(route(layer.router(x), 1, "sigmoid")[1].flatten(), minlength=4).float()
    layer(x)
    assert balance_experts(layer, rate=0.0) == {"": (counts.max() / counts.mean()).item()}
    assert counts.max() / counts.mean() > 3  # skewed: most tokens to one expert
    assert torch.equal(layer.tokens_per_expert, torch.zeros(4))  # read and reset
    assert torch.equal(layer.expert_bias, torch.zeros(4))  # rate 0: left alone


def test_the_bias_lowers_the_imbalance_of_skewed_tokens_over_50_steps():
    """The same tokens 50 times, the bias moved by 0.1 after each: the load evens out (and the
    bias never enters the outputs' weights: see tests/models/test_moe.py)."""
    layer, x = skewed()
    imbalances = []
    for _ in range(50):
        with torch.no_grad():
            layer(x)
        imbalances.append(balance_experts(layer, rate=0.1)[""])
    assert imbalances[0] > 3 and max(imbalances[-10:]) < 1.5, imbalances
    assert layer.expert_bias[0] < 0 < layer.expert_bias[1:].max()  # the busy expert pushed down


def test_the_recipe_gives_each_moe_layer_its_share_of_the_load_balance_coefficient():
    """--moe.load_balance_coeff 0.01 with 4 accumulated micro-batches: each MoE layer adds
    0.0025 × its loss per forward, so the step's gradient holds 0.01 × their mean."""
    from weft.components.config import parse_args
    from weft.recipe.build import build_trainer
    from weft.recipe.plan import RunPlan

    cfg = parse_args(["--job.config_file", "debug_moe", "--moe.load_balance_coeff", "0.01",
                      "--training.gradient_accumulation_steps", "4", "--training.local_batch_size", "2"])
    plan = RunPlan.from_config(cfg, 1, device_type="cpu", writes_dump_folder=False)
    model = build_trainer(plan, None, torch.device("cpu")).model
    coefficients = [layer.load_balance_coeff for _, layer in moe_layers(model)]
    assert len(coefficients) == 2 and all(c == pytest.approx(0.0025) for c in coefficients)
