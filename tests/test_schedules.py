"""Every policy at every chunk count gives the layer's exact result, forward and backward."""

from __future__ import annotations

import pytest
import torch

from moe_cases import check_against_reference
from schemoe import ExpertConfig, GateConfig, MoEConfig, ScheduleConfig
from schemoe._dist import spawn
from schemoe.scheduling import POLICIES, Schedule, Task, TaskGraph, make_schedule, register_policy

E, M, H = 8, 12, 20
CAPACITY_POLICIES = ("sequential", "tutel", "schemoe")


def cfg(policy, r, f=1.0, k=2):
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=k, capacity_factor=f),
        experts=ExpertConfig(model_dim=M, hidden_dim=H),
        schedule=ScheduleConfig(policy=policy, chunks=r),
    )


def _invariance(rank, world):
    tokens = [29 + 6 * r for r in range(world)]
    for f in (1.0, 0.0):  # capacity and dropless
        for r in (1, 2, 3, 4, 8):
            base = check_against_reference(cfg("sequential", r, f), tokens, seed=r)
            for policy in CAPACITY_POLICIES[1:]:
                got = check_against_reference(cfg(policy, r, f), tokens, seed=r)
                # Same arithmetic, only the task order differs: bitwise equal.
                assert torch.equal(got["y"], base["y"]), (policy, r, f)
                assert torch.equal(got["gx"], base["gx"]), (policy, r, f)
                for n in base["grads"]:
                    assert torch.equal(got["grads"][n], base["grads"][n]), (policy, r, f, n)
        for r in range(1, world + 1):  # peer groups: at most one per rank
            check_against_reference(cfg("fastermoe", r, f), tokens, seed=r)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_every_policy_and_chunk_count_matches_sequential_bitwise_and_the_reference(world):
    assert all(spawn(_invariance, world, timeout=300))


def test_task_and_schedule_text_round_trip():
    g = TaskGraph(3, ("intra", "inter"))
    s = make_schedule("schemoe", g)
    assert Schedule.parse(str(s)) == s
    assert str(Task.parse("A2.1@inter")) == "A2.1@inter"
    assert str(make_schedule("schemoe", TaskGraph(2))).splitlines() == [
        "compute: C1.0 C1.1 D1.0 E.0 C2.0 D1.1 E.1 C2.1 D2.0 D2.1",
        "net: A1.0 A1.1 A2.0 A2.1",
    ]
    assert str(make_schedule("tutel", TaskGraph(3))).splitlines()[0] == (
        "compute: C1.0 C1.1 C1.2 D1.0 E.0 C2.0 D1.1 E.1 C2.1 D2.0 D1.2 E.2 C2.2 D2.1 D2.2"
    )


def test_a_schedule_that_would_deadlock_is_rejected_naming_the_task():
    g = TaskGraph(2)
    bad = Schedule.parse(
        "compute: C1.0 D1.1 C1.1 D1.0 E.0 C2.0 E.1 C2.1 D2.0 D2.1\nnet: A1.0 A1.1 A2.0 A2.1"
    )
    with pytest.raises(ValueError, match="D1.1 needs"):
        bad.check(g)
    with pytest.raises(ValueError, match="missing"):
        Schedule.parse("compute: C1.0\nnet: A1.0").check(g)


def test_bad_task_text_and_unknown_policy_raise_value_errors():
    with pytest.raises(ValueError, match="cannot parse task"):
        Task.parse("Q1.0")
    with pytest.raises(ValueError, match="known: .*schemoe"):
        POLICIES.get("nope")


def _reversed_policy(graph, costs=None):
    # A user policy: dispatch everything first, then run the chunks last to first.
    r = graph.chunks
    comp = [Task("C", 1, i) for i in range(r)]
    for i in reversed(range(r)):
        comp += [Task("D", 1, i), Task("E", 0, i), Task("C", 2, i)]
    comp += [Task("D", 2, i) for i in range(r)]
    from schemoe.scheduling import fifo_links

    return fifo_links(graph, comp)


register_policy("test_reversed", replace=True)(_reversed_policy)


def _user_policy(rank, world):
    tokens = [21 + 3 * r for r in range(world)]
    check_against_reference(cfg("test_reversed", 3), tokens, seed=11)
    return True


def test_a_user_registered_policy_runs_forward_and_backward():
    assert all(spawn(_user_policy, 2, timeout=120))


def _auto_and_search(rank, world):
    tokens = [40 + 9 * r for r in range(world)]  # uneven: rank 0's count decides for all
    for policy in ("auto", "search"):
        check_against_reference(cfg(policy, 2), tokens, seed=13)
    return True


def test_auto_and_search_layers_agree_across_ranks_and_match_the_reference():
    assert all(spawn(_auto_and_search, 2, timeout=180))
