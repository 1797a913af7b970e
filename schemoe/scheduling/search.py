"""The `search` policy: the compute order with the smallest simulated makespan.

A compute order is any interleaving of the r chains C1.i D1.i E.i C2.i D2.i (each chain in its
own order, and the shared-experts task S, when the graph has it, a chain of its own, free to
go anywhere); links then run first-come first-served (`fifo_links`), which never deadlocks since a
transfer queues in the order its input is produced. Theorem 1 of the paper proves the schemoe
order optimal for equal chunks, one FIFO link and free overheads; the simulator also sees what
the theorem leaves out: two links (Pipe-A2A), unequal compress/decompress costs in backward,
the fastermoe/peers chunk sizes, per-task overhead. The search:

  1. seeds: the sequential, tutel and schemoe orders (so the result is never worse than schemoe
     in simulation: it is returned unless another order is strictly faster);
  2. r <= 2: every interleaving (252 at r = 2); else a beam search that builds the order task by
     task, scoring a prefix by the makespan of the prefix completed in schemoe order;
  3. local search on the best: move one task to another place in its chain's window while the
     makespan improves, within an evaluation budget.

With `costs=None` there is nothing to search: it returns the schemoe order (a layer configured
with policy "search" and no cost model says so once, on the "schemoe" logger). Results are cached
per (graph, task costs): values, not object identities.
"""

from __future__ import annotations

import itertools

from . import simulator
from .policies import fifo_links, register_policy, schemoe, sequential, tutel
from .tasks import COMPUTE, SHARED, Kind, Phase, Schedule, Task, TaskGraph

__all__ = ["best_order", "interleavings", "search"]

_CACHE: dict[tuple, Schedule] = {}
BEAM = 6
MAX_EVALS = 1500


def _chains(graph: TaskGraph) -> list[list[Task]]:
    shared = [[SHARED]] if graph.shared else []
    return shared + [
        [
            Task(Kind.C, Phase.DISPATCH, i),
            Task(Kind.D, Phase.DISPATCH, i),
            Task(Kind.E, Phase.EXPERT, i),
            Task(Kind.C, Phase.COMBINE, i),
            Task(Kind.D, Phase.COMBINE, i),
        ]
        for i in range(graph.chunks)
    ]


def interleavings(chains: list[list[Task]]):
    """Every order of the tasks that keeps each chain's own order (a generator)."""
    n = sum(len(c) for c in chains)
    pos = [0] * len(chains)
    out: list[Task] = []

    def rec():
        if len(out) == n:
            yield list(out)
            return
        for k, c in enumerate(chains):
            if pos[k] < len(c):
                out.append(c[pos[k]])
                pos[k] += 1
                yield from rec()
                pos[k] -= 1
                out.pop()

    return rec()


class _Evaluator:
    def __init__(self, graph: TaskGraph, costs) -> None:
        self.graph, self.costs = graph, simulator.task_costs(costs, graph)
        self.evals = 0

    def __call__(self, order: list[Task]) -> float:
        self.evals += 1
        sched = fifo_links(self.graph, order)
        return simulator.run(sched, self.graph, self.costs, record=False)[0]


def best_order(graph: TaskGraph, costs) -> tuple[list[Task], float]:
    """(compute order, simulated makespan) of the best order found; ties keep schemoe's."""
    ev = _Evaluator(graph, costs)
    ref = list(schemoe(graph).order[COMPUTE])
    best, best_t = ref, ev(ref)
    for seed in (sequential(graph), tutel(graph)):
        order = list(seed.order[COMPUTE])
        t = ev(order)
        if t < best_t - 1e-12:
            best, best_t = order, t
    chains = _chains(graph)
    if graph.chunks <= 2:
        for order in interleavings(chains):
            t = ev(order)
            if t < best_t - 1e-12:
                best, best_t = order, t
        return best, best_t
    rank = {t: i for i, t in enumerate(ref)}
    chain_of = {t: c for c in chains for t in c}

    def complete(prefix: list[Task]) -> list[Task]:
        seen = set(prefix)
        return prefix + sorted((t for t in ref if t not in seen), key=rank.__getitem__)

    # 2. Beam search over prefixes (state: tasks taken from each chain).
    beam: list[tuple[float, list[Task], tuple[int, ...]]] = [(0.0, [], (0,) * len(chains))]
    for _ in range(len(ref)):
        nxt: dict[tuple[int, ...], tuple[float, list[Task]]] = {}
        for _, prefix, pos in beam:
            for k, c in enumerate(chains):
                if pos[k] == len(c):
                    continue
                p2 = prefix + [c[pos[k]]]
                key = pos[:k] + (pos[k] + 1,) + pos[k + 1 :]
                full = complete(p2)
                t = ev(full)
                if t < best_t - 1e-12:
                    best, best_t = full, t
                if key not in nxt or t < nxt[key][0]:
                    nxt[key] = (t, p2)
        beam = sorted(((t, p, k) for k, (t, p) in nxt.items()), key=lambda x: x[0])[:BEAM]
    # 3. Local search: move one task within its chain's window.
    improved = True
    while improved and ev.evals < MAX_EVALS:
        improved = False
        where = {t: i for i, t in enumerate(best)}
        for i, j in itertools.permutations(range(len(best)), 2):
            if ev.evals >= MAX_EVALS:
                break
            t = best[i]
            chain = chain_of[t]
            k = chain.index(t)
            lo = where[chain[k - 1]] if k > 0 else -1
            hi = where[chain[k + 1]] if k + 1 < len(chain) else len(best)
            if not lo < j < hi:
                continue
            cand = best[:i] + best[i + 1 :]
            cand.insert(j, t)
            tc = ev(cand)
            if tc < best_t - 1e-12:
                best, best_t, improved = cand, tc, True
                break
    return best, best_t


@register_policy("search")
def search(graph: TaskGraph, costs=None) -> Schedule:
    """The best compute order under the simulator with `costs` (a CostModel, TaskCosts or
    mapping Task -> seconds), FIFO links. costs=None: the schemoe order (nothing to search)."""
    if costs is None:
        return schemoe(graph)
    tc = simulator.task_costs(costs, graph)
    key = (graph, tuple(tc.durations[t] for t in graph.tasks), tc.overhead)
    if key not in _CACHE:
        _CACHE[key] = fifo_links(graph, best_order(graph, tc)[0])
    return _CACHE[key]
