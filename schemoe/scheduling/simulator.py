"""Dry-run of a Schedule: the makespan and timeline the executor would produce, from task costs.

`run(schedule, graph, costs)` consumes exactly the objects the executor runs (a
`schemoe.scheduling.Schedule` and its `TaskGraph`) under the executor's rules, walked by the same
issue rule (`tasks.walk`):

  * compute tasks run one at a time in the schedule's compute order, each costing its duration
    plus the executor's per-task overhead;
  * before each compute task the executor posts every transfer whose inputs exist and whose
    turn on its link has come (posting costs the per-task overhead on the compute thread);
  * each link moves one transfer at a time, first-come first-served in the schedule's order: a
    posted transfer starts when the link is free (docs/costmodel.md: two plain gloo
    all-to-alls posted back to back finish at 1x and 2x one's time; the comm-thread algorithms
    run one job at a time by construction);
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
    not simulated;
  * the number of TCP flows on a shaped link (hier2d and leader use fewer, slower flows);
  * bandwidth sharing between transfers in flight on one link: gloo point-to-point batches (the
    inter part of `pipe`) posted back to back partly overlap instead of queueing strictly;
  * transfers of different links sharing a NIC or PCIe switch (pipe's two links are independent);
  * jitter, TCP slow start, tbf's burst bucket;
  * the cost of `is_completed` polling and tracing; memory allocation; CUDA stream semantics
    (kernels are taken as run when the host issues them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..trace import Event
from .tasks import COMPUTE, Schedule, Task, TaskGraph, walk

__all__ = ["TaskCosts", "run", "task_costs"]


@dataclass(frozen=True)
class TaskCosts:
    """Seconds per task of one graph, the executor's cost per task (on the compute thread, for
    compute tasks and for posting each transfer), and `overlap`: how much longer compute takes
    while one of the rank's transfers is in flight (0.25: a second of compute takes 1.25 s of
    overlapped time; gloo's threads and the kernel's TCP stack on the rank's cores)."""

    durations: Mapping[Task, float]
    overhead: float = 0.0
    overlap: float = 0.0


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
    free = {res: origin for res in schedule.order if res != COMPUTE}  # when each link is idle
    inflight: dict[Task, float] = {}  # transfer -> end time
    busy: list[tuple[float, float]] = []  # the transfers' (start, end), for `overlap`
    events: list[Event] = []
    now = origin  # the compute thread's clock

    for issued, t in walk(schedule, graph):
        for a in issued:
            now += ovh  # posting costs the compute thread
            start = max(now, free[a.resource])
            free[a.resource] = end = start + dur[a]
            inflight[a] = end
            if tc.overlap and end > start:
                busy.append((start, end))
            if record:
                events.append(Event(rank, str(direction), str(a), a.resource, start, end))
        if t is None:
            break
        for d in graph.deps[t]:
            if d in inflight:  # wait only for what this task consumes
                now = max(now, inflight.pop(d))
        if busy:
            busy = [(a, b) for a, b in busy if b > now]
        start, now = now, _finish(now, ovh + dur[t], busy, tc.overlap)
        if record:
            events.append(Event(rank, str(direction), str(t), COMPUTE, start, now))
    end = max([now, *inflight.values()])
    return end - origin, events


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
