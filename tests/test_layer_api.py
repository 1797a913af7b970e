"""Input validation, dtypes, user experts, the balancing bias and DDP integration."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from moe_cases import check_against_reference
from schemoe import (
    CollectiveConfig,
    CompressionConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    MoELayer,
    ScheduleConfig,
    ddp_ignore_experts,
    expert_parameters,
)


def cfg(E=4, k=2, f=1.0, M=8, H=16, **kw):
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=k, capacity_factor=f, **kw),
        experts=ExpertConfig(model_dim=M, hidden_dim=H),
    )


def test_input_of_the_wrong_rank_or_model_dim_is_rejected_naming_the_shape():
    layer = MoELayer(cfg())
    with pytest.raises(ValueError, match=r"got shape \(8,\)"):
        layer(torch.randn(8))
    with pytest.raises(ValueError, match=r"got shape \(3, 7\)"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"\[T, 8\]"):
        layer(torch.randn(1, 2, 3, 8))


def test_a_dtype_mismatch_is_a_type_error_naming_both_dtypes():
    layer = MoELayer(cfg())
    with pytest.raises(TypeError, match="torch.float64.*torch.float32"):
        layer(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating point"):
        layer(torch.ones(3, 8, dtype=torch.long))


def test_bad_gate_settings_raise_value_errors_naming_the_value():
    with pytest.raises(ValueError, match="top_k=5 must be <= num_experts=4"):
        GateConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be >= 0.0, got -0.5"):
        GateConfig(num_experts=4, capacity_factor=-0.5)
    with pytest.raises(TypeError, match="top_k must be an int"):
        GateConfig(num_experts=4, top_k=1.5)
    with pytest.raises(ValueError, match="activation must be one of"):
        ExpertConfig(model_dim=4, hidden_dim=4, activation="tanh")
    with pytest.raises(ValueError, match="chunks must be >= 1, got 0"):
        ScheduleConfig(chunks=0)


@pytest.mark.parametrize(
    "part,match",
    [
        ({"schedule": ScheduleConfig(policy="fast")}, "unknown schedule policy 'fast'.*sequential"),
        (
            {"collective": CollectiveConfig(algorithm="mpi")},
            "unknown all-to-all algorithm 'mpi'.*naive",
        ),
    ],
    ids=["policy", "algorithm"],
)
def test_unknown_plugin_names_list_the_known_ones(part, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(
            MoEConfig(
                gate=GateConfig(num_experts=2),
                experts=ExpertConfig(model_dim=4, hidden_dim=4),
                **part,
            )
        )


def _indivisible(rank, world):
    with pytest.raises(
        ValueError, match="num_experts=3 must be divisible by the expert-parallel size 2"
    ):
        MoELayer(cfg(E=3, k=1))
    return True


def test_experts_that_do_not_divide_over_the_ranks_are_rejected(ranks):
    assert all(ranks(2).run(_indivisible))


def test_bf16_activations_and_autocast_run_with_an_fp32_router():
    torch.manual_seed(0)
    layer = MoELayer(cfg())
    x = torch.randn(10, 8)
    y32, _ = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, aux = layer(x)
    assert ya.dtype == torch.float32 and aux.dtype == torch.float32
    assert torch.allclose(ya, y32, atol=5e-2, rtol=5e-2)  # bf16 GEMMs: ~3 significant digits
    layer16 = MoELayer(cfg()).to(torch.bfloat16)
    layer16.load_state_dict(layer.state_dict())
    xb = x.to(torch.bfloat16).requires_grad_(True)
    yb, _ = layer16(xb)
    yb.float().sum().backward()
    assert yb.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert torch.allclose(yb.float(), y32, atol=5e-2, rtol=5e-2)


def test_a_user_expert_module_matches_the_builtin_ffn_with_the_same_weights():
    torch.manual_seed(0)
    c = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2),
        experts=ExpertConfig(model_dim=8, hidden_dim=16, activation="relu"),
    )
    builtin = MoELayer(c)

    def factory(e):
        m = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(builtin.experts.w1_EMH[e].t())
            m[2].weight.copy_(builtin.experts.w2_EHM[e].t())
        return m

    custom = MoELayer(c, expert_factory=factory)
    custom.gate_weight.data.copy_(builtin.gate_weight.data)
    assert all(getattr(p, "schemoe_expert", False) for p in custom.experts.parameters())
    x = torch.randn(20, 8)
    torch.testing.assert_close(custom(x)[0], builtin(x)[0], atol=1e-6, rtol=1e-5)


def test_the_balancing_bias_moves_load_away_from_an_overloaded_expert():
    torch.manual_seed(0)
    layer = MoELayer(cfg(E=4, k=1, f=0.0, bias_update_rate=0.05)).train()
    layer.gate_weight.data[0] += 2.0  # expert 0 gets most tokens
    x = torch.randn(200, 8).abs()
    loads = []
    for _ in range(20):
        layer.expert_load.zero_()
        layer(x)
        loads.append(layer.expert_load.clone())
        layer.update_expert_bias()
    assert loads[-1].max() < loads[0].max()
    assert layer.expert_bias[0] < 0


def test_an_empty_batch_returns_an_empty_output():
    y, aux = MoELayer(cfg())(torch.zeros(0, 8))
    assert y.shape == (0, 8) and aux.item() == 0.0


def _ddp(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("moe", MoELayer(cfg(E=4, k=2)))
    ddp = DDP(ddp_ignore_experts(model))
    x = torch.randn(12 + rank, 8, generator=torch.Generator().manual_seed(rank))
    y, aux = ddp(x)
    (y.sum() + aux).backward()
    expert_grads = [p.grad.clone() for p in expert_parameters(model)]
    gate_grad = model.moe.gate_weight.grad.clone()
    # the same step without DDP: dense grads would be this rank's own, experts identical
    return expert_grads, gate_grad


def test_ddp_all_reduces_the_router_but_not_the_experts(ranks):
    out = ranks(2).run(_ddp)
    (e0, g0), (e1, g1) = out
    assert torch.equal(g0, g1)  # dense grads averaged: equal on every rank
    assert not torch.equal(e0[0], e1[0])  # different experts, never averaged together


def _small(rank, world):
    c = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2), experts=ExpertConfig(model_dim=8, hidden_dim=16)
    )
    check_against_reference(c, [9, 14], seed=3)
    return True


def test_two_ranks_match_the_reference_with_a_small_config(ranks):
    assert all(ranks(2).run(_small))


def _experts_of(seed: int | None = None, manual: int = 0) -> torch.Tensor:
    torch.manual_seed(manual)
    cfg = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2), experts=ExpertConfig(model_dim=8, hidden_dim=16)
    )
    return MoELayer(cfg, seed=seed).experts.w1_EMH.detach().clone()


def test_layers_built_in_a_row_get_different_experts_and_the_global_seed_decides_them():
    torch.manual_seed(5)
    cfg = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2), experts=ExpertConfig(model_dim=8, hidden_dim=16)
    )
    a, b = MoELayer(cfg), MoELayer(cfg)
    assert not torch.equal(a.experts.w1_EMH, b.experts.w1_EMH)
    assert torch.equal(_experts_of(manual=3), _experts_of(manual=3))
    assert not torch.equal(_experts_of(manual=3), _experts_of(manual=4))
    assert torch.equal(_experts_of(seed=7, manual=3), _experts_of(seed=7, manual=4))


def _twice_layer():
    torch.manual_seed(0)
    cfg = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0),
        experts=ExpertConfig(model_dim=8, hidden_dim=16),
        schedule=ScheduleConfig(policy="schemoe", chunks=2),
    )
    return MoELayer(cfg, seed=1)


def test_backward_twice_with_retain_graph_accumulates_the_same_gradients_twice():
    layer = _twice_layer()
    x = torch.randn(12, 8, requires_grad=True)
    y, aux = layer(x)
    loss = (y**2).sum() + aux
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in layer.named_parameters()}
    gx = x.grad.clone()
    loss.backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n])
    torch.testing.assert_close(x.grad, 2 * gx)


def test_a_second_backward_without_retain_graph_and_double_backward_raise_clear_errors():
    layer = _twice_layer()
    x = torch.randn(12, 8, requires_grad=True)
    y, aux = layer(x)
    loss = y.sum() + aux
    loss.backward(retain_graph=True)  # the outer graph survives; the region ran once, kept
    loss.backward()  # second run frees the expert graphs
    with pytest.raises(RuntimeError, match="retain_graph=True|backward through the graph"):
        loss.backward()
    y, aux = layer(x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


# ---------------------------------------------------------------- values that fail deep in torch


def test_an_infinite_capacity_factor_is_refused_and_a_huge_one_is_capped_at_the_tokens():
    with pytest.raises(ValueError, match="capacity_factor must be finite"):
        GateConfig(num_experts=4, capacity_factor=float("inf"))
    torch.manual_seed(0)
    x = torch.randn(10, 8)
    huge, f1 = MoELayer(cfg(f=1e12)), MoELayer(cfg(f=2.0))  # f=2, k=2, E=4: C = T, no drop
    f1.load_state_dict(huge.state_dict())
    # 1e12 would have asked for 2.5e12 rows per expert; capped at T it drops nothing either
    torch.testing.assert_close(huge(x)[0], f1(x)[0])


def test_compressor_options_that_do_not_fit_name_the_compressor_and_its_options():
    with pytest.raises(TypeError, match=r"compression.options\['int8'\] must map option names"):
        CompressionConfig(forward="int8", options={"int8": 5})
    bad = MoEConfig(
        gate=GateConfig(num_experts=4),
        experts=ExpertConfig(model_dim=8, hidden_dim=16),
        compression=CompressionConfig(forward="fp16", options={"fp16": {"foo": 1}}),
    )
    with pytest.raises(ValueError, match=r"fp16\.foo=1: fp16 has no option 'foo'; it takes none"):
        MoELayer(bad)


def test_a_group_that_is_not_a_process_group_is_a_type_error():
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        MoELayer(cfg(), group="world")
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        MoELayer(cfg(), group=torch.distributed.group.WORLD or _FakeGroup())


class _FakeGroup(torch.distributed.ProcessGroup):
    def __init__(self):
        super().__init__(0, 1)


def test_a_layer_built_in_a_launched_job_before_init_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 ranks, but torch.distributed is not"):
        MoELayer(cfg())
    monkeypatch.setenv("WORLD_SIZE", "1")
    MoELayer(cfg())  # a one-rank launch is fine


def test_a_user_expert_with_the_wrong_output_shape_is_named_with_both_shapes():
    def factory(e):
        return nn.Linear(8, 4) if e == 2 else nn.Linear(8, 8)

    layer = MoELayer(cfg(f=0.0), expert_factory=factory)
    with pytest.raises(ValueError, match=r"expert 2 \(Linear\) must map \[n, M\] -> \[n, M\]"):
        layer(torch.randn(16, 8))


def _ddp_with_experts(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("moe", MoELayer(cfg(E=4, k=2)))
    try:
        DDP(model)(torch.randn(6, 8))
    except RuntimeError as e:
        return str(e)
    return None


def test_ddp_that_manages_the_sharded_experts_is_refused_at_the_first_forward(ranks):
    for msg in ranks(2).run(_ddp_with_experts):
        assert msg is not None and "DistributedDataParallel manages this MoE layer's" in msg
        assert "moe.experts." in msg and "ddp_ignore_experts" in msg


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_evaluation_builds_no_expert_graph(mode):
    layer = MoELayer(cfg())
    seen = []
    layer.experts.register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    x = torch.randn(12, 8, requires_grad=True)
    with getattr(torch, mode)():
        y, _ = layer(x)
    assert y.grad_fn is None and seen and not any(seen)  # experts ran with grad off
    seen.clear()
    layer(x)[0].sum().backward()  # training still builds it
    assert all(seen) and x.grad is not None
