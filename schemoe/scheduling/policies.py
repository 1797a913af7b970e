"""Scheduling policies: functions (TaskGraph, CostModel | None) -> Schedule.

A policy orders the compute tasks; each link then runs its all-to-alls first-come first-served in
the order their inputs are produced (`fifo_links`), which is what every system compared here does
and what Theorem 1 of the ScheMoE paper assumes. A policy may also set link orders itself.

Built-in policies (r chunks, compute order):

    sequential  C1.i D1.i E.i C2.i D2.i for each i in turn: no overlap (DeepSpeed-MoE, GShard)
    tutel       C1.0..C1.r-1 | D1.0 E.0 C2.0 | D1.i E.i C2.i D2.i-1 ... | D2.r-1
                all dispatches issued back to back, experts and combines per chunk; each
                combine is decompressed at the first chunk boundary after it was sent, as when
                compression is fused into the transfer (Tutel has none of its own)
    schemoe     C1.0..C1.r-1 | D1.i E.i C2.i for each i | D2.0..D2.r-1   (Theorem 1)
    fastermoe   the schemoe order over a "peers" partition: chunk s exchanges with the ranks at
                offsets in group s (FasterMoE's smart schedule pipelines over peer groups)

A graph with shared experts (`TaskGraph(shared=True)`) has one more compute task, S, needing
nothing; every built-in policy puts it right after the dispatch compressions that precede the
first D1 (C1.0 S D1.0 ... for sequential, C1.0..C1.r-1 S D1.0 ... for tutel and schemoe), i.e.
as soon as the first dispatch transfers are posted, so it runs under them (forward) or under the
first gradient exchanges (backward). `fifo_links` puts it there for any policy whose order leaves
it out; `place_shared(schedule, "before")` moves it first instead (no overlap, for comparison).

Register your own:

    @register_policy("mine")
    def mine(graph, costs=None) -> Schedule: ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..registry import Registry
from .tasks import COMPUTE, SHARED, Kind, Partition, Phase, Schedule, Task, TaskGraph

__all__ = [
    "POLICIES",
    "Policy",
    "fifo_links",
    "make_schedule",
    "place_shared",
    "register_policy",
    "with_shared",
]


@dataclass(frozen=True)
class Policy:
    name: str
    order: Callable[..., Schedule]
    partition: Partition = Partition.CAPACITY


POLICIES: Registry[Policy] = Registry("schedule policy")


def register_policy(
    name: str, *, partition: Partition | str = Partition.CAPACITY, replace: bool = False
):
    """Decorator registering `fn(graph, costs=None) -> Schedule` as policy `name`."""
    if partition not in tuple(Partition):
        raise ValueError(
            f"partition must be one of {[p.value for p in Partition]}, got {partition!r}"
        )
    partition = Partition(partition)

    def deco(fn):
        POLICIES.register(name, replace=replace)(Policy(name, fn, partition))
        return fn

    return deco


def with_shared(graph: TaskGraph, compute: list[Task]) -> list[Task]:
    """`compute` with the shared-experts task S at its default place, right before the first
    D1 (after the dispatch compressions ahead of it), if the graph has S and `compute` lacks it."""
    if not getattr(graph, "shared", False) or SHARED in compute:
        return list(compute)
    first_d1 = next(
        (n for n, t in enumerate(compute) if t.kind == Kind.D and t.phase == Phase.DISPATCH),
        len(compute),
    )
    return [*compute[:first_d1], SHARED, *compute[first_d1:]]


def place_shared(schedule: Schedule, placement: str) -> Schedule:
    """`schedule` with S where `placement` says: "scheduled" as it is; "before" first in the
    compute order, ahead of every dispatch compression (the link orders are kept: S has no
    transfer). A schedule without S is returned as it is."""
    if placement == "scheduled":
        return schedule
    if placement != "before":
        raise ValueError(f"shared placement must be 'scheduled' or 'before', got {placement!r}")
    compute = schedule.order.get(COMPUTE, ())
    if SHARED not in compute:
        return schedule
    rest = tuple(t for t in compute if t != SHARED)
    return Schedule({**schedule.order, COMPUTE: (SHARED, *rest)})


def fifo_links(graph: TaskGraph, compute: list[Task]) -> Schedule:
    """Complete a compute order with FIFO link orders: each A task queues when its input is made.
    A shared-experts task the order leaves out goes to its default place (`with_shared`)."""
    compute = with_shared(graph, compute)
    pos = {t: i for i, t in enumerate(compute)}
    order: dict[str, tuple[Task, ...]] = {COMPUTE: tuple(compute)}
    for link in graph.links:
        comm = [t for t in graph.tasks if t.kind == Kind.A and t.link == link]
        comm.sort(key=lambda t: (max(pos[d] for d in graph.deps[t]), t.phase, t.chunk))
        order[link] = tuple(comm)
    return Schedule(order)


def _c(p: Phase, i: int) -> Task:
    return Task(Kind.C, p, i)


def _d(p: Phase, i: int) -> Task:
    return Task(Kind.D, p, i)


def _e(i: int) -> Task:
    return Task(Kind.E, Phase.EXPERT, i)


_1, _2 = Phase.DISPATCH, Phase.COMBINE


@register_policy("sequential")
def sequential(graph: TaskGraph, costs=None) -> Schedule:
    compute = []
    for i in range(graph.chunks):
        compute += [_c(_1, i), _d(_1, i), _e(i), _c(_2, i), _d(_2, i)]
    return fifo_links(graph, compute)


def _dispatch_first(r: int, lag: int) -> list[Task]:
    """The compute order shared by tutel and schemoe: C1 of every chunk back to back, then D1 E C2
    per chunk, with chunk i's D2 right after chunk i + lag's C2 (those with no such chunk at
    the end, in chunk order)."""
    compute = [_c(_1, i) for i in range(r)]
    for i in range(r):
        compute += [_d(_1, i), _e(i), _c(_2, i)]
        if i >= lag:
            compute.append(_d(_2, i - lag))
    compute += [_d(_2, i) for i in range(max(r - lag, 0), r)]
    return compute


@register_policy("tutel")
def tutel(graph: TaskGraph, costs=None) -> Schedule:
    return fifo_links(graph, _dispatch_first(graph.chunks, lag=1))


@register_policy("schemoe")
def schemoe(graph: TaskGraph, costs=None) -> Schedule:
    return fifo_links(graph, _dispatch_first(graph.chunks, lag=graph.chunks))


@register_policy("fastermoe", partition=Partition.PEERS)
def fastermoe(graph: TaskGraph, costs=None) -> Schedule:
    return schemoe(graph, costs)


def make_schedule(policy: str, graph: TaskGraph, costs=None) -> Schedule:
    """Run policy `policy` on `graph` and check the result is a valid, deadlock-free schedule."""
    pol = POLICIES.get(policy)
    sched = pol.order(graph, costs)
    if not isinstance(sched, Schedule):
        raise TypeError(f"policy {policy!r} returned {type(sched).__name__}, not a Schedule")
    sched.check(graph)
    return sched
