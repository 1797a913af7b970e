"""Dry-run of a Schedule: the makespan and timeline the executor would produce, from task costs.

`run(schedule, graph, costs)` consumes exactly the objects the executor runs (a
`schemoe.scheduling.Schedule` and its `TaskGraph`) under the executor's rules, walked by the same
issue rule (`tasks.walk`):

  * compute tasks run one at a time in the schedule's compute order, each costing its duration
    plus the executor's per-task overhead;
  * before each compute task the executor posts every transfer whose inputs exist and whose
    turn on its link has come (posting costs the per-task overhead on the compute thread);
  * each link moves one all-to-all at a time, first-come first-served in the schedule's order:
    a posted transfer starts when the ones before it are done (docs/costmodel.md: two plain
    gloo all-to-alls posted back to back finish at 1x and 2x one's time; the comm-thread
    algorithms run one job at a time by construction);
  * gradient buckets (AR tasks, the stack's) queue the same way among themselves, but beside
    the all-to-alls, not behind them: they go on communicators of their own (their own TCP
    connections), so while both are in flight each moves at half the link's rate (processor
    sharing between the two queues; the stack runtime posts buckets between its tasks without
    holding them back, step/runtime.py);
  * a compute task waits for a transfer only when it consumes it;
  * compute overlapped with a transfer runs slower by `TaskCosts.overlap` (on CPU gloo's
    threads and the kernel's TCP stack take cycles from the compute thread; NCCL kernels take
    SMs on a GPU): a compute task's work proceeds at 1 / (1 + overlap) of its speed while any
    of the rank's transfers is on a link.

It returns `(makespan, events)`, the events being `schemoe.trace.Event`s, so `schemoe.trace.gantt`
draws a simulated timeline exactly as it draws a recorded one.

What it does not model:
  * the other side of that contention: a link is assumed to move bytes at its rate whatever
    the compute does. (CPU ranks sharing cores are handled outside, by scaling compute
    durations: the cost model's `sharing_scale`, applied in its predictions);
  * other ranks: it follows one representative rank; a gloo collective completing only when the
    slowest rank reaches it (rank skew, uneven per-rank loads as in fastermoe's peer groups) is
    not simulated (the cost model adds a fitted constant wait to each all-to-all instead:
    `Hardware.skew`);
  * the number of TCP flows on a shaped link (hier2d and leader use fewer, slower flows);
  * bandwidth sharing between all-to-alls in flight on one link: gloo point-to-point batches
    (the inter part of `pipe`) posted back to back partly overlap instead of queueing strictly;
  * transfers of different links sharing a NIC or PCIe switch (pipe's two links are independent);
  * jitter, TCP slow start, tbf's burst bucket;
  * the cost of `is_completed` polling and tracing; memory allocation; CUDA stream semantics
    (kernels are taken as run when the host issues them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..trace import Event
from .tasks import COMPUTE, Kind, Schedule, Task, TaskGraph, walk

__all__ = ["TaskCosts", "run", "task_costs"]


@dataclass(frozen=True)
class TaskCosts:
    """Seconds per task of one graph, the executor's cost per task (on the compute thread, for
    compute tasks and for posting each transfer), `overlap`: how much longer compute takes
    while one of the rank's transfers is in flight (0.25: a second of compute takes 1.25 s of
    overlapped time; gloo's threads and the kernel's TCP stack on the rank's cores), and `lead`:
    for a transfer whose data the compute task completing its inputs produces as it runs (a
    gradient bucket of weights handed over one at a time), the share of that task's time before
    its end at which the transfer is posted (0: at the end)."""

    durations: Mapping[Task, float]
    overhead: float = 0.0
    overlap: float = 0.0
    lead: Mapping[Task, float] = field(default_factory=dict)


def task_costs(costs, graph: TaskGraph) -> TaskCosts:
    """`costs` as TaskCosts for `graph`: a CostModel (anything with `task_costs(graph)`),
    TaskCosts, or a plain mapping Task -> seconds (no overhead)."""
    if hasattr(costs, "task_costs"):
        costs = costs.task_costs(graph)
    if isinstance(costs, TaskCosts):
        return costs
    if isinstance(costs, Mapping):
        return TaskCosts(costs, 0.0)
    raise TypeError(f"costs must be a CostModel, TaskCosts or mapping, got {type(costs).__name__}")


def run(
    schedule: Schedule,
    graph: TaskGraph,
    costs,
    *,
    direction: str | None = None,
    origin: float = 0.0,
    rank: int = 0,
    record: bool = True,
) -> tuple[float, list[Event]]:
    """Simulate `schedule` on `graph`; return (makespan in seconds, events from `origin`).

    Args:
        schedule: the Schedule the executor would run (not re-checked: call `check` first).
        graph: its TaskGraph (dependencies).
        costs: a CostModel, TaskCosts or mapping Task -> seconds; a missing task raises KeyError.
        direction: the events' direction (default: the graph's).
        origin: time of the first event (to lay backward after forward on one chart).
        rank: the events' rank.
        record: False skips building events (the search policy's inner loop).
    """
    tc = task_costs(costs, graph)
    dur, ovh = tc.durations, tc.overhead
    direction = direction or graph.direction
    links = {res: _Link(origin) for res in schedule.order if res != COMPUTE}
    spans: dict[Task, tuple[float, float]] = {}  # transfer -> (start, end), as projected
    waiting: set[Task] = set()  # transfers posted, not yet waited for
    posted: list[tuple[int, Task]] = []  # (index in events, transfer)
    events: list[Event] = []
    now = origin  # the compute thread's clock
    stale = False  # posted since `spans` was projected

    last = 0.0  # the last compute task's time (what a transfer's `lead` is a share of)
    for issued, t in walk(schedule, graph):
        times = []
        for a in issued:
            now += ovh  # posting costs the compute thread
            times.append(now - tc.lead.get(a, 0.0) * last)
        for at, a in sorted(zip(times, issued), key=lambda x: x[0]):  # stable: FIFO kept
            links[a.resource].post(a, dur[a], a.kind == Kind.AR, at)
            waiting.add(a)
            if record:
                posted.append((len(events), a))
                events.append(None)
        stale = stale or bool(issued)
        if t is None:
            break
        consumed = [d for d in graph.deps[t] if d in waiting]  # wait only for what t consumes
        if stale and (consumed or tc.overlap):  # in flight: runs to its end, nothing more posted
            spans, stale = _project(links), False
        for d in consumed:
            waiting.discard(d)
            now = max(now, spans[d][1])
        busy = [(a, b) for a, b in spans.values() if b > now and b > a] if tc.overlap else []
        start, now = now, _finish(now, ovh + dur[t], busy, tc.overlap)
        last = now - start
        if record:
            events.append(Event(rank, str(direction), str(t), COMPUTE, start, now))
    spans = _project(links) if stale else spans
    for n, a in posted:
        events[n] = Event(rank, str(direction), str(a), a.resource, *spans[a])
    end = max([now, *(spans[a][1] for a in waiting)])
    return end - origin, events


def _project(links: Mapping[str, _Link]) -> dict[Task, tuple[float, float]]:
    return {t: span for link in links.values() for t, span in link.projected().items()}


class _Link:
    """One link's transfers: all-to-alls first-come first-served, gradient buckets likewise in a
    queue of their own, the two queues' heads sharing the link's rate equally while both are in
    flight. `post` moves the link's clock to the posting time; `projected` is every transfer's
    (start, end) posted so far, if nothing more is posted."""

    def __init__(self, origin: float) -> None:
        self.clock = origin
        self.queues: tuple[deque, deque] = (deque(), deque())  # all-to-alls, buckets
        self.done: dict[Task, tuple[float, float]] = {}

    def post(self, task: Task, seconds: float, bucket: bool, now: float) -> None:
        now = max(now, self.clock)  # never before what is already posted
        _drain(self.queues, self.clock, now, self.done)
        self.clock = now
        self.queues[bucket].append([task, seconds, None])

    def projected(self) -> dict[Task, tuple[float, float]]:
        out = dict(self.done)
        _drain(tuple(deque(list(x) for x in q) for q in self.queues), self.clock, None, out)
        return out


def _drain(queues, clock: float, until: float | None, spans: dict) -> None:
    """Run the queues' heads from `clock` (each head at 1 / (number of busy queues) of the
    link's rate) until `until` (None: until every queue is empty), recording each finished
    transfer's (start, end) in `spans`; the entries left keep their remaining seconds."""
    while True:
        heads = [q[0] for q in queues if q]
        if not heads:
            return
        for h in heads:
            if h[2] is None:
                h[2] = clock
        share = len(heads)
        step = min(h[1] for h in heads) * share
        if until is not None and clock + step > until:
            for h in heads:
                h[1] -= (until - clock) / share
            return
        clock += step
        for q in queues:
            if q:
                q[0][1] -= step / share
                if q[0][1] <= 1e-15:
                    task, _, start = q.popleft()
                    spans[task] = (start, clock)


def _finish(start: float, work: float, busy: list[tuple[float, float]], overlap: float) -> float:
    """When `work` seconds of compute started at `start` end, running at 1 / (1 + overlap) of
    their speed while any interval of `busy` covers the clock."""
    if not busy or overlap <= 0:
        return start + work
    now = start
    for a, b in _union(busy):
        if b <= now:
            continue
        if a > now:  # a free stretch first
            if work <= a - now:
                return now + work
            work -= a - now
            now = a
        room = (b - now) / (1 + overlap)
        if work <= room:
            return now + work * (1 + overlap)
        work -= room
        now = b
    return now + work


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The sorted union of intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
