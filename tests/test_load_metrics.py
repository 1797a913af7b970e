"""Per-layer load metrics (schemoe.layer.metrics): tokens per expert, dropped fraction and
overload factor on a routing computed by hand. (`schemoe train`'s metrics file and step lines:
tests/test_train_loop.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from schemoe.layer.metrics import LoadMetrics, load_metrics, load_summary, record_load

# 8 tokens, one-hot rows: token t picks expert CHOICE[t] (k = 1, gate weight 10 I).
CHOICE = [0, 0, 0, 1, 2, 0, 1, 0]  # tokens per expert (5, 2, 1, 0)


def _layer(f: float) -> MoELayer:
    cfg = MoEConfig(gate=GateConfig(num_experts=4, top_k=1, capacity_factor=f),
                    experts=ExpertConfig(model_dim=4, hidden_dim=8))  # fmt: skip
    layer = MoELayer(cfg, seed=0)
    with torch.no_grad():
        layer.gate_weight.copy_(10 * torch.eye(4))
    return layer


def _x() -> torch.Tensor:
    return torch.eye(4)[CHOICE]


def test_the_figures_of_hand_counted_loads():
    m = LoadMetrics.from_counts([3, 1, 0, 4, 6])  # 8 choices, 6 kept
    assert (m.tokens, m.kept, m.choices) == ((3, 1, 0, 4), 6, 8)
    assert m.load == [0.375, 0.125, 0.0, 0.5]
    assert m.dropped == 0.25 and m.overload == 2.0  # max 4 / mean 2
    empty = LoadMetrics.from_counts([0, 0, 0])
    assert (empty.dropped, empty.overload, empty.load) == (0.0, 0.0, [0.0, 0.0])


def test_a_layer_sums_its_calls_load_until_taken_then_resets():
    layer = _layer(1.0)  # C = ceil(1 * 1 * 8 / 4) = 2: expert 0 keeps 2 of its 5
    layer.record_routing = True
    layer(_x())
    layer(_x())
    m = layer.take_load_metrics()
    assert m.tokens == (10, 4, 2, 0) and m.kept == 10  # 2 calls x (2 + 2 + 1 + 0)
    assert m.dropped == pytest.approx(6 / 16) and m.overload == 2.5  # 10 / (16 / 4)
    assert layer.take_load_metrics() is None


def test_dropless_routing_drops_nothing_and_eval_calls_are_not_counted():
    layer = _layer(0.0)
    layer.record_routing = True
    layer(_x())
    layer.eval()(_x())
    stats = layer.take_load_metrics().as_dict()
    assert stats == {"tokens": [5, 2, 1, 0], "load": [5 / 8, 2 / 8, 1 / 8, 0.0], "dropped": 0.0,
                     "overload": 2.5}  # fmt: skip


def test_load_metrics_of_a_model_take_every_layer_and_summarise_them_in_one_line():
    model = nn.Sequential(_layer(1.0), _layer(0.0))
    record_load(model)
    x = _x()
    for layer in model:
        layer(x)
    per_layer = load_metrics(model)
    assert [m.kept for m in per_layer] == [5, 8]
    # the worst overload, and the dropped share of all 16 choices (3 of them)
    assert load_summary(per_layer) == "overload 2.50 drop 18.8%"
    assert load_metrics(model) == [None, None] and load_summary([None, None]) == ""
    record_load(model, on=False)
    model[0](x)
    assert load_metrics(model) == [None, None]
