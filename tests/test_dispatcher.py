"""The token dispatcher: splits from the config when every rank routes the same T, else one
counts exchange; the same metadata either way."""

from __future__ import annotations

import torch
import torch.distributed as dist

from schemoe import ExpertConfig, MoEConfig, MoELayer, ParallelConfig
from schemoe.config import GateConfig
from schemoe.dist.topology import Topology
from schemoe.layer.dispatcher import TokenDispatcher
from schemoe.routing import route

E, M = 4, 8


def _dispatch(dispatcher, gate, x):
    w = torch.randn(E, M, generator=torch.Generator().manual_seed(0))
    routing = route(x, w, gate)
    return dispatcher.dispatch(x, routing, dropless=gate.dropless)


def _uniform(rank, world):
    topo = Topology.from_group(None, world)
    gate = GateConfig(num_experts=E, top_k=2, capacity_factor=1.0)
    x = torch.randn(12, M, generator=torch.Generator().manual_seed(rank))
    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        rows_u, meta_u = _dispatch(TokenDispatcher(topo, E, 2, uniform_tokens=True), gate, x)
        uniform_calls = len(calls)
        rows_x, meta_x = _dispatch(TokenDispatcher(topo, E, 2), gate, x)
        exchange_calls = len(calls) - uniform_calls
    finally:
        dist.all_to_all_single = real
    assert uniform_calls == 0 and exchange_calls == 1
    assert torch.equal(rows_u, rows_x)
    assert meta_u.recv_counts == meta_x.recv_counts == ((6, 6), (6, 6))
    for a, b in zip(meta_u.plan, meta_x.plan):
        assert (a.send_splits, a.recv_splits, a.expert_counts) == (
            b.send_splits,
            b.recv_splits,
            b.expert_counts,
        )
    return True


def test_uniform_tokens_in_capacity_mode_exchange_no_counts_and_plan_the_same(ranks):
    assert all(ranks(2).run(_uniform))


def _dropless(rank, world):
    topo = Topology.from_group(None, world)
    gate = GateConfig(num_experts=E, top_k=2, capacity_factor=0.0)
    x = torch.randn(10 + rank, M, generator=torch.Generator().manual_seed(rank))
    # uniform_tokens is a capacity-mode promise: dropless still exchanges the varying counts.
    rows, meta = _dispatch(TokenDispatcher(topo, E, 1, uniform_tokens=True), gate, x)
    every = [None] * world
    dist.all_gather_object(every, meta.counts)
    El = E // world
    want = tuple(tuple(every[s][rank * El : (rank + 1) * El]) for s in range(world))
    assert meta.recv_counts == want and rows.shape == (sum(meta.counts), M)
    return True


def test_dropless_receivers_learn_the_counts_from_every_rank(ranks):
    assert all(ranks(2).run(_dropless))


def test_combine_restores_token_order_from_the_metadata_alone():
    topo = Topology(world=1, rank=0, ranks_per_node=1)
    gate = GateConfig(num_experts=E, top_k=1, capacity_factor=0.0, renormalize=True)
    x = torch.randn(6, M, dtype=torch.float64)
    d = TokenDispatcher(topo, E, 3)
    rows, meta = _dispatch(d, gate, x.float())
    y = d.combine(rows, meta)  # experts = identity, k = 1 renormalised: y == x
    assert y.dtype == torch.float32 and torch.allclose(y, x.float())


# ------------------------------------------------------------------ host syncs
_READBACKS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


class _Readbacks:
    """Counts, inside the block, the Tensor methods that copy a value to the host (a host sync
    on a GPU); on the CPU the same calls mark where a GPU run would wait."""

    def __enter__(self):
        self.calls, self.real = [], {n: getattr(torch.Tensor, n) for n in _READBACKS}
        for name, fn in self.real.items():
            setattr(torch.Tensor, name, self._counting(name, fn))
        return self

    def _counting(self, name, fn):
        def wrapper(t, *args, **kwargs):
            self.calls.append(name)
            return fn(t, *args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(torch.Tensor, name, fn)


def _layer_readbacks(rank, world, f, uniform):
    cfg = MoEConfig(
        gate=GateConfig(num_experts=E, top_k=2, capacity_factor=f),
        experts=ExpertConfig(model_dim=M, hidden_dim=16, impl="grouped"),
        parallel=ParallelConfig(uniform_tokens=uniform),
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    x = torch.randn(12, M, requires_grad=True)
    layer(x)  # warm: the one-time probes and caches are not per-call syncs
    with _Readbacks() as r:
        y, aux = layer(x)
        (y.sum() + aux).backward()
    return r.calls


def test_a_capacity_mode_call_with_uniform_tokens_reads_nothing_back_forward_or_backward(ranks):
    assert ranks(2).run(_layer_readbacks, 1.25, True) == [[], []]


def test_a_dropless_call_reads_back_only_the_split_sizes(ranks):
    # One read of split sizes: the received counts after the exchange, together with this
    # rank's own (the router keeps those on the device). Nothing else, nothing in backward.
    assert ranks(2).run(_layer_readbacks, 0.0, False) == [["tolist"]] * 2


def test_a_dropless_call_on_one_process_reads_back_only_its_counts():
    assert _layer_readbacks(0, 1, 0.0, False) == ["tolist"]
