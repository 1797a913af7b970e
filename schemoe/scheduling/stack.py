"""Stack-level tasks: the blocks of a model as stages, a batch cut into m micro-chunks.

Each block b has, for each micro-chunk j, the chain

    forward:   AT -> its MoE region (C1 A1 D1 E C2 A2 D2 per chunk) -> PO     (then block b+1)
    backward:  PO -> the region on gradients                         -> AT     (then block b-1)

AT is the block's pre-MoE compute (norm, attention, residual, router, encode), PO its post-MoE
compute (decode, residual). Micro-chunks are independent (the cut is along the batch), so only
the chain of one micro-chunk orders its tasks; a policy interleaves the chains. In backward,
gradient all-reduce bucket k ("AR.k", on the last link) waits for the AT backward of block
`buckets[k]` of every micro-chunk (the bucket holds that block's dense weights).

A stack graph has the TaskGraph interface the executor, `Schedule.check`, `walk` and the
simulator use (`deps`, `tasks`, `links`, `direction`), so they consume it unchanged.

Stack policies (STACK_POLICIES) take the graph and, for each block, the compute order of its
region's own schedule (block 0 / micro-chunk 0 tasks, as `MoELayer` builds it), and return a
Schedule; links run FIFO (`stack_fifo_links`):

    sequential  micro-chunk 0 through every block, then micro-chunk 1, ...: today's behaviour
    wavefront   each chain cut into segments at the points where it waits for a transfer
                (AT + C1s | D1 E C2 ... | D2s + PO per block); step t runs segment t - j of
                every micro-chunk j: first a head (AT + C1s, which waits for no transfer),
                then the others newest micro-chunk first (the order their transfers were
                posted in the step before), so micro-chunk j+1's attention runs while
                micro-chunk j's dispatch is on the wire, and block b+1's attention of an
                earlier micro-chunk while a later one's combine is (Theorem 1's idea, one level
                up)
    search      the best of sequential and wavefront lags under a cost model (the simulator)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..registry import Registry
from . import simulator
from .tasks import COMPUTE, Direction, Kind, Phase, Schedule, Task, _enum, chunk_deps

__all__ = [
    "STACK_POLICIES",
    "StackGraph",
    "make_stack_schedule",
    "stack_fifo_links",
    "stack_task_costs",
]


def _at(b: int, j: int) -> Task:
    return Task(Kind.AT, Phase.EXPERT, 0, None, b, j)


def _po(b: int, j: int) -> Task:
    return Task(Kind.PO, Phase.EXPERT, 0, None, b, j)


@dataclass(frozen=True)
class StackGraph:
    """Tasks and dependencies of a stack of blocks over m micro-chunks (one direction).

    Args:
        chunks: r of each block's MoE region (its length is the number of blocks).
        micro: m, the micro-chunks.
        links: the resources of the all-to-all algorithm (the same for every block).
        direction: Direction.
        buckets: backward only: the block whose AT backward completes each gradient bucket.
    """

    chunks: tuple[int, ...]
    micro: int
    links: tuple[str, ...] = ("net",)
    direction: Direction = Direction.FORWARD
    buckets: tuple[int, ...] = ()
    deps: dict[Task, tuple[Task, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "buckets", tuple(self.buckets))
        object.__setattr__(self, "direction", _enum(Direction, self.direction, "direction"))
        if not self.chunks or any(not isinstance(r, int) or r < 1 for r in self.chunks):
            raise ValueError(f"chunks must be one int >= 1 per block, got {self.chunks}")
        if not isinstance(self.micro, int) or self.micro < 1:
            raise ValueError(f"micro-chunks must be an int >= 1, got {self.micro!r}")
        if not self.links:
            raise ValueError("an all-to-all needs at least one link")
        if self.buckets and self.direction != Direction.BACKWARD:
            raise ValueError("gradient buckets (AR tasks) belong to the backward graph")
        if any(not 0 <= b < self.blocks for b in self.buckets):
            raise ValueError(f"bucket blocks must be in [0, {self.blocks}), got {self.buckets}")
        fwd = self.direction == Direction.FORWARD
        deps: dict[Task, tuple[Task, ...]] = {}
        for j in range(self.micro):
            for b in self.block_order():
                head, tail = (_at(b, j), _po(b, j)) if fwd else (_po(b, j), _at(b, j))
                prev = b - 1 if fwd else b + 1
                if 0 <= prev < self.blocks:
                    deps[head] = (_po(prev, j) if fwd else _at(prev, j),)
                else:
                    deps[head] = ()
                ends = [
                    chunk_deps(deps, i, self.links, (head,), b, j) for i in range(self.chunks[b])
                ]
                deps[tail] = tuple(ends)
        for k, b in enumerate(self.buckets):
            deps[self.bucket(k)] = tuple(_at(b, j) for j in range(self.micro))
        object.__setattr__(self, "deps", deps)

    def bucket(self, k: int) -> Task:
        return Task(Kind.AR, Phase.EXPERT, k, self.links[-1])

    @property
    def blocks(self) -> int:
        return len(self.chunks)

    def block_order(self) -> list[int]:
        """Blocks in the order a micro-chunk meets them in this direction."""
        order = list(range(self.blocks))
        return order if self.direction == Direction.FORWARD else order[::-1]

    @property
    def tasks(self) -> list[Task]:
        return list(self.deps)

    def resources(self) -> tuple[str, ...]:
        return (COMPUTE, *self.links)


def stack_fifo_links(graph: StackGraph, compute: list[Task]) -> Schedule:
    """Complete a compute order with FIFO link orders: a transfer queues when its input is made
    (all-to-alls before a bucket made at the same point)."""
    pos = {t: i for i, t in enumerate(compute)}
    order: dict[str, tuple[Task, ...]] = {COMPUTE: tuple(compute)}
    for link in graph.links:
        comm = [t for t in graph.tasks if t.is_comm and t.link == link]
        comm.sort(
            key=lambda t: (
                max(pos[d] for d in graph.deps[t]),
                t.kind == Kind.AR,
                t.phase,
                t.chunk,
            )
        )
        order[link] = tuple(comm)
    return Schedule(order)


def _chain(graph: StackGraph, regions: Sequence[Sequence[Task]], j: int) -> list[list[Task]]:
    """Micro-chunk j's compute tasks as segments: per block (direction order) the head task and
    the region's tasks up to the first D1 | up to the first D2 | the rest and the tail task."""
    fwd = graph.direction == Direction.FORWARD
    out = []
    for b in graph.block_order():
        region = [replace(t, block=b, micro=j) for t in regions[b]]
        cuts = [
            next(n for n, t in enumerate(region) if t.kind == Kind.D and t.phase == p)
            for p in (Phase.DISPATCH, Phase.COMBINE)
        ]
        head, tail = (_at(b, j), _po(b, j)) if fwd else (_po(b, j), _at(b, j))
        out += [
            [head, *region[: cuts[0]]],
            region[cuts[0] : cuts[1]],
            [*region[cuts[1] :], tail],
        ]
    return out


