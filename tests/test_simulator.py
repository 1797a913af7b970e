"""The simulator: exact makespans on hand-computable schedules, and the executor's own order."""

from __future__ import annotations

import random

import pytest

from schemoe.scheduling import (
    COMPUTE,
    StackGraph,
    Task,
    TaskGraph,
    execute,
    make_schedule,
    make_stack_schedule,
    simulator,
    stack_task_costs,
)
from schemoe.scheduling.simulator import TaskCosts
from schemoe.trace import gantt

POLICIES = ("sequential", "tutel", "schemoe", "fastermoe", "search")


def _uniform(graph: TaskGraph, c=1.0, a=10.0, d=2.0, e=3.0) -> dict:
    return {t: {"C": c, "A": a, "D": d, "E": e}[t.kind] for t in graph.tasks}


@pytest.mark.parametrize("links", [("net",), ("intra", "inter")])
def test_sequential_makespan_is_every_compute_task_plus_every_transfer(links):
    g = TaskGraph(3, links)
    rng = random.Random(0)
    costs = {t: rng.uniform(0.1, 5) for t in g.tasks}
    span, events = simulator.run(make_schedule("sequential", g), g, costs)
    compute = sum(v for t, v in costs.items() if not t.is_comm)
    # The links of one transfer run at once (Pipe-A2A): a transfer costs its slowest part.
    comm = sum(
        max(costs[t] for t in g.tasks if t.is_comm and (t.phase, t.chunk) == (p, i))
        for p in (1, 2)
        for i in range(3)
    )
    assert span == pytest.approx(compute + comm)
    assert len(events) == len(g.tasks)


@pytest.mark.parametrize("r", [2, 3, 4, 6])
def test_schemoe_with_comm_bound_chunks_takes_c1_plus_2r_transfers_plus_the_last_d2(r):
    g = TaskGraph(r)
    # The link never idles after C1.0: A1.0..A1.r-1 then A2.0..A2.r-1 back to back.
    span, _ = simulator.run(make_schedule("schemoe", g), g, _uniform(g, c=1, a=10, d=2, e=3))
    assert span == pytest.approx(1 + 2 * r * 10 + 2)


def test_schemoe_with_compute_bound_chunks_takes_the_sum_of_compute():
    g = TaskGraph(4)
    costs = _uniform(g, c=1, a=0.5, d=2, e=3)
    span, _ = simulator.run(make_schedule("schemoe", g), g, costs)
    assert span == pytest.approx(4 * (1 + 2 + 3 + 1 + 2))


def test_per_task_overhead_is_charged_to_every_compute_task_and_every_post():
    g = TaskGraph(2)
    tc = TaskCosts(_uniform(g), overhead=0.25)
    span0, _ = simulator.run(make_schedule("sequential", g), g, _uniform(g))
    span1, _ = simulator.run(make_schedule("sequential", g), g, tc)
    assert span1 == pytest.approx(span0 + 0.25 * len(g.tasks))


class _VirtualRunner:
    """A TaskRunner on a virtual clock with the simulator's link rule: one transfer per link
    at a time, FIFO from when it is posted. Records the order the executor really uses."""

    def __init__(self, costs: dict) -> None:
        self.costs, self.clock = costs, 0.0
        self.free: dict[str, float] = {}
        self.order: dict[str, list[str]] = {}

    def run(self, t) -> None:
        self.order.setdefault(COMPUTE, []).append(str(t))
        self.clock += self.costs[t]

    def start(self, t):
        self.order.setdefault(t.link, []).append(str(t))
        start = max(self.clock, self.free.get(t.link, 0.0))
        self.free[t.link] = end = start + self.costs[t]
        runner = self

        class Pending:
            def is_completed(self) -> bool:
                return runner.clock >= end

            def wait(self):
                runner.clock = max(runner.clock, end)

        return Pending()

    def finish(self, t, result) -> None:
        pass


