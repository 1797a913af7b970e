"""MoELayer matches the single-process reference, forward and backward, on 1, 2 and 4 ranks."""

from __future__ import annotations

import itertools

import pytest

from moe_cases import check_against_reference
from schemoe import ExpertConfig, GateConfig, MoEConfig
from schemoe._dist import spawn

E, M, H = 8, 12, 20


def cfg(k, f, **gate):
    act = gate.pop("activation", "gelu")
    bias = gate.pop("bias", False)
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=k, capacity_factor=f, z_loss_weight=0.001, **gate),
        experts=ExpertConfig(model_dim=M, hidden_dim=H, activation=act, bias=bias),
    )


def _grid(rank, world):
    tokens = [13 + 7 * r for r in range(world)]  # uneven, nothing divides them
    n = 0
    for k, f in itertools.product((1, 2, 4), (0.0, 0.5, 1.0, 1.25)):
        check_against_reference(cfg(k, f), tokens, seed=100 + n)
        n += 1
    # activations, biases, score priority, no renormalisation
    check_against_reference(cfg(2, 1.0, activation="relu", bias=True), tokens, seed=1)
    check_against_reference(cfg(2, 0.5, activation="swiglu", priority="score"), tokens, seed=2)
    check_against_reference(cfg(1, 1.25, renormalize=False, priority="score"), tokens, seed=3)
    return n


def _edge_cases(rank, world):
    tokens = [11 + 5 * r for r in range(world)]
    # The experts of the last rank never get a token: that rank's tokens all go elsewhere and its
    # experts receive nothing (positive inputs, negative gate rows).
    dead = range(E - E // world, E) if world > 1 else (0,)
    for f in (0.0, 1.0):
        check_against_reference(cfg(2, f), tokens, seed=7, positive=True, dead_experts=dead)
    # A rank with no tokens at all takes part without hanging.
    empty = [0] + tokens[1:] if world > 1 else [0]
    for f in (0.0, 1.25):
        check_against_reference(cfg(2, f), empty, seed=8)
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer_matches_reference_for_every_k_and_capacity(world):
    assert spawn(_grid, world, timeout=240) == [12] * world


@pytest.mark.parametrize("world", [2, 4])
def test_layer_handles_empty_experts_idle_ranks_and_empty_batches(world):
    assert all(spawn(_edge_cases, world, timeout=180))


def test_layer_matches_reference_without_torch_distributed():
    check_against_reference(cfg(2, 1.0), [17], seed=5)
    check_against_reference(cfg(2, 0.0), [0], seed=6)