def _check_regions(graph: StackGraph, regions: Sequence[Sequence[Task]]) -> None:
    if len(regions) != graph.blocks:
        raise ValueError(f"need one region order per block ({graph.blocks}), got {len(regions)}")


STACK_POLICIES: Registry[Callable[..., Schedule]] = Registry("stack policy")


@STACK_POLICIES.register("sequential")
def sequential(graph: StackGraph, regions: Sequence[Sequence[Task]], costs=None) -> Schedule:
    _check_regions(graph, regions)
    compute = [t for j in range(graph.micro) for seg in _chain(graph, regions, j) for t in seg]
    return stack_fifo_links(graph, compute)


def wavefront_order(graph: StackGraph, regions: Sequence[Sequence[Task]], lag: int = 1):
    """The wavefront compute order: at step t, segment t - lag j of micro-chunk j; heads (the
    segments that start with the block's head task) first, the rest newest micro-chunk first
    (module docstring)."""
    _check_regions(graph, regions)
    head = Kind.AT if graph.direction == Direction.FORWARD else Kind.PO
    chains = [_chain(graph, regions, j) for j in range(graph.micro)]
    n = len(chains[0])
    compute = []
    for step in range(n + lag * (graph.micro - 1)):
        segs = [
            chains[j][q] for j in reversed(range(graph.micro)) if 0 <= (q := step - lag * j) < n
        ]
        for seg in sorted(segs, key=lambda seg: seg[0].kind != head):
            compute += seg
    return compute


@STACK_POLICIES.register("wavefront")
def wavefront(graph: StackGraph, regions: Sequence[Sequence[Task]], costs=None) -> Schedule:
    return stack_fifo_links(graph, wavefront_order(graph, regions))


@STACK_POLICIES.register("search")
def search(graph: StackGraph, regions: Sequence[Sequence[Task]], costs=None) -> Schedule:
    """The candidate with the smallest simulated makespan: sequential and wavefront with lags
    1..3 (segments a micro-chunk trails the one before it). `costs`: anything the simulator
    takes for this graph (a mapping Task -> seconds, e.g. `stack_task_costs`)."""
    if costs is None:
        raise ValueError("stack policy 'search' needs a cost model (costs=...)")
    candidates = [sequential(graph, regions)] + [
        stack_fifo_links(graph, wavefront_order(graph, regions, lag)) for lag in (1, 2, 3)
    ]
    return min(candidates, key=lambda s: simulator.run(s, graph, costs, record=False)[0])


def make_stack_schedule(
    policy: str, graph: StackGraph, regions: Sequence[Sequence[Task]], costs=None
) -> Schedule:
    """Run stack policy `policy` and check the result runs `graph` without deadlock."""
    sched = STACK_POLICIES.get(policy)(graph, regions, costs)
    sched.check(graph)
    return sched


def stack_task_costs(
    graph: StackGraph,
    regions: Sequence[Mapping[Task, float]],
    *,
    at: float | Sequence[float],
    po: float | Sequence[float] = 0.0,
    ar: float | Sequence[float] = 0.0,
) -> dict[Task, float]:
    """Seconds per task of a stack graph from per-block parts: `regions[b]` the costs of block
    b's region tasks for ONE micro-chunk (block 0 / micro 0 task names, e.g. a CostModel's
    `task_costs(TaskGraph(r, ...)).durations` at T/m tokens); `at` / `po` the pre- and post-MoE
    compute of one micro-chunk (one value, or one per block; e.g. `costmodel.attention_seconds`);
    `ar` each bucket's all-reduce (one value, or one per bucket)."""

    def per(v, n):
        return [float(v)] * n if isinstance(v, (int, float)) else [float(x) for x in v]

    at_b, po_b, ar_k = per(at, graph.blocks), per(po, graph.blocks), per(ar, len(graph.buckets))
    out: dict[Task, float] = {}
    for t in graph.tasks:
        if t.kind == Kind.AT:
            out[t] = at_b[t.block]
        elif t.kind == Kind.PO:
            out[t] = po_b[t.block]
        elif t.kind == Kind.AR:
            out[t] = ar_k[t.chunk]
        else:
            out[t] = regions[t.block][replace(t, block=0, micro=0)]
    return out
