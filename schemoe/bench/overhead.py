"""Executor overhead per task: `python -m schemoe.bench.overhead`.

Two figures, both on one process (no transfers, so nothing else is timed):
  * scheduler: `execute` over a Schedule with a runner whose tasks do nothing (the cost of the
    ordering logic itself, per task);
  * layer: one MoELayer forward+backward with r chunks minus the same layer with r = 1, divided
    by the extra tasks (what chunking costs in gathers, index_copy and small-GEMM inefficiency
    at a tiny shape, i.e. an upper bound on per-task cost).
Last line: one JSON object.
"""

from __future__ import annotations

import json
import time

import torch

from .. import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig
from ..collectives.base import Done
from ..dist.timing import Stats
from ..scheduling import TaskGraph, execute, make_schedule


class _NoOp:
    def run(self, t) -> None:
        pass

    def start(self, t):
        return Done(None)

    def finish(self, t, result) -> None:
        pass


def scheduler_us_per_task(r: int = 8, repeats: int = 200) -> float:
    g = TaskGraph(r)
    s = make_schedule("schemoe", g)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        execute(s, g, _NoOp())
        samples.append((time.perf_counter() - t0) * 1e6 / len(g.tasks))
    return Stats.of(samples).median_ms  # median of microseconds


def layer_us_per_task(r: int = 8, repeats: int = 30, tokens: int = 256, dim: int = 64) -> float:
    def make(chunks):
        torch.manual_seed(0)
        return MoELayer(
            MoEConfig(
                gate=GateConfig(num_experts=8, top_k=2),
                experts=ExpertConfig(model_dim=dim, hidden_dim=2 * dim),
                schedule=ScheduleConfig(policy="schemoe", chunks=chunks),
            )
        )

    layers = {1: make(1), r: make(r)}
    x = torch.randn(tokens, dim, requires_grad=True)
    times: dict[int, list[float]] = {1: [], r: []}
    for _ in range(repeats):
        for c, layer in layers.items():  # interleaved
            t0 = time.perf_counter()
            y, aux = layer(x)
            (y.sum() + aux).backward()
            times[c].append(time.perf_counter() - t0)
    extra = 2 * 7 * (r - 1)  # forward and backward graphs, 7 tasks per extra chunk
    d = Stats.of(times[r]).median_ms - Stats.of(times[1]).median_ms
    return d * 1e6 / extra


if __name__ == "__main__":
    torch.set_num_threads(1)
    res = {
        "scheduler_us_per_task": scheduler_us_per_task(),
        "layer_us_per_extra_task": layer_us_per_task(),
        "torch": torch.__version__,
    }
    print(
        f"executor: {res['scheduler_us_per_task']:.1f} us/task (ordering only); "
        f"layer: {res['layer_us_per_extra_task']:.1f} us per extra task at a tiny shape"
    )
    print(json.dumps(res))
