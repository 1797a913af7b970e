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

Task kinds, phases, directions and partitions are str/int-valued enums: `Kind.C == "C"`,
`Phase.DISPATCH == 1`, `Direction.FORWARD == "forward"`, so the text form and plain literals
still compare equal.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..layout import Partition

__all__ = [
    "COMPUTE",
    "Direction",
    "Kind",
    "Partition",
    "Phase",
    "Schedule",
    "Task",
    "TaskGraph",
    "walk",
]

COMPUTE = "compute"


class Kind(str, enum.Enum):
    """What a task does: C compress, A all-to-all (the only transfer), D decompress, E expert."""

    C = "C"
    A = "A"
    D = "D"
    E = "E"

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


@dataclass(frozen=True, order=True)
class Task:
    """One task. kind in C/A/D/E; phase 1 or 2 (0 for E); chunk index; link for A tasks."""

    kind: Kind
    phase: Phase
    chunk: int
    link: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _enum(Kind, self.kind, "task kind"))
        object.__setattr__(self, "phase", _enum(Phase, self.phase, "task phase"))
        if (self.kind == Kind.E) != (self.phase == Phase.EXPERT):
            raise ValueError(f"bad phase {int(self.phase)} for task kind {self.kind}")
        if (self.link is not None) != (self.kind == "A"):
            raise ValueError(f"only A tasks have a link, got {self.kind} with link {self.link!r}")

    @property
    def is_comm(self) -> bool:
        return self.kind == "A"

    @property
    def resource(self) -> str:
        return self.link if self.kind == "A" else COMPUTE

    def __str__(self) -> str:
        name = "E" if self.kind == Kind.E else f"{self.kind}{int(self.phase)}"
        at = f"@{self.link}" if self.link is not None and self.link != "net" else ""
        return f"{name}.{self.chunk}{at}"

    @classmethod
    def parse(cls, text: str, default_link: str = "net") -> Task:
        try:
            head, rest = text.split(".", 1)
            chunk_s, _, link = rest.partition("@")
            kind, phase = head[0], (int(head[1:]) if len(head) > 1 else 0)
            if kind == "A":
                return cls(kind, phase, int(chunk_s), link or default_link)
            if link:
                raise ValueError(text)
            return cls(kind, phase, int(chunk_s))
        except (ValueError, IndexError):
            raise ValueError(
                f"cannot parse task {text!r}; expected e.g. 'C1.0', 'E.2', 'A2.1@inter'"
            ) from None


@dataclass(frozen=True)
class TaskGraph:
    """Tasks and dependencies of one layer call (forward or backward).

    Args:
        chunks: r.
        links: the resources of the all-to-all algorithm, e.g. ("net",) or ("intra", "inter").
        direction: Direction (same graph both ways; the executor maps tasks differently).
        partition: how chunks cut the work: Partition.CAPACITY (token rows of every expert) or
            Partition.PEERS (groups of destination ranks, FasterMoE's smart schedule).
    """

    chunks: int
    links: tuple[str, ...] = ("net",)
    direction: Direction = Direction.FORWARD
    partition: Partition = Partition.CAPACITY
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
            c1, d1, e, c2, d2 = (
                Task("C", 1, i),
                Task("D", 1, i),
                Task("E", 0, i),
                Task("C", 2, i),
                Task("D", 2, i),
            )
            a1 = tuple(Task("A", 1, i, ln) for ln in self.links)
            a2 = tuple(Task("A", 2, i, ln) for ln in self.links)
            deps[c1] = ()
            deps.update({a: (c1,) for a in a1})
            deps[d1] = a1
            deps[e] = (d1,)
            deps[c2] = (e,)
            deps.update({a: (c2,) for a in a2})
            deps[d2] = a2
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