@pytest.mark.parametrize("shared", [False, True], ids=["", "shared"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("links", [("net",), ("intra", "inter")])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_simulator_and_executor_agree_on_task_order_per_resource_and_on_makespan(
    policy, links, direction, shared
):
    rng = random.Random(hash((policy, links, direction, shared)) % 1000)
    for r in (1, 2, 3, 4):
        partition = "peers" if policy == "fastermoe" else "capacity"
        g = TaskGraph(r, links, direction, partition, shared)
        costs = {t: rng.uniform(0.1, 4) for t in g.tasks}
        sched = make_schedule(policy, g, costs)
        runner = _VirtualRunner(costs)
        execute(sched, g, runner)
        span, events = simulator.run(sched, g, costs)
        for res in g.resources():
            sim = [e.task for e in sorted(events, key=lambda e: e.start) if e.resource == res]
            assert sim == runner.order[res], (policy, r, res)
        # The virtual clock ends when the last compute task ends; the simulator's makespan
        # also counts nothing after it, since every transfer is consumed by a D task.
        assert span == pytest.approx(runner.clock)


def test_a_simulated_timeline_draws_with_the_trace_gantt_chart(tmp_path):
    pytest.importorskip("matplotlib")
    g = TaskGraph(3, ("intra", "inter"))
    span, events = simulator.run(make_schedule("schemoe", g), g, _uniform(g), origin=0.0)
    path = tmp_path / "sim.png"
    gantt(events, str(path), "simulated")
    assert path.stat().st_size > 1000
    assert {e.resource for e in events} == {"compute", "intra", "inter"}
    assert max(e.end for e in events) == pytest.approx(span)


def test_costs_of_the_wrong_type_raise_type_error():
    g = TaskGraph(1)
    with pytest.raises(TypeError, match="CostModel"):
        simulator.run(make_schedule("sequential", g), g, 3.0)


def test_compute_overlapped_with_a_transfer_runs_slower_by_the_overlap_factor():
    # 3 s of work from t = 0 with a transfer on the link over [1, 2] and [1.5, 2.5]: 1 s free,
    # then 1.5 s of overlapped time doing 0.75 s of work (factor 1 + 1), then 1.25 s free: 3.75.
    assert simulator._finish(0.0, 3.0, [(1.5, 2.5), (1.0, 2.0)], 1.0) == pytest.approx(3.75)
    assert simulator._finish(0.0, 3.0, [(1.0, 2.0)], 0.0) == 3.0
    assert simulator._finish(2.0, 1.0, [(0.0, 1.0)], 1.0) == 3.0  # over before it starts
    # A sequential schedule computes nothing while a transfer is in flight: no change. The
    # schemoe order computes chunk i+1 under chunk i's transfers: slower, by at most
    # overlap x every transfer's time.
    g = TaskGraph(4)
    costs = _uniform(g, c=1, a=0.5, d=2, e=3)
    comm = sum(v for t, v in costs.items() if t.is_comm)
    for policy, grows in (("sequential", False), ("schemoe", True)):
        sched = make_schedule(policy, g)
        base, _ = simulator.run(sched, g, TaskCosts(costs))
        slow, _ = simulator.run(sched, g, TaskCosts(costs, overlap=0.5))
        assert (slow > base) == grows
        assert slow <= base + 0.5 * comm + 1e-9


def test_a_gradient_bucket_shares_the_link_with_an_all_to_all_instead_of_queueing_behind_it():
    # One link: an all-to-all of 10 s posted at 0, a bucket of 20 s posted at 5. Alone for 5 s
    # (5 s left), then both at half the rate: the all-to-all ends at 15. A second all-to-all of
    # 4 s, posted at 6, waits for the first (FIFO among them), then shares: 15 to 23. The bucket
    # has done 9 s of its 20 by then and ends at 34: the link was never idle, 34 s of work.
    a, a2, ar = Task.parse("A1.0"), Task.parse("A1.1"), Task.parse("AR.0")
    link = simulator._Link(0.0)
    link.post(a, 10.0, False, 0.0)
    link.post(ar, 20.0, True, 5.0)
    link.post(a2, 4.0, False, 6.0)
    spans = link.projected()
    assert spans[a] == pytest.approx((0.0, 15.0))
    assert spans[a2] == pytest.approx((15.0, 23.0))  # its 4 s at half the rate
    assert spans[ar] == pytest.approx((5.0, 34.0))
    # Posting later moves the clock: what finished before is kept, the rest re-projected.
    link.post(Task.parse("AR.1"), 1.0, True, 40.0)
    assert link.projected()[Task.parse("AR.1")] == pytest.approx((40.0, 41.0))
    assert link.projected()[a] == pytest.approx((0.0, 15.0))


def test_a_stack_backward_prices_its_buckets_beside_its_all_to_alls():
    # Block 1's bucket goes once its AT backward is done, while block 0's all-to-alls run: the
    # two overlap on the link (FIFO would start the dispatch only after the bucket).
    g = StackGraph((1, 1), 1, direction="backward", buckets=(1,))
    region = {t: (0.01 if t.is_comm else 0.002) for t in TaskGraph(1, direction="backward").tasks}
    costs = stack_task_costs(g, [region] * 2, at=0.004, po=0.001, ar=0.05)
    regions = [
        list(make_schedule("sequential", TaskGraph(1, direction="backward")).order["compute"])
    ] * 2
    span, events = simulator.run(make_stack_schedule("sequential", g, regions), g, costs)
    ev = {e.task: e for e in events}
    bucket, dispatch = ev["AR.0"], ev["A1.0"]  # block 0, micro-chunk 0
    assert bucket.start < dispatch.start < bucket.end  # in flight together
    assert dispatch.end - dispatch.start == pytest.approx(0.02)  # at half the rate throughout
    assert span == pytest.approx(max(e.end for e in events))


def test_a_transfer_with_a_lead_is_posted_that_share_of_its_producer_before_the_producer_ends():
    # Backward stack, one block: its bucket's weights come out of the AT backward (4 ms) evenly.
    # Lead 0.5: the bucket is posted 2 ms before the AT ends; lead 0: at its end.
    g = StackGraph((1,), 1, direction="backward", buckets=(0,))
    region = {t: (0.01 if t.is_comm else 0.002) for t in TaskGraph(1, direction="backward").tasks}
    durations = stack_task_costs(g, [region], at=0.004, po=0.001, ar=0.05)
    regions = [
        list(make_schedule("sequential", TaskGraph(1, direction="backward")).order["compute"])
    ]
    sched = make_stack_schedule("sequential", g, regions)
    at_end = {}
    for lead in (0.0, 0.5):
        span, events = simulator.run(sched, g, TaskCosts(durations, lead={g.bucket(0): lead}))
        ev = {e.task: e for e in events}
        at_end[lead] = ev["AT"].end
        assert ev["AR.0"].start == pytest.approx(ev["AT"].end - lead * 0.004)
        assert span == pytest.approx(ev["AR.0"].end)
    assert at_end[0.0] == at_end[0.5]
