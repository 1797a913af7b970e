"""Every all-to-all algorithm under every policy gives the layer bitwise the naive result."""

from __future__ import annotations

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
from schemoe._dist import spawn

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


def _all(rank, world):
    tokens = [23 + 5 * r for r in range(world)]
    for f in (1.0, 0.0):
        for policy in POLICIES:
            r = 2 if policy == "fastermoe" else 3
            base = check_against_reference(cfg(policy, r, "naive", f), tokens, seed=4)
            for algo in ALGOS[1:]:
                got = check_against_reference(cfg(policy, r, algo, f), tokens, seed=4)
                assert torch.equal(got["y"], base["y"]), (algo, policy, f)
                assert torch.equal(got["gx"], base["gx"]), (algo, policy, f)
                for n in base["grads"]:
                    assert torch.equal(got["grads"][n], base["grads"][n]), (algo, policy, n)
    return True


def test_every_algorithm_under_every_policy_matches_naive_bitwise_on_2x2():
    assert all(spawn(_all, 4, timeout=300))
