"""Every all-to-all algorithm under every policy gives the layer bitwise the naive result."""

from __future__ import annotations

import pytest
import torch

from moe_cases import check_against_reference
from schemoe import (
    CollectiveConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
)

ALGOS = ("naive", "pairwise", "pipe", "hier2d", "leader")
POLICIES = ("sequential", "tutel", "schemoe", "fastermoe")


def cfg(policy, r, algorithm, f):
    return MoEConfig(
        gate=GateConfig(num_experts=8, top_k=2, capacity_factor=f),
        experts=ExpertConfig(model_dim=12, hidden_dim=20),
        parallel=ParallelConfig(ranks_per_node=2),
        schedule=ScheduleConfig(policy=policy, chunks=r),
        collective=CollectiveConfig(algorithm=algorithm),
    )


def _against_naive(rank, world, policy, f):
    tokens = [23 + 5 * q for q in range(world)]
    r = 2 if policy == "fastermoe" else 3
    base = check_against_reference(cfg(policy, r, "naive", f), tokens, seed=4)
    for algo in ALGOS[1:]:
        got = check_against_reference(cfg(policy, r, algo, f), tokens, seed=4)
        assert torch.equal(got["y"], base["y"]), (algo, policy, f)
        assert torch.equal(got["gx"], base["gx"]), (algo, policy, f)
        for n in base["grads"]:
            assert torch.equal(got["grads"][n], base["grads"][n]), (algo, policy, n)
    return True


@pytest.mark.parametrize("f", [1.0, 0.0], ids=["capacity", "dropless"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_algorithm_under_every_policy_matches_naive_bitwise_on_2x2(ranks, policy, f):
    assert all(ranks(4).run(_against_naive, policy, f))
