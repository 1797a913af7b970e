"""The simulator prices stack schedules: AT tasks cost the blocks' attention (FLOP-based, from
the hardware preset), the regions their layer's task costs at T / m tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemoe.costmodel.hardware import Link, preset
from schemoe.costmodel.model import CostModel
from schemoe.costmodel.stack import (
    _pieces,
    choose_micro,
    early_groups,
    predict_stack,
    predict_stack_step,
    stage_gradient_bytes,
)
from schemoe.costmodel.step import (
    StepShape,
    _buckets,
    allreduce_time,
    block_forward,
    gradient_bytes,
    predict_step,
)
from schemoe.scheduling import Direction, TaskGraph, make_schedule, simulator

SHAPE = StepShape(batch=8, seq_len=64, model_dim=128, hidden=256, layers=4)


def test_one_micro_chunk_in_sequence_costs_each_blocks_attention_then_its_region():
    hw = preset("local")
    got = predict_stack(hw, SHAPE, "schemoe", "naive", 2, micro=1, stack_policy="sequential")
    cm = CostModel(hw, SHAPE.layer(), "naive", compute_scale=hw.compute_factor)
    region = TaskGraph(2, cm.links, Direction.FORWARD)
    span = simulator.run(make_schedule("schemoe", region, cm), region, cm, record=False)[0]
    # Two stages: (dense block, MoE block's attention) then the same; no overlap at m = 1.
    # The layer's outside cost is a whole call's (forward and backward): a quarter in each of
    # AT and PO, forward and backward.
    at = block_forward(hw, SHAPE, False) + block_forward(hw, SHAPE, True) + cm.outside() / 4
    assert got.forward_s == pytest.approx(2 * (at + span + cm.outside() / 4))
    assert {e.task for e in got.events} >= {"AT", "b1.m0.AT", "b1.m0.PO"}


@pytest.mark.parametrize("policy, chunks", [("sequential", 1), ("schemoe", 4)])
@pytest.mark.parametrize("grad_sync", ["ddp", "scheduled"])
def test_with_free_links_one_micro_chunk_prices_what_the_plain_step_prices(
    policy, chunks, grad_sync
):
    # Both models of one step: the stack of one micro-chunk and step.predict_step. With the
    # network free their difference is only the executor's per-task cost of posting the
    # gradient all-reduces; the layer's outside cost (router, layout, fixed cost per call) is
    # charged once per layer by both (the stack once charged it 2.5 times: 1.17x here).
    free = Link(alpha=0.0, beta=1e15)
    hw = replace(preset("local"), intra=free, inter=free)
    opts = {"grad_sync": grad_sync, "grad_compress": "bf16"}
    plain = predict_step(hw, SHAPE, policy, "naive", chunks, **opts)
    stack = predict_stack_step(hw, SHAPE, policy, "naive", chunks, micro=1, **opts)
    assert stack.step_s == pytest.approx(plain.step_s, rel=0.005)


def test_wavefront_hides_a_slow_links_all_to_alls_behind_other_micro_chunks_attention():
    hw = preset("local")
    slow = Link(alpha=1e-5, beta=2e7)  # bandwidth-bound: cutting the batch costs no latency
    hw = replace(hw, intra=slow, inter=slow)
    one = predict_stack(hw, SHAPE, "schemoe", "naive", 1, micro=1)
    seq = predict_stack(hw, SHAPE, "schemoe", "naive", 1, micro=4, stack_policy="sequential")
    wave = predict_stack(hw, SHAPE, "schemoe", "naive", 1, micro=4)
    assert wave.step_s < 0.9 * one.step_s
    assert wave.step_s < 0.9 * seq.step_s


def test_a_micro_chunk_count_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ValueError, match="micro must be >= 1 and divide batch 8, got 3"):
        predict_stack(preset("local"), SHAPE, micro=3)


def test_gradient_buckets_join_the_backward_stack_on_the_link():
    hw = preset("local")
    plain = predict_stack(hw, SHAPE, "schemoe", "naive", 2, micro=2)
    synced = predict_stack(hw, SHAPE, "schemoe", "naive", 2, micro=2, grad_sync=True)
    assert {"AR.0", "AR.1"} <= {e.task for e in synced.events if e.resource == "net"}
    assert synced.forward_s == plain.forward_s and synced.backward_s > plain.backward_s


def test_a_scheduled_sync_prices_the_stages_gradients_in_the_stack_and_the_rest_after_it():
    """The scheduled sync gets each block's gradients while the stack's backward runs
    (GradSync.ready); DDP's buckets all wait for its end."""
    hw = preset("local")
    stages = stage_gradient_bytes(SHAPE)
    total, rest = gradient_bytes(SHAPE), gradient_bytes(SHAPE) - sum(stages)
    assert len(stages) == 2 and min(stages) > 0 and rest > 0  # embedding, positions, final norm
    cap = min(stages)  # every stage its own early transfer
    kw = {"micro": 2, "bucket_bytes": cap}
    ddp = predict_stack_step(hw, SHAPE, "schemoe", "naive", 2, grad_sync="ddp", **kw)
    sched = predict_stack_step(hw, SHAPE, "schemoe", "naive", 2, grad_sync="scheduled", **kw)
    plain = predict_stack(hw, SHAPE, "schemoe", "naive", 2, micro=2)
    inside = predict_stack(hw, SHAPE, "schemoe", "naive", 2, micro=2, grad_sync=True)

    def after(nbytes: float) -> float:  # DDP-style buckets of `cap` after the stack
        return sum(allreduce_time(hw, n) for _, n in _buckets([nbytes], cap))

    # The same head and optimizer around: DDP = stack + every byte after; scheduled = the stack
    # with its stages' transfers inside + only the rest after.
    head = ddp.backward_s - plain.backward_s - after(total)
    assert sched.backward_s == pytest.approx(head + inside.backward_s + after(rest))
    assert [e.task for e in inside.events if e.task.startswith("AR")] == ["AR.0", "AR.1"]


