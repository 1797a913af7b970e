"""MoELayer matches the single-process reference, forward and backward, on 1, 2 and 4 ranks."""

from __future__ import annotations

import pytest

from moe_cases import check_against_reference
from schemoe import ExpertConfig, GateConfig, MoEConfig

E, M, H = 8, 12, 20


def cfg(k, f, **gate):
    act = gate.pop("activation", "gelu")
    bias = gate.pop("bias", False)
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=k, capacity_factor=f, z_loss_weight=0.001, **gate),
        experts=ExpertConfig(model_dim=M, hidden_dim=H, activation=act, bias=bias),
    )


GRID = [(k, f) for k in (1, 2, 4) for f in (0.0, 0.5, 1.0, 1.25)]
# activations, biases, score priority, no renormalisation
VARIANTS = [
    (2, 1.0, {"activation": "relu", "bias": True}),
    (2, 0.5, {"activation": "swiglu", "priority": "score"}),
    (1, 1.25, {"renormalize": False, "priority": "score"}),
]


def _one(rank, world, k, f, gate, seed):
    tokens = [13 + 7 * q for q in range(world)]  # uneven, nothing divides them
    check_against_reference(cfg(k, f, **gate), tokens, seed=seed)
    return True


@pytest.mark.parametrize("n", range(len(GRID)), ids=lambda n: "k{}-f{}".format(*GRID[n]))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer_matches_reference_for_every_k_and_capacity(ranks, world, n):
    k, f = GRID[n]
    assert all(ranks(world).run(_one, k, f, {}, 100 + n))


@pytest.mark.parametrize("n", range(len(VARIANTS)))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer_matches_reference_for_activations_biases_and_priorities(ranks, world, n):
    k, f, gate = VARIANTS[n]
    assert all(ranks(world).run(_one, k, f, gate, 1 + n))


def _dead_experts(rank, world, f):
    # The experts of the last rank never get a token: that rank's tokens all go elsewhere and its
    # experts receive nothing (positive inputs, negative gate rows).
    tokens = [11 + 5 * q for q in range(world)]
    dead = range(E - E // world, E) if world > 1 else (0,)
    check_against_reference(cfg(2, f), tokens, seed=7, positive=True, dead_experts=dead)
    return True


def _idle_rank(rank, world, f):
    # A rank with no tokens at all takes part without hanging.
    tokens = [0] + [11 + 5 * q for q in range(1, world)]
    check_against_reference(cfg(2, f), tokens, seed=8)
    return True


@pytest.mark.parametrize("f", [0.0, 1.0])
@pytest.mark.parametrize("world", [2, 4])
def test_experts_that_get_no_token_still_match_the_reference(ranks, world, f):
    assert all(ranks(world).run(_dead_experts, f))


@pytest.mark.parametrize("f", [0.0, 1.25])
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_with_an_empty_batch_takes_part_and_matches_the_reference(ranks, world, f):
    assert all(ranks(world).run(_idle_rank, f))


def test_layer_matches_reference_without_torch_distributed():
    check_against_reference(cfg(2, 1.0), [17], seed=5)
    check_against_reference(cfg(2, 0.0), [0], seed=6)
