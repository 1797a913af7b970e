"""Runs a Schedule: compute tasks in order on the calling thread, transfers asynchronously.

Rules (`tasks.walk`, the one issue rule `Schedule.check` and the simulator follow too):
  * compute tasks run one at a time in the schedule's compute order;
  * each link issues its transfers in the schedule's order, each as soon as its inputs exist
    (after the compute task that makes them) and the transfers before it on that link were
    issued; issuing never blocks;
  * a compute task waits on a transfer only when it consumes it.

On CPU, gloo's worker threads move the bytes while this thread computes; on CUDA the transfers
run on the communicators' NCCL streams and compute on the current stream (not yet run on CUDA).

The work itself is supplied by a `TaskRunner`: `run(task)` for compute tasks, `start(task)` for
transfers (returns a Pending), `finish(task, result)` when a transfer is waited on. A `Tracer`
(see schemoe.trace), if given, records each task's start and end.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from .background import Background
from .tasks import Schedule, Task, TaskGraph, walk

__all__ = ["TaskRunner", "execute"]


class TaskRunner(Protocol):
    def run(self, task: Task) -> None: ...

    def start(self, task: Task) -> Any: ...

    def finish(self, task: Task, result: Any) -> None: ...


def _completed(pending: Any) -> bool:
    probe = getattr(pending, "is_completed", None)
    return bool(probe()) if probe is not None else False


def execute(
    schedule: Schedule,
    graph: TaskGraph,
    runner: TaskRunner,
    tracer=None,
    background: Background | None = None,
    *,
    yield_link: bool = True,
) -> None:
    """Execute every task of `graph` in the order `schedule` gives (checked beforehand), posting
    transfers under the issue rule (`walk`) and waiting on one only where a task consumes it.

    `background`: low-priority transfers (gradient buckets), pumped between tasks
    (scheduling/background.py); `yield_link`: posted only while none of this schedule's
    transfers is in flight (True), or as soon as the queue's window has room, sharing the link
    with them (False: what a micro-chunk stack does, step/runtime.py says why)."""
    inflight: dict[Task, Any] = {}
    started: dict[Task, float] = {}
    counted = background if yield_link else None  # the Background whose `busy` we count in

    def land(t: Task) -> None:
        result = inflight.pop(t).wait()
        if tracer is not None:
            tracer.record(t, started[t], time.perf_counter())
        runner.finish(t, result)
        if counted is not None:
            counted.busy -= 1

    try:
        for issued, t in walk(schedule, graph):
            for a in issued:
                started[a] = time.perf_counter()
                if counted is not None:
                    counted.busy += 1
                inflight[a] = runner.start(a)
            if t is None:
                break
            for d in graph.deps[t]:
                if d in inflight:
                    land(d)
            t0 = time.perf_counter()
            runner.run(t)
            if tracer is not None:
                tracer.record(t, t0, time.perf_counter())
            if tracer is not None or background is not None:
                # Transfers that finished while we computed: a truthful end time, a free link.
                for d in [d for d, p in inflight.items() if _completed(p)]:
                    land(d)
            if background is not None:
                background.pump()
        for d in list(inflight):
            land(d)
    finally:
        if counted is not None:
            counted.busy -= len(inflight)
        if background is not None:
            background.pump()