def test_early_groups_gather_stages_last_first_until_a_bucket_is_full():
    assert early_groups([3.0, 1.0, 2.0], 2.5) == ([(1, 3.0), (0, 3.0)], 0.0)
    assert early_groups([3.0, 1.0, 2.0], 10.0) == ([], 6.0)  # all left for after the stack
    assert early_groups([3.0, 1.0, 2.0], 0.0) == ([(2, 2.0), (1, 1.0), (0, 3.0)], 0.0)


def test_choose_micro_picks_the_fastest_predicted_micro_chunk_count():
    slow = Link(alpha=1e-5, beta=2e7)
    bandwidth_bound = replace(preset("local"), intra=slow, inter=slow)
    m, preds = choose_micro(bandwidth_bound, SHAPE, "schemoe", "naive", 1)
    assert set(preds) == {1, 2, 4, 8} and m > 1
    assert preds[m].step_s == min(p.step_s for p in preds.values())
    # latency-bound (the local preset's 1.6 ms per all-to-all): cutting the batch does not pay
    assert choose_micro(preset("local"), SHAPE, "schemoe", "naive", 2)[0] == 1


def test_a_stages_gradients_go_as_bucket_sized_pieces_the_first_ready_early_in_its_at_backward():
    assert _pieces([(1, 4.0), (0, 1.0)], 2.0) == [(1, 2.0, 0.5), (1, 2.0, 0.0), (0, 1.0, 0.0)]
    assert _pieces([(1, 4.0)], 0.0) == [(1, 4.0, 0.0)]  # no bucket size: the stage at once
    # The network time is the transfers' own, not their spans stretched by sharing the link.
    hw, shape = preset("local"), SHAPE
    kw = {"micro": 2, "grad_ratio": 1.0}
    bare = predict_stack(hw, shape, "schemoe", "naive", 1, **kw)
    synced = predict_stack(hw, shape, "schemoe", "naive", 1, grad_sync=True, **kw)
    buckets = sum(allreduce_time(hw, n) for n in stage_gradient_bytes(shape))
    assert synced.network_s - bare.network_s == pytest.approx(buckets)
