"""The simulator: exact makespans on hand-computable schedules, and the executor's own order."""

from __future__ import annotations

import random

import pytest

from schemoe.scheduling import COMPUTE, TaskGraph, execute, make_schedule, simulator
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
