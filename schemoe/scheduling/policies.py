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

Register your own:

    @register_policy("mine")
    def mine(graph, costs=None) -> Schedule: ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..registry import Registry
from .tasks import COMPUTE, Schedule, Task, TaskGraph

__all__ = ["POLICIES", "Policy", "fifo_links", "make_schedule", "register_policy"]


@dataclass(frozen=True)
class Policy:
    name: str
    order: Callable[..., Schedule]
    partition: str = "capacity"


POLICIES: Registry[Policy] = Registry("schedule policy")


def register_policy(name: str, *, partition: str = "capacity", replace: bool = False):
    """Decorator registering `fn(graph, costs=None) -> Schedule` as policy `name`."""
    if partition not in ("capacity", "peers"):
        raise ValueError(f"partition must be 'capacity' or 'peers', got {partition!r}")

    def deco(fn):
        POLICIES.register(name, replace=replace)(Policy(name, fn, partition))
        return fn

    return deco


def fifo_links(graph: TaskGraph, compute: list[Task]) -> Schedule:
    """Complete a compute order with FIFO link orders: each A task queues when its input is made."""
    pos = {t: i for i, t in enumerate(compute)}
    order: dict[str, tuple[Task, ...]] = {COMPUTE: tuple(compute)}
    for link in graph.links:
        comm = [t for t in graph.tasks if t.kind == "A" and t.link == link]
        comm.sort(key=lambda t: (max(pos[d] for d in graph.deps[t]), t.phase, t.chunk))
        order[link] = tuple(comm)
    return Schedule(order)


def _c(p: int, i: int) -> Task:
    return Task("C", p, i)


def _d(p: int, i: int) -> Task:
    return Task("D", p, i)


@register_policy("sequential")
def sequential(graph: TaskGraph, costs=None) -> Schedule:
    compute = []
    for i in range(graph.chunks):
        compute += [_c(1, i), _d(1, i), Task("E", 0, i), _c(2, i), _d(2, i)]
    return fifo_links(graph, compute)


@register_policy("tutel")
def tutel(graph: TaskGraph, costs=None) -> Schedule:
    r = graph.chunks
    compute = [_c(1, i) for i in range(r)]
    for i in range(r):
        compute += [_d(1, i), Task("E", 0, i), _c(2, i)]
        if i > 0:
            compute.append(_d(2, i - 1))
    compute.append(_d(2, r - 1))
    return fifo_links(graph, compute)


@register_policy("schemoe")
def schemoe(graph: TaskGraph, costs=None) -> Schedule:
    r = graph.chunks
    compute = [_c(1, i) for i in range(r)]
    for i in range(r):
        compute += [_d(1, i), Task("E", 0, i), _c(2, i)]
    compute += [_d(2, i) for i in range(r)]
    return fifo_links(graph, compute)


@register_policy("fastermoe", partition="peers")
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
