"""Token deduplication per destination rank (ParallelConfig.dedup, schemoe/routing/dedup.py):
against the single-process reference on 1, 2 and 4 ranks under every policy, algorithm and chunk
count, forward and backward; the experts' gradients bitwise the plain layer's, the rest within
rounding (sums in another order); every transfer carries one row per token and rank reached;
the stack, activation checkpointing and torch.compile run it; misuse refused naming the value."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from moe_cases import check_against_reference, close, global_weights, inputs, run_layer
from schemoe import MoELayer, SharedExpertConfig, checkpoint_block, is_expert_param
from schemoe import config as c
from schemoe.costmodel.hardware import Hardware, Link
from schemoe.costmodel.model import CostModel, LayerShape
from schemoe.scheduling import TaskGraph
from schemoe.step.stack import Stage, run_stack

M, H = 12, 20


def dedup_config(
    policy="schemoe", r=2, E=8, k=2, algorithm="naive", compression="none", rpn=None, **extra
) -> c.MoEConfig:
    return c.MoEConfig(
        gate=c.GateConfig(num_experts=E, top_k=k, capacity_factor=0.0),
        experts=c.ExpertConfig(model_dim=M, hidden_dim=H),
        parallel=c.ParallelConfig(dedup=True, ranks_per_node=rpn),
        schedule=c.ScheduleConfig(policy=policy, chunks=r),
        collective=c.CollectiveConfig(algorithm=algorithm),
        compression=c.CompressionConfig(forward=compression, backward=compression),
        **extra,
    )


def without_dedup(cfg: c.MoEConfig) -> c.MoEConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dedup=False))


# (policy, r, E, k): every fixed-order policy, the peers partition, r up to 4, k up to 6.
CASES = [
    ("sequential", 1, 8, 2),
    ("schemoe", 2, 8, 2),
    ("tutel", 3, 16, 6),
    ("schemoe", 4, 16, 6),
    ("fastermoe", 2, 16, 6),
    ("sequential", 1, 16, 6),
]


def _against_reference_and_plain(rank, world, cases, algorithm="naive", rpn=None, shared=False):
    tokens = [23 + 7 * q for q in range(world)]  # T differs between ranks
    for policy, r, E, k in cases:
        r = min(r, world) if policy == "fastermoe" else r  # peer groups: r <= P
        extra = {"shared": SharedExpertConfig(num=1, hidden_dim=7)} if shared else {}
        cfg = dedup_config(policy, r, E, k, algorithm, rpn=rpn, **extra)
        got = check_against_reference(cfg, tokens, seed=r + k)
        plain = check_against_reference(without_dedup(cfg), tokens, seed=r + k)
        what = f"{policy} r={r} E={E} k={k} {algorithm}"
        # The experts see the same rows in the same order, and the same output gradients (w g,
        # one product either way): their weight gradients are bitwise the plain layer's. The
        # output, the input gradient and the router's sum a token's choices per rank first:
        # equal within rounding (and checked against the reference above).
        experts = {n for n, p in MoELayer(cfg).named_parameters() if is_expert_param(p)}
        assert experts
        for n in plain["grads"]:
            if n in experts:
                assert torch.equal(got["grads"][n], plain["grads"][n]), (what, n)
            close(got["grads"][n], plain["grads"][n], f"grad {n} {what}")
        close(got["y"], plain["y"], f"output {what}")
        close(got["gx"], plain["gx"], f"input grad {what}")
    return True


def test_dedup_on_one_process_matches_the_reference_and_the_plain_layer():
    assert _against_reference_and_plain(0, 1, CASES)


@pytest.mark.parametrize("world", [2, 4])
def test_dedup_matches_the_reference_and_the_plain_layer_on_every_policy(ranks, world):
    assert all(ranks(world).run(_against_reference_and_plain, CASES))


@pytest.mark.parametrize("algorithm", ["pairwise", "pipe", "hier2d", "leader"])
def test_dedup_under_every_all_to_all_algorithm_on_2x2(ranks, algorithm):
    cases = [("schemoe", 2, 16, 6), ("fastermoe", 2, 8, 2)]
    assert all(ranks(4).run(_against_reference_and_plain, cases, algorithm, 2))


def test_dedup_with_shared_experts_on_two_ranks(ranks):
    cases = [("schemoe", 2, 16, 6), ("sequential", 1, 8, 2)]
    assert all(ranks(2).run(_against_reference_and_plain, cases, "naive", None, True))


def _empty_rank(rank, world):
    # A rank with no tokens sends and receives nothing of its own, and still takes part.
    check_against_reference(dedup_config("schemoe", 2, 16, 6), [0, 13], seed=5)
    check_against_reference(dedup_config("fastermoe", 2, 8, 2), [11, 0], seed=6)
    return True


def test_dedup_with_a_rank_that_routes_no_tokens(ranks):
    assert all(ranks(2).run(_empty_rank))


def _compressed(rank, world):
    # fp16 on the wire rounds the payloads: reference-close within fp16 rounding.
    cfg = dedup_config("schemoe", 2, 16, 6, compression="fp16")
    check_against_reference(cfg, [31, 17], seed=3, atol=5e-3, rtol=5e-3)
    return True


def test_dedup_with_a_compressor_on_two_ranks(ranks):
    assert all(ranks(2).run(_compressed))


def _traffic(rank, world, E, k, r, policy):
    """The rows each transfer carries: dispatch one per (token, rank reached) and chunk."""
    cfg = dedup_config(policy, r, E, k)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    layer.load_global_state(global_weights(layer, seed=2))
    xs, gys = inputs(world, [40] * world, M, seed=2)
    sent = []
    real = layer.algorithm.start

    def start(x, send, recv, **kw):
        sent.append(sum(send))
        return real(x, send, recv, **kw)

    layer.algorithm.start = start
    rows, meta, _ = layer.dispatch(xs[rank])
    El = E // world
    dest_TK = meta.routing.expert_TK // El
    reached = sum(len(set(row)) for row in dest_TK.tolist())  # distinct ranks per token
    units = sum(sum(ch.unique.send_splits) for ch in meta.plan)
    if r == 1:  # one chunk: exactly one row per (token, rank reached)
        assert rows.shape[0] == units == reached, (rows.shape, units, reached)
    else:  # a token may reach a rank in two chunks (different experts' parts): at most r times
        assert reached <= units == rows.shape[0] <= r * reached
    assert units < meta.routing.rows  # fewer rows than T k
    run_layer(layer, xs[rank], gys[rank])
    # Every transfer carries unique rows: dispatch this rank's, combine (each the receiver's
    # weighted sum of its experts' outputs) those it received; backward the same two ways.
    out_rows = sum(sum(ch.unique.send_splits) for ch in meta.plan)
    back_rows = sum(sum(ch.unique.recv_splits) for ch in meta.plan)
    assert sum(sent) == 2 * (out_rows + back_rows) and len(sent) == 4 * len(meta.plan)
    return units, meta.routing.rows


@pytest.mark.parametrize(
    "E,k,r,policy", [(16, 6, 1, "sequential"), (16, 6, 2, "schemoe"), (8, 2, 2, "fastermoe")]
)
def test_the_dispatch_transfer_carries_one_row_per_token_and_rank_reached(ranks, E, k, r, policy):
    for units, expanded in ranks(2).run(_traffic, E, k, r, policy):
        assert units < expanded


class _Split(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x), x


def _stack_and_checkpoint(rank, world):
    """The stack runtime (micro-chunks) and a checkpointed block run dedup; the results are the
    plain layer's (output bitwise, input gradient within rounding)."""
    out = {}
    for dedup in (True, False):
        cfg = dedup_config("schemoe", 2, 16, 6)
        cfg = cfg if dedup else without_dedup(cfg)
        torch.manual_seed(0)
        moe = MoELayer(cfg)
        moe.load_global_state(global_weights(moe, seed=5))
        x = torch.randn(4, 5, M, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        y, aux = run_stack([Stage(_Split(), moe)], x, 2, "wavefront")
        (y.square().sum() + aux).backward()
        gx, x.grad = x.grad.clone(), None
        z, aux2 = checkpoint_block(moe, x)
        (z.square().sum() + aux2).backward()
        out[dedup] = (y.detach(), gx, z.detach(), x.grad.clone())
    a, b = out[True], out[False]
    close(a[0], b[0], "stack output")
    close(a[2], b[2], "checkpointed output")
    close(a[1], b[1], "stack input grad")
    close(a[3], b[3], "checkpointed input grad")
    return True


def test_the_stack_runtime_and_activation_checkpointing_run_dedup(ranks):
    assert all(ranks(2).run(_stack_and_checkpoint))


def test_a_compiled_dedup_layer_matches_eager():
    torch.manual_seed(0)
    layer = MoELayer(dedup_config("schemoe", 2, 16, 6))
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(3, 7, M)
    got = []
    for fn in (layer, compiled):
        xx = x.clone().requires_grad_()
        y, aux = fn(xx)
        (y.square().sum() + aux).backward()
        got.append((y.detach(), xx.grad))
    close(got[0][0], got[1][0], "compiled output")
    close(got[0][1], got[1][1], "compiled input grad")


@pytest.mark.parametrize(
    "gate,message",
    [
        ({"capacity_factor": 1.25}, "capacity_factor=1.25"),
        ({"capacity_factor": 0.0, "weights_on": "input"}, "weights_on='input'"),
    ],
)
def test_dedup_is_refused_where_a_token_copies_would_differ_naming_the_value(gate, message):
    with pytest.raises(ValueError, match=message):
        c.MoEConfig(
            gate=c.GateConfig(num_experts=8, **gate),
            experts=c.ExpertConfig(model_dim=M, hidden_dim=H),
            parallel=c.ParallelConfig(dedup=True),
        )
    with pytest.raises(TypeError, match="dedup must be a bool"):
        c.ParallelConfig(dedup="yes")


def test_the_counts_read_is_the_one_host_sync_of_a_dedup_call(monkeypatch):
    """One .tolist() per call on the dispatch path (the counts), as without dedup."""
    torch.manual_seed(0)
    layer = MoELayer(dedup_config("schemoe", 2, 16, 6))
    reads = [0]
    real = torch.Tensor.tolist

    def counted(self):
        reads[0] += 1
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    y, aux = layer(torch.randn(9, M))
    (y.sum() + aux).backward()
    assert reads[0] == 1
    assert not dist.is_initialized()


def test_the_cost_model_prices_dedup_transfers_at_the_rows_they_carry():
    """LayerShape.reach: a token's ranks reached over k under uniform routing; the all-to-all
    tasks of a dedup layer cost that fraction of the plain layer's bytes."""
    E, k, P = 64, 6, 4
    shape = LayerShape(4096, 1024, 512, E, k, 0.0, dedup=True)
    want = P * (1 - math.comb(E - E // P, k) / math.comb(E, k)) / k
    assert shape.reach(P) == pytest.approx(want) and 0.5 < want < 0.7
    assert shape.reach(1) == pytest.approx(1 / k)  # one rank: a token once, not k times
    assert dataclasses.replace(shape, dedup=False).reach(P) == 1.0
    hw = Hardware(name="t", nodes=2, ranks_per_node=2, intra=Link(0.0, 1e9),
                  inter=Link(0.0, 1e8), flops=1e10, gemm_alpha=1e-5, memory=1e9,
                  task_overhead=1e-5)  # fmt: skip
    graph = TaskGraph(2)
    plain = CostModel(hw, dataclasses.replace(shape, dedup=False)).task_costs(graph).durations
    dedup = CostModel(hw, shape).task_costs(graph).durations
    for t, v in plain.items():
        if t.is_comm:  # no latency term here: exactly the bytes' ratio
            assert dedup[t] == pytest.approx(want * v), t
        elif t.kind == "E":
            assert dedup[t] == v, t  # the experts compute every copy
    cfg = dedup_config("schemoe", 2, 16, 6)
    assert LayerShape.of(cfg, 100).dedup and not LayerShape.of(without_dedup(cfg), 100).dedup
