"""Stack tasks (blocks x micro-chunks, AT / PO / AR kinds) as data: the text form, the graph, the
stack policies, the deadlock check and the simulator, all under the one issue rule."""

from __future__ import annotations

import pytest

from schemoe.scheduling import (
    STACK_POLICIES,
    Kind,
    Schedule,
    StackGraph,
    Task,
    TaskGraph,
    make_schedule,
    make_stack_schedule,
    simulator,
    stack_task_costs,
    walk,
)
from schemoe.scheduling.stack import _chain as stack_chain
from schemoe.scheduling.stack import stack_fifo_links


def _regions(blocks: int, r: int, policy: str = "schemoe", direction: str = "forward"):
    g = TaskGraph(r, direction=direction)
    return [list(make_schedule(policy, g).order["compute"])] * blocks


@pytest.mark.parametrize(
    "text", ["C1.0", "E.2", "A2.1@inter", "b1.m2.AT", "b0.m1.PO", "AR.3", "b3.m0.A1.2@intra"]
)
def test_a_task_prints_and_parses_back_to_itself(text):
    assert str(Task.parse(text)) == text


def test_a_block_0_micro_0_task_prints_as_a_region_task_always_did():
    assert str(Task("C", 1, 3, None, 0, 0)) == "C1.3"
    assert Task.parse("D2.1") == Task("D", 2, 1)


@pytest.mark.parametrize("text", ["AT.0", "AR", "b1.AT", "C1.0@net", "E1.0", "PO@net", "Q.0"])
def test_a_malformed_stack_task_is_refused(text):
    with pytest.raises(ValueError, match="cannot parse task"):
        Task.parse(text)


def test_bad_stack_task_fields_are_refused():
    with pytest.raises(ValueError, match="micro must be an int >= 0"):
        Task("AT", 0, 0, None, 0, -1)
    with pytest.raises(ValueError, match="have no chunk"):
        Task("AT", 0, 2)
    with pytest.raises(ValueError, match="only transfers"):
        Task("AR", 0, 1)


def test_at_and_po_run_on_compute_and_ar_on_the_link():
    assert Task.parse("b1.m0.AT").resource == "compute"
    assert Task.parse("b1.m0.PO").resource == "compute"
    assert Task.parse("AR.0@inter").resource == "inter" and Task.parse("AR.0").is_comm


def test_the_forward_chain_of_a_micro_chunk_runs_at_region_po_then_the_next_block():
    g = StackGraph((2, 1), 2)
    assert g.deps[Task.parse("b0.m1.C1.1")] == (Task.parse("b0.m1.AT"),)
    assert g.deps[Task.parse("b0.m1.PO")] == (Task.parse("b0.m1.D2.0"), Task.parse("b0.m1.D2.1"))
    assert g.deps[Task.parse("b1.m1.AT")] == (Task.parse("b0.m1.PO"),)
    assert g.deps[Task.parse("AT")] == ()


def test_the_backward_chain_runs_po_region_at_then_the_block_below_and_buckets_wait_for_at():
    g = StackGraph((1, 1), 2, direction="backward", buckets=(1,))
    assert g.deps[Task.parse("b1.m0.PO")] == ()
    assert g.deps[Task.parse("PO")] == (Task.parse("b1.m0.AT"),)
    assert g.deps[Task.parse("C1.0")] == (Task.parse("PO"),)
    assert g.deps[Task.parse("AR.0")] == (Task.parse("b1.m0.AT"), Task.parse("b1.m1.AT"))


def test_bad_stack_graphs_are_refused():
    with pytest.raises(ValueError, match="micro-chunks must be an int >= 1"):
        StackGraph((1,), 0)
    with pytest.raises(ValueError, match="one int >= 1 per block"):
        StackGraph((), 1)
    with pytest.raises(ValueError, match="backward graph"):
        StackGraph((1,), 1, buckets=(0,))
    with pytest.raises(ValueError, match="one region order per block"):
        make_stack_schedule("sequential", StackGraph((1, 1), 1), _regions(1, 1))
    with pytest.raises(ValueError, match="known: .*wavefront"):
        STACK_POLICIES.get("nope")


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("policy", ["sequential", "wavefront"])
@pytest.mark.parametrize("region", ["sequential", "tutel", "schemoe"])
@pytest.mark.parametrize("blocks,m,r", [(1, 1, 1), (2, 3, 2), (3, 4, 3)])
def test_every_stack_policy_gives_a_checked_schedule_that_round_trips(
    direction, policy, region, blocks, m, r
):
    g = StackGraph((r,) * blocks, m, direction=direction)
    s = make_stack_schedule(policy, g, _regions(blocks, r, region, direction))
    assert Schedule.parse(str(s)) == s
    assert sorted(s.order["compute"]) == sorted(t for t in g.tasks if not t.is_comm)


def test_with_one_micro_chunk_wavefront_is_sequential():
    g = StackGraph((2, 2), 1)
    regions = _regions(2, 2)
    assert make_stack_schedule("wavefront", g, regions) == make_stack_schedule(
        "sequential", g, regions
    )


