"""Every all-to-all algorithm under every policy gives the layer bitwise the naive result."""

from __future__ import annotations

import pytest
import torch

from moe_cases import ALGOS, POLICIES, check_against_reference, layer_config


def cfg(policy, r, algorithm, f):
    return layer_config(policy, algorithm, chunks=r, capacity_factor=f, rpn=2)


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
