"""torch.compile of a model with schemoe layers, one process: graph breaks per layer (capacity
<= 2, dropless <= 3, counted by torch._dynamo.explain and printed), compiled against eager
forward and backward, and no recompilation when a dropless layer's counts change.

Correctness runs the "aot_eager" backend (dynamo + AOT autograd, eager kernels): the graphs and
the break points are the ones inductor gets, and the results are bitwise equal to eager, so the
check is torch.equal. One inductor case (the default backend) checks within fp32 tolerance; it is
skipped with the reason where inductor cannot build kernels here (no C++ compiler).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig
from schemoe.config import SharedExpertConfig

M, H = 16, 32
OPAQUE = "expert_parallel"  # the one function a layer call runs outside the graph (opaque.py)


def _config(f: float, shared: bool = False) -> MoEConfig:
    """The README's layer (E=8, k=2, policy schemoe, r=2) at a small width."""
    return MoEConfig(
        gate=GateConfig(num_experts=8, top_k=2, capacity_factor=f),
        experts=ExpertConfig(model_dim=M, hidden_dim=H),
        schedule=ScheduleConfig(policy="schemoe", chunks=2),
        shared=SharedExpertConfig(hidden_dim=H) if shared else None,
    )


class _Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(M), MoELayer(cfg)

    def forward(self, x):
        y, aux = self.moe(self.norm(x))
        return x + y, aux


class _Model(nn.Module):
    """Two pre-norm residual MoE blocks and a linear head; returns the loss."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(2))
        self.head = nn.Linear(M, 4)

    def forward(self, x):
        total = 0
        for block in self.blocks:
            x, aux = block(x)
            total = total + aux
        return self.head(x).square().mean() + total


def _breaks(f: float) -> tuple[int, list[str]]:
    torch.manual_seed(0)
    layer = MoELayer(_config(f))
    torch._dynamo.reset()
    ex = torch._dynamo.explain(layer)(torch.randn(4, 8, M))
    reasons = [r.reason for r in ex.break_reasons]
    return ex.graph_break_count, reasons


@pytest.mark.parametrize(("mode", "f", "most"), [("capacity", 1.25, 2), ("dropless", 0.0, 3)])
def test_a_layer_call_has_at_most_its_budget_of_graph_breaks(mode, f, most):
    count, reasons = _breaks(f)
    print(f"\n{mode}: {count} graph break(s) per layer")
    for reason in reasons:
        print("  -", reason.splitlines()[0], "|", reason.splitlines()[1].strip())
    assert count <= most
    # Only the deliberate one: the region runs eagerly (schemoe/layer/opaque.py).
    assert all(OPAQUE in r for r in reasons), reasons


def _step(model: nn.Module, x: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    loss = model(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), x.grad, grads


def _compare(f: float, shared: bool, backend: str, exact: bool, shapes=(8,)) -> None:
    torch.manual_seed(0)
    eager = _Model(_config(f, shared))
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    same = torch.equal if exact else functools.partial(torch.allclose, rtol=1e-5, atol=1e-6)
    for tokens in shapes:  # a second shape: the recompiled (dynamic-shape) graph too
        x = torch.randn(2, tokens, M, generator=torch.Generator().manual_seed(tokens))
        (l1, gx1, g1), (l2, gx2, g2) = _step(eager, x), _step(compiled, x)
        assert same(l1, l2) and same(gx1, gx2)
        assert len(g1) == len(g2) and all(same(a, b) for a, b in zip(g1, g2))
        assert all(g.abs().sum() > 0 for g in g1)  # every weight, experts included, got a grad


@pytest.mark.parametrize(
    ("f", "shared"), [(1.25, False), (0.0, False)], ids=["capacity", "dropless"]
)
def test_a_compiled_model_matches_eager_bitwise_forward_and_backward(f, shared):
    # Capacity mode: a second token count too (C depends on T: the dynamic-shape graph).
    _compare(f, shared, "aot_eager", exact=True, shapes=(8, 9) if f > 0 else (8,))


def test_a_compiled_model_with_shared_experts_matches_eager_within_fp32_tolerance():
    # x's gradient sums the shared experts', the encode's and the router's contributions; AOT
    # autograd adds them in another order than eager autograd does (last-bit differences).
    _compare(1.25, True, "aot_eager", exact=False)


def test_a_dropless_layer_does_not_recompile_when_its_counts_change():
    torch.manual_seed(0)
    layer = MoELayer(_config(0.0))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    compiled(torch.randn(16, M))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):  # same shape, other tokens: other expert counts
            x = torch.randn(16, M, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(x)[0], layer(x)[0], rtol=0, atol=0)


@functools.cache
def _inductor_missing() -> str | None:
    """Why inductor cannot run here (None: it can): it builds C++ kernels on the CPU."""
    try:
        torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(4))
    except Exception as e:  # noqa: BLE001 - any failure to build means: skip, with the reason
        return f"torch.compile(backend='inductor') cannot run on this machine: {e!r:.200}"
    return None


def test_an_inductor_compiled_model_matches_eager_within_fp32_tolerance():
    reason = _inductor_missing()
    if reason is not None:
        pytest.skip(reason)
    _compare(1.25, False, "inductor", exact=False)


def test_fullgraph_compile_is_refused_naming_the_eager_region_and_its_module():
    # fullgraph=True asks for no break at all; the region is the one break a layer keeps, and the
    # error must say so (the reason opaque.py gives torch.compiler.disable), not a trace error.
    torch.manual_seed(0)
    model = torch.compile(MoELayer(_config(1.25)), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"schemoe/layer/opaque\.py") as e:
        model(torch.randn(4, 8, M))
    assert "runs eagerly" in str(e.value)
