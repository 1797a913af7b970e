"""The simulator prices stack schedules: AT tasks cost the blocks' attention (FLOP-based, from
the hardware preset), the regions their layer's task costs at T / m tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemoe.costmodel.hardware import Link, preset
from schemoe.costmodel.model import CostModel
from schemoe.costmodel.stack import predict_stack
from schemoe.costmodel.step import StepShape, block_forward
from schemoe.scheduling import Direction, TaskGraph, make_schedule, simulator

SHAPE = StepShape(batch=8, seq_len=64, model_dim=128, hidden=256, layers=4)


def test_one_micro_chunk_in_sequence_costs_each_blocks_attention_then_its_region():
    hw = preset("local")
    got = predict_stack(hw, SHAPE, "schemoe", "naive", 2, micro=1, stack_policy="sequential")
    cm = CostModel(hw, SHAPE.layer(), "naive", compute_scale=hw.compute_factor)
    region = TaskGraph(2, cm.links, Direction.FORWARD)
    span = simulator.run(make_schedule("schemoe", region, cm), region, cm, record=False)[0]
    # Two stages: (dense block, MoE block's attention) then the same; no overlap at m = 1.
    at = block_forward(hw, SHAPE, False) + block_forward(hw, SHAPE, True) + cm.outside() / 2
    assert got.forward_s == pytest.approx(2 * (at + span + cm.outside() / 2))
    assert {e.task for e in got.events} >= {"AT", "b1.m0.AT", "b1.m0.PO"}


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
