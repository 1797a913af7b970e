"""Tasks, task graphs and schedules: plain data with a compact text form.

One MoE layer call, cut into r chunks, is r chains of seven tasks:

    C1.i -> A1.i -> D1.i -> E.i -> C2.i -> A2.i -> D2.i

C = compress, A = all-to-all, D = decompress, E = expert; phase 1 is the dispatch exchange and
phase 2 the combine exchange. Backward is the same chain run on gradients (phase 1 carries the
gradient of the combine output to the experts, phase 2 brings input gradients back), so one graph
type and every policy serve both directions. An all-to-all that drives two links (Pipe-A2A) has one
A task per link: "A1.3@intra", "A1.3@inter"; D waits for all of them.

A Schedule gives, for each resource ("compute" and every link), the order of its tasks:

    compute: C1.0 C1.1 D1.0 E.0 C2.0 D1.1 E.1 C2.1 D2.0 D2.1
    net: A1.0 A1.1 A2.0 A2.1

`Schedule.parse(str(s)) == s`. The executor, the deadlock check and the simulator consume the
same Schedule under one issue rule (`walk`).

Stack tasks (scheduling/stack.py: blocks of a model, a batch cut into micro-chunks) carry a block
and a micro-chunk index, printed as a prefix when either is not 0: "b1.m2.C1.0" is C1.0 of block
1's MoE region for micro-chunk 2. Two compute kinds frame a block's region: "AT" (pre-MoE compute:
norm, attention, residual, router, encode) and "PO" (post-MoE: decode and residual), e.g.
"b0.m1.AT"; "AR.k" is gradient all-reduce bucket k, a transfer on a link like A. A task of block
0 and micro-chunk 0 prints as it always has ("C1.0", "E.2").

"S" is the shared experts' task (MoEConfig.shared): one per layer call, on the compute resource,
over all of the call's tokens, with no dependency on any exchange, so a policy can run it while
the dispatch (forward) or the gradient exchanges (backward) are on the wire. One task, not one
per chunk: it needs nothing a chunk brings, and one [T, M] GEMM chain is cheaper than r smaller
ones; a single task already fills the compute thread's first wait, with the rest of the
dispatches still queued behind it on the link. Its output is added to the combined output.
A graph has it only when built with `shared=True`.

Task kinds, phases, directions and partitions are str/int-valued enums: `Kind.C == "C"`,
`Phase.DISPATCH == 1`, `Direction.FORWARD == "forward"`, so the text form and plain literals
still compare equal.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..routing.layout import Partition

__all__ = [
    "COMPUTE",
    "SHARED",
    "Direction",
    "Kind",
    "Partition",
    "Phase",
    "Schedule",
    "Task",
    "TaskGraph",
    "chunk_deps",
    "walk",
]

COMPUTE = "compute"


class Kind(str, enum.Enum):
    """What a task does: C compress, A all-to-all, D decompress, E expert, S shared experts; at
    stack level AT pre-MoE compute of a block (attention ...), PO post-MoE compute, AR a
    gradient all-reduce."""

    C = "C"
    A = "A"
    D = "D"
    E = "E"
    S = "S"
    AT = "AT"
    PO = "PO"
    AR = "AR"

    def __str__(self) -> str:
        return self.value


class Phase(enum.IntEnum):
    """Which exchange a task belongs to: the dispatch (1), the combine (2); experts are 0."""

    EXPERT = 0
    DISPATCH = 1
    COMBINE = 2


class Direction(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"

    def __str__(self) -> str:
        return self.value


def _enum(cls, value, what: str):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what} must be one of {[m.value for m in cls]}, got {value!r}") from None


_TRANSFERS = (Kind.A, Kind.AR)  # the kinds that run on a link
_EXCHANGE = (Kind.C, Kind.A, Kind.D)  # the kinds with a phase 1 or 2
_WHOLE = (Kind.AT, Kind.PO, Kind.S)  # one per block and micro-chunk: no chunk index
_TEXT = re.compile(r"^(?:b(\d+)\.m(\d+)\.)?(AT|PO|AR|[CADES])(\d*)(?:\.(\d+))?(?:@(.+))?$")


@dataclass(frozen=True, order=True)
class Task:
    """One task. kind (Kind); phase 1 or 2 for C/A/D (0 otherwise); chunk index (the bucket of
    an AR task; 0 for AT/PO); link for transfers (A, AR); block and micro-chunk (stack tasks)."""

    kind: Kind
    phase: Phase
    chunk: int
    link: str | None = None
    block: int = 0
    micro: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _enum(Kind, self.kind, "task kind"))
        object.__setattr__(self, "phase", _enum(Phase, self.phase, "task phase"))
        if (self.kind in _EXCHANGE) == (self.phase == Phase.EXPERT):
            raise ValueError(f"bad phase {int(self.phase)} for task kind {self.kind}")
        if (self.link is not None) != (self.kind in _TRANSFERS):
            raise ValueError(
                f"only transfers (A, AR) have a link, got {self.kind} with link {self.link!r}"
            )
        for name in ("chunk", "block", "micro"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"task {name} must be an int >= 0, got {v!r}")
        if self.kind in _WHOLE and self.chunk:
            raise ValueError(f"{self.kind} tasks have no chunk, got chunk {self.chunk}")

    @property
    def is_comm(self) -> bool:
        return self.kind in _TRANSFERS

    @property
    def resource(self) -> str:
        return self.link if self.kind in _TRANSFERS else COMPUTE

    def __str__(self) -> str:
        if self.kind in _WHOLE:
            name = str(self.kind)
        elif self.kind in _EXCHANGE:
            name = f"{self.kind}{int(self.phase)}.{self.chunk}"
        else:
            name = f"{self.kind}.{self.chunk}"
        at = f"@{self.link}" if self.link is not None and self.link != "net" else ""
        where = f"b{self.block}.m{self.micro}." if (self.block, self.micro) != (0, 0) else ""
        return f"{where}{name}{at}"

    @classmethod
    def parse(cls, text: str, default_link: str = "net") -> Task:
        m = _TEXT.match(text)
        try:
            if m is None:
                raise ValueError(text)
            block, micro, kind, phase, chunk, link = m.groups()
            kind = Kind(kind)
            if (chunk is None) != (kind in _WHOLE) or (link and kind not in _TRANSFERS):
                raise ValueError(text)
            return cls(
                kind,
                int(phase or 0),
                int(chunk or 0),
                (link or default_link) if kind in _TRANSFERS else None,
                int(block or 0),
                int(micro or 0),
            )
        except ValueError:
            raise ValueError(
                f"cannot parse task {text!r}; expected e.g. 'C1.0', 'E.2', 'A2.1@inter', 'S', "
                "'b1.m0.AT', 'AR.3'"
            ) from None


SHARED = Task(Kind.S, Phase.EXPERT, 0)  # the shared experts' task of a layer call

_CHAIN = ((Kind.C, 1), (Kind.A, 1), (Kind.D, 1), (Kind.E, 0), (Kind.C, 2), (Kind.A, 2), (Kind.D, 2))


def chunk_deps(
    deps: dict[Task, tuple[Task, ...]],
    chunk: int,
    links: tuple[str, ...],
    after: tuple[Task, ...] = (),
    block: int = 0,
    micro: int = 0,
) -> Task:
    """Add one chunk's region tasks to `deps`, in this order: C1 (after `after`), A1 on every
    link, D1, E, C2, A2 on every link, D2, each after the step before; return D2 (the chunk's
    last task). A region's graph and the stack's share this chain."""
    prev = after
    for kind, phase in _CHAIN:
        step = tuple(
            Task(kind, phase, chunk, ln, block, micro)
            for ln in (links if kind == Kind.A else (None,))
        )
        deps.update({t: prev for t in step})
        prev = step
    return prev[0]


@dataclass(frozen=True)
class TaskGraph:
    """Tasks and dependencies of one layer call (forward or backward).

    Args:
        chunks: r.
        links: the resources of the all-to-all algorithm, e.g. ("net",) or ("intra", "inter").
        direction: Direction (same graph both ways; the executor maps tasks differently).
        partition: how chunks cut the work: Partition.CAPACITY (token rows of every expert) or
            Partition.PEERS (groups of destination ranks, FasterMoE's smart schedule).
        shared: the layer has shared experts: one more task, S, depending on nothing.
    """

    chunks: int
    links: tuple[str, ...] = ("net",)
    direction: Direction = Direction.FORWARD
    partition: Partition = Partition.CAPACITY
    shared: bool = False
    deps: dict[Task, tuple[Task, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if not self.links:
            raise ValueError("an all-to-all needs at least one link")
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "direction", _enum(Direction, self.direction, "direction"))
        object.__setattr__(self, "partition", _enum(Partition, self.partition, "partition"))
        deps: dict[Task, tuple[Task, ...]] = {}
        for i in range(self.chunks):
            chunk_deps(deps, i, self.links)
        if self.shared:
            deps[SHARED] = ()
        object.__setattr__(self, "deps", deps)

    @property
    def tasks(self) -> list[Task]:
        return list(self.deps)

    def resources(self) -> tuple[str, ...]:
        return (COMPUTE, *self.links)


@dataclass(frozen=True)
class Schedule:
    """Per-resource task order. `order` maps resource name -> tuple of tasks."""

    order: dict[str, tuple[Task, ...]]

    def __str__(self) -> str:
        return "\n".join(f"{res}: {' '.join(map(str, ts))}" for res, ts in self.order.items())

    @classmethod
    def parse(cls, text: str) -> Schedule:
        order: dict[str, tuple[Task, ...]] = {}
        for line in text.strip().splitlines():
            res, sep, body = line.partition(":")
            if not sep:
                raise ValueError(f"schedule line {line!r} needs 'resource: tasks'")
            res = res.strip()
            default = res if res != COMPUTE else "net"
            order[res] = tuple(Task.parse(t, default) for t in body.split())
        return cls(order)

    def check(self, graph: TaskGraph) -> None:
        """Raise ValueError unless this schedule runs `graph` without deadlock.

        Each task must appear exactly once, on its own resource; and walking the compute order
        under the issue rule (`walk`: each link issues its tasks in order as soon as their
        inputs exist) must never reach a compute task whose input transfer cannot have been
        issued. The error shows the schedule with the failing step marked.
        """
        want = set(graph.tasks)
        seen = [t for ts in self.order.values() for t in ts]
        if len(seen) != len(set(seen)) or set(seen) != want:
            missing, extra = want - set(seen), set(seen) - want
            raise ValueError(
                f"schedule must list each task once: missing {sorted(map(str, missing))}, "
                f"unexpected {sorted(map(str, extra))}"
            )
        for res, ts in self.order.items():
            bad = [str(t) for t in ts if t.resource != res]
            if bad:
                raise ValueError(f"tasks {bad} are not on resource {res!r}")
        reached: set[Task] = set()
        for issued, t in walk(self, graph):
            reached.update(issued)
            if t is None:
                break
            missing = [str(d) for d in graph.deps[t] if d not in reached]
            if missing:
                raise ValueError(
                    f"schedule deadlocks: {t} needs {missing}, which cannot start\n"
                    + self.marked(t)
                )
            reached.add(t)

    def marked(self, task: Task) -> str:
        """The text form with `task` marked `>>task<<` (for error messages)."""
        return "\n".join(
            f"{res}: " + " ".join(f">>{t}<<" if t == task else str(t) for t in ts)
            for res, ts in self.order.items()
        )


def walk(schedule: Schedule, graph: TaskGraph) -> Iterator[tuple[list[Task], Task | None]]:
    """The issue rule, the one the executor, the deadlock check and the simulator all follow.

    Yields `(issued, task)` for each compute task of the schedule in its order, then once
    `(issued, None)`: `issued` are the transfers to post just before `task` runs (after the last
    compute task for None). A link posts its transfers in the schedule's order, each as soon as
    its inputs exist (every compute input has been yielded, every transfer input posted) and
    every transfer before it on that link was posted; posting never waits for the link to be
    free: the link works through its queue first-come first-served. The consumer runs `task`
    before asking for the next item (a compute task counts as done once it has been yielded).
    """
    links = [res for res in schedule.order if res != COMPUTE]
    heads = dict.fromkeys(links, 0)
    done: set[Task] = set()

    def ready() -> list[Task]:
        out = []
        for link in links:
            q = schedule.order[link]
            while heads[link] < len(q) and all(d in done for d in graph.deps[q[heads[link]]]):
                out.append(q[heads[link]])
                done.add(q[heads[link]])
                heads[link] += 1
        return out

    for t in schedule.order.get(COMPUTE, ()):
        yield ready(), t
        done.add(t)
    yield ready(), None
