"""The stack executor really overlaps at stack level: with an artificially slow link, micro-chunk
j's attention runs while micro-chunk i's all-to-all is pending, forward and backward."""

from __future__ import annotations

import pytest
import torch
from test_executor import SlowLink
from test_stack import Attn

from schemoe import (
    CollectiveConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    MoELayer,
    ScheduleConfig,
    trace,
)
from schemoe.collectives import ALGORITHMS
from schemoe.step.stack import Stage, run_stack

M = 12


@pytest.fixture(autouse=True)
def slow_link(plugin):
    plugin(ALGORITHMS, "test_slow_link", SlowLink)


def _events(policy: str):
    torch.manual_seed(0)
    c = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0),
        experts=ExpertConfig(model_dim=M, hidden_dim=16),
        schedule=ScheduleConfig(policy="schemoe", chunks=1),
        collective=CollectiveConfig(algorithm="test_slow_link"),
    )
    stages = [Stage(Attn(), MoELayer(c, seed=b)) for b in range(2)]
    x = torch.randn(4, 5, M, requires_grad=True)
    with trace.record() as tl:
        out, aux = run_stack(stages, x, 2, policy)
        (out.sum() + aux).backward()
    return {(e.direction, e.task): e for e in tl.events}


def _during(ev, direction, compute, transfer) -> bool:
    c, a = ev[(direction, compute)], ev[(direction, transfer)]
    return a.start < c.start < a.end


def test_attention_of_one_micro_chunk_runs_while_anothers_all_to_all_is_pending():
    # One thread and a warm-up call, as in test_executor (OpenMP stalls; autograd's first call).
    torch.set_num_threads(1)
    _events("wavefront")
    ev = _events("wavefront")
    # Forward: micro-chunk 1's attention (AT) while micro-chunk 0's dispatch is on the wire, in
    # both blocks.
    assert _during(ev, "forward", "b0.m1.AT", "A1.0")
    assert _during(ev, "forward", "b1.m1.AT", "b1.m0.A1.0")
    # Backward: micro-chunk 0's attention backward while micro-chunk 1's gradient all-to-all
    # back to the tokens' ranks (phase 2 of the backward chain) is pending.
    assert _during(ev, "backward", "b1.m0.AT", "b1.m1.A2.0")
    assert _during(ev, "backward", "AT", "b0.m1.A2.0")


def test_the_sequential_stack_does_not_overlap_attention_with_another_micro_chunk():
    torch.set_num_threads(1)
    ev = _events("sequential")
    assert not _during(ev, "forward", "b0.m1.AT", "A1.0")
    assert not _during(ev, "backward", "AT", "b0.m1.A2.0")
