"""Task timelines: record each task's real start and end on each rank, write a Chrome trace (opens
in Perfetto / chrome://tracing) and a PNG Gantt chart with one row per resource per rank.

    with schemoe.trace.record() as tl:
        y, aux = layer(x); (y.sum() + aux).backward()
    tl.save("run")            # run.json (+ run.png with matplotlib), all ranks gathered on rank 0

Transfers are timed from the moment they are issued to the moment the executor saw them complete
(it polls after every compute task while tracing, and at the latest when the data is needed), so a
transfer's end can be late by up to one compute task. On CUDA these are host times (not yet run on
CUDA; kernels would need events).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["Event", "Mark", "Timeline", "active", "clock", "gantt", "record"]

_ACTIVE: Timeline | None = None


def clock(device) -> float:
    """Host seconds after `device`'s queued work is done: time.perf_counter(), preceded on CUDA
    by a host sync (not yet run on CUDA). For timing whole regions (policy "auto"'s trials)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class Event:
    rank: int
    direction: str
    task: str
    resource: str
    start: float
    end: float


@dataclass(frozen=True)
class Mark:
    """A recorded span that is not a region's Task: dense compute ("AT.3" attention of block 3,
    "FFN.2") or a gradient bucket's all-reduce ("AR.0") on the network."""

    name: str
    resource: str

    def __str__(self) -> str:
        return self.name


@dataclass
class Timeline:
    rank: int = 0
    origin: float = field(default_factory=time.perf_counter)
    events: list[Event] = field(default_factory=list)

    def add(self, direction: str, task, t0: float, t1: float) -> None:
        self.events.append(
            Event(
                self.rank, direction, str(task), task.resource, t0 - self.origin, t1 - self.origin
            )
        )

    def gathered(self) -> list[Event]:
        """Every rank's events (collective when distributed; the result is valid on all ranks).

        Clocks are per process; each rank's times are relative to its own `record()` entry,
        which the ranks reach together when the call before it ends in a collective."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return list(self.events)
        allev: list[list[Event]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(allev, self.events)
        return [e for evs in allev for e in evs]

    def chrome(self, events: list[Event] | None = None) -> dict:
        evs = self.events if events is None else events
        rows = [
            {
                "name": e.task,
                "cat": e.direction,
                "ph": "X",
                "pid": e.rank,
                "tid": e.resource,
                "ts": e.start * 1e6,
                "dur": max(e.end - e.start, 0.0) * 1e6,
            }
            for e in evs
        ]
        return {"traceEvents": rows, "displayTimeUnit": "ms"}

    def save(self, path: str) -> list[str]:
        """Write path.json (and path.png if matplotlib is importable) on rank 0. Collective."""
        evs = self.gathered()
        if dist.is_initialized() and dist.get_rank() != 0:
            return []
        written = [f"{path}.json"]
        with open(written[0], "w") as f:
            json.dump(self.chrome(evs), f)
        try:
            gantt(evs, f"{path}.png")
            written.append(f"{path}.png")
        except ImportError:
            pass
        return written


class _Bound:
    def __init__(self, tl: Timeline, direction: str) -> None:
        self.tl, self.direction = tl, direction

    def record(self, task, t0: float, t1: float) -> None:
        self.tl.add(self.direction, task, t0, t1)


@contextmanager
def record() -> Iterator[Timeline]:
    """Record every scheduled task run inside the block."""
    global _ACTIVE
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    prev, _ACTIVE = _ACTIVE, Timeline(rank=rank)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = prev


def active(direction: str) -> _Bound | None:
    """The recorder for tasks of `direction`, or None when not tracing."""
    return None if _ACTIVE is None else _Bound(_ACTIVE, direction)


def gantt(events: list[Event], path: str, title: str = "") -> None:
    """PNG Gantt chart: one row per (rank, resource); forward solid, backward hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(
        {(e.rank, e.resource) for e in events}, key=lambda r: (r[0], r[1] != "compute", r[1])
    )
    index = {row: i for i, row in enumerate(rows)}
    colors = {"C": "#8fbc8f", "A": "#4682b4", "D": "#daa520", "E": "#cd5c5c", "AR": "#9370db",
              "AT": "#c0c0c0", "FFN": "#a9a9a9"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.2))
    for e in events:
        y = index[(e.rank, e.resource)]
        ax.barh(
            y,
            (e.end - e.start) * 1e3,
            left=e.start * 1e3,
            height=0.8,
            color=colors.get(e.task.split(".")[0], colors.get(e.task[0], "gray")),
            edgecolor="black",
            linewidth=0.3,
            hatch="//" if e.direction == "backward" else None,
        )
        if (e.end - e.start) * 1e3 > 0:
            ax.text((e.start + e.end) / 2 * 1e3, y, e.task, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)), [f"rank {r} {res}" for r, res in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or "schemoe task timeline (hatched = backward)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
