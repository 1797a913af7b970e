"""The configurations in examples/*.args: each is a valid `schemoe train` run of the model family
it names, and its layer trains (one forward and backward on one process, against the
single-process reference). The 40-step runs on 4 ranks are in docs/results/layer2026_2026-12-05."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemoe import MoELayer
from schemoe.layer.reference import reference_moe
from schemoe.train import loop as T
from schemoe.train.config import TrainConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _config(name: str) -> TrainConfig:
    return TrainConfig.from_args(T.parse_args([f"@{EXAMPLES / name}", "--device", "cpu"]))


def test_the_deepseek_v3_style_example_is_a_deepseek_v3_layer():
    cfg = _config("deepseek_v3_style.args")
    cfg.validate(4)  # what `schemoe train` checks before its 4 ranks start
    moe = cfg.moe_config(4)
    g = moe.gate
    assert (g.score, g.groups, g.top_groups, g.scale) == ("sigmoid", 8, 4, 2.5)
    assert g.dropless and g.bias_update_rate > 0 and g.renormalize
    assert moe.shared is not None and moe.shared.num == 1
    assert (moe.experts.activation, moe.experts.impl) == ("swiglu", "grouped")


def test_the_qwen3_moe_style_example_is_a_qwen3_moe_layer():
    moe = _config("qwen3_moe_style.args").moe_config(4)
    g = moe.gate
    assert (g.score, g.groups, g.scale, g.renormalize) == ("softmax", 1, 1.0, True)
    assert g.dropless and g.aux_loss_weight > 0 and moe.shared is None


@pytest.mark.parametrize("name", ["deepseek_v3_style.args", "qwen3_moe_style.args"])
def test_an_example_layer_matches_the_reference_forward_and_backward(name):
    moe = _config(name).moe_config(4)
    torch.manual_seed(0)
    layer = MoELayer(moe)
    x = torch.randn(32, moe.experts.model_dim, requires_grad=True)
    y, aux = layer(x)
    (y.square().sum() + aux).backward()
    state = {k: v.detach() for k, v in layer.global_state().items()}
    x_ref = x.detach().clone().requires_grad_(True)
    (y_ref,), (aux_ref,) = reference_moe([x_ref], state, moe, bias=layer.expert_bias)
    (y_ref.square().sum() + aux_ref).backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
