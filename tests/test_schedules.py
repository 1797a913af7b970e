"""Every policy at every chunk count gives the layer's exact result, forward and backward."""

from __future__ import annotations

import pytest
import torch
from conftest import registered

from moe_cases import check_against_reference
from schemoe import ExpertConfig, GateConfig, MoEConfig, ScheduleConfig
from schemoe.scheduling import (
    POLICIES,
    Policy,
    Schedule,
    Task,
    TaskGraph,
    fifo_links,
    make_schedule,
    walk,
)

E, M, H = 8, 12, 20
CAPACITY_POLICIES = ("sequential", "tutel", "schemoe")


def cfg(policy, r, f=1.0, k=2):
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=k, capacity_factor=f),
        experts=ExpertConfig(model_dim=M, hidden_dim=H),
        schedule=ScheduleConfig(policy=policy, chunks=r),
    )


def _invariance(rank, world, f, r):
    tokens = [29 + 6 * q for q in range(world)]
    base = check_against_reference(cfg("sequential", r, f), tokens, seed=r)
    for policy in CAPACITY_POLICIES[1:]:
        got = check_against_reference(cfg(policy, r, f), tokens, seed=r)
        # Same arithmetic, only the task order differs: bitwise equal.
        assert torch.equal(got["y"], base["y"]), (policy, r, f)
        assert torch.equal(got["gx"], base["gx"]), (policy, r, f)
        for n in base["grads"]:
            assert torch.equal(got["grads"][n], base["grads"][n]), (policy, r, f, n)
    return True


def _peers(rank, world, f, r):
    check_against_reference(cfg("fastermoe", r, f), [29 + 6 * q for q in range(world)], seed=r)
    return True


@pytest.mark.parametrize("r", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("f", [1.0, 0.0], ids=["capacity", "dropless"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_capacity_policy_matches_sequential_bitwise_and_the_reference(ranks, world, f, r):
    assert all(ranks(world).run(_invariance, f, r))


@pytest.mark.parametrize("f", [1.0, 0.0], ids=["capacity", "dropless"])
@pytest.mark.parametrize("world,r", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 3), (4, 4)])
def test_fastermoe_peer_groups_match_the_reference(ranks, world, r, f):
    assert all(ranks(world).run(_peers, f, r))


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
    # Shared experts: one S task, under the first dispatch transfers (tests/test_shared_experts)
    s = make_schedule("schemoe", TaskGraph(2, ("intra", "inter"), shared=True))
    assert Schedule.parse(str(s)) == s
    assert str(s).splitlines()[0] == "compute: C1.0 C1.1 S D1.0 E.0 C2.0 D1.1 E.1 C2.1 D2.0 D2.1"


def test_a_schedule_that_would_deadlock_is_rejected_naming_the_task():
    g = TaskGraph(2)
    bad = Schedule.parse(
        "compute: C1.0 D1.1 C1.1 D1.0 E.0 C2.0 E.1 C2.1 D2.0 D2.1\nnet: A1.0 A1.1 A2.0 A2.1"
    )
    with pytest.raises(ValueError, match="D1.1 needs") as e:
        bad.check(g)
    assert "compute: C1.0 >>D1.1<< C1.1" in str(e.value)  # the schedule, failing step marked
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
    return fifo_links(graph, comp)


def _user_policy(rank, world):
    tokens = [21 + 3 * r for r in range(world)]
    policy = Policy("test_reversed", _reversed_policy)
    with registered(POLICIES, "test_reversed", policy):  # in this rank's process only
        check_against_reference(cfg("test_reversed", 3), tokens, seed=11)
    return True


def test_a_user_registered_policy_runs_forward_and_backward(ranks):
    assert all(ranks(2).run(_user_policy))


def _tuned(rank, world, policy):
    tokens = [40 + 9 * r for r in range(world)]  # uneven: rank 0's count decides for all
    check_against_reference(cfg(policy, 2), tokens, seed=13)
    return True


@pytest.mark.parametrize("policy", ["auto", "search"])
def test_tuned_layers_agree_across_ranks_and_match_the_reference(ranks, policy):
    assert all(ranks(2).run(_tuned, policy))


def test_a_policy_registered_for_a_test_is_gone_after_it():
    policy = Policy("test_gone", _reversed_policy)
    with registered(POLICIES, "test_gone", policy):
        assert POLICIES.get("test_gone") is policy
    assert "test_gone" not in POLICIES
    with pytest.raises(ValueError, match="not registered"):
        POLICIES.unregister("test_gone")


def test_walk_posts_each_transfer_once_its_input_exists_and_its_link_turn_has_come():
    g = TaskGraph(2)
    sched = make_schedule("schemoe", g)
    steps = [([str(a) for a in issued], str(t) if t else None) for issued, t in walk(sched, g)]
    assert steps == [
        ([], "C1.0"),
        (["A1.0"], "C1.1"),
        (["A1.1"], "D1.0"),
        ([], "E.0"),
        ([], "C2.0"),
        (["A2.0"], "D1.1"),
        ([], "E.1"),
        ([], "C2.1"),
        (["A2.1"], "D2.0"),
        ([], "D2.1"),
        ([], None),
    ]


def test_walk_keeps_fifo_order_per_link_even_when_a_later_input_is_ready_first():
    g = TaskGraph(2)
    # net's queue puts A1.1 first: A1.0 may not go before it although its input exists earlier.
    text = "compute: C1.0 C1.1 D1.0 E.0 C2.0 D1.1 E.1 C2.1 D2.0 D2.1\n"
    text += "net: A1.1 A1.0 A2.0 A2.1"
    sched = Schedule.parse(text)
    issued = [[str(a) for a in i] for i, _ in walk(sched, g)]
    assert issued[:3] == [[], [], ["A1.1", "A1.0"]]