def test_wavefront_runs_the_next_micro_chunks_attention_before_waiting_on_a_dispatch():
    g = StackGraph((1, 1), 2)
    compute = [str(t) for t in make_stack_schedule("wavefront", g, _regions(2, 1)).order["compute"]]
    assert compute[:6] == ["AT", "C1.0", "b0.m1.AT", "b0.m1.C1.0", "D1.0", "E.0"]
    # Walked by the issue rule, A1.0 is posted before b0.m1.AT runs and consumed after it.
    sched = make_stack_schedule("wavefront", g, _regions(2, 1))
    steps = [(list(map(str, issued)), str(t)) for issued, t in walk(sched, g)]
    assert steps[2] == (["A1.0"], "b0.m1.AT")


@pytest.mark.parametrize(
    "direction,head,wait", [("forward", "b1.m0.AT", "b0.m1.D2.0"), ("backward", "PO", "b1.m1.D2.0")]
)
def test_wavefront_runs_a_ready_head_before_waiting_on_a_newer_micro_chunks_combine(
    direction, head, wait
):
    g = StackGraph((1, 1), 2, direction=direction)
    sched = make_stack_schedule("wavefront", g, _regions(2, 1, direction=direction))
    compute = [str(t) for t in sched.order["compute"]]
    assert compute.index(head) < compute.index(wait)


def _newest_first(g, regions):
    """The wavefront order before heads went first: each step newest micro-chunk first."""
    chains = [stack_chain(g, regions, j) for j in range(g.micro)]
    n, out = len(chains[0]), []
    for step in range(n + g.micro - 1):
        out += [
            t for j in reversed(range(g.micro)) if 0 <= step - j < n for t in chains[j][step - j]
        ]
    return stack_fifo_links(g, out)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_heads_first_is_faster_under_the_simulator_when_attention_is_as_long_as_a_transfer(
    direction,
):
    g = StackGraph((1, 1, 1), 2, direction=direction)
    regions, c = _regions(3, 1, direction=direction), _costs(g, 3, 1, direction, at=0.01)
    old = simulator.run(_newest_first(g, regions), g, c)[0]
    new = simulator.run(make_stack_schedule("wavefront", g, regions), g, c)[0]
    assert new < 0.97 * old


def test_a_stack_schedule_that_waits_for_a_transfer_before_its_input_is_made_deadlocks():
    g = StackGraph((1,), 1)
    bad = Schedule.parse("compute: AT D1.0 C1.0 E.0 C2.0 D2.0 PO\nnet: A1.0 A2.0")
    with pytest.raises(ValueError, match="D1.0 needs"):
        bad.check(g)


def _costs(g, blocks, r, direction="forward", at=0.004):
    tg = TaskGraph(r, direction=direction)
    region = {t: (0.01 if t.is_comm else 0.002) for t in tg.tasks}
    return stack_task_costs(g, [region] * blocks, at=at, po=0.001, ar=0.003)


def test_the_simulator_prices_a_sequential_stack_as_the_sum_of_its_chains():
    g = StackGraph((1,), 2)
    sched = make_stack_schedule("sequential", g, _regions(1, 1))
    span, events = simulator.run(sched, g, _costs(g, 1, 1))
    # Per micro-chunk: AT 4 + C1 2 + A1 10 + D1 E C2 6 + A2 10 + D2 2 + PO 1 = 35 ms, no overlap.
    assert span == pytest.approx(2 * 0.035)
    assert {e.task for e in events} == {str(t) for t in g.tasks}


def test_the_simulator_hides_a_dispatch_behind_the_next_micro_chunks_attention_in_wavefront():
    g = StackGraph((1, 1), 4)
    c = _costs(g, 2, 1, at=0.01)
    seq = simulator.run(make_stack_schedule("sequential", g, _regions(2, 1)), g, c)[0]
    wave = simulator.run(make_stack_schedule("wavefront", g, _regions(2, 1)), g, c)[0]
    assert wave < 0.8 * seq


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_search_is_never_worse_than_sequential_or_wavefront_under_its_cost_model(direction):
    buckets = (1, 0) if direction == "backward" else ()
    g = StackGraph((2, 2), 3, direction=direction, buckets=buckets)
    regions, c = _regions(2, 2, direction=direction), _costs(g, 2, 2, direction)
    spans = {
        p: simulator.run(make_stack_schedule(p, g, regions, c), g, c)[0]
        for p in ("sequential", "wavefront", "search")
    }
    assert spans["search"] <= min(spans["sequential"], spans["wavefront"]) + 1e-12
    with pytest.raises(ValueError, match="needs a cost model"):
        make_stack_schedule("search", g, regions)


def test_a_bucket_is_posted_once_the_at_backward_of_its_block_ran_for_every_micro_chunk():
    g = StackGraph((1, 1), 2, direction="backward", buckets=(1,))
    sched = make_stack_schedule("sequential", g, _regions(2, 1, direction="backward"))
    done: list[str] = []
    for issued, t in walk(sched, g):
        if any(a.kind == Kind.AR for a in issued):
            assert "b1.m0.AT" in done and "b1.m1.AT" in done
            break
        done.append(str(t))
    else:
        raise AssertionError("AR.0 was never posted")
