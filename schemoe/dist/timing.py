"""The one timer of candidates: interleaved rounds, barrier-synced, the slowest rank's time.

`measure` runs candidates interleaved (A B C A B C ...) so that drift (thermal, a noisy neighbour,
a filling queue) hits all of them alike; before each sample every rank meets at a barrier, and a
sample's time is the slowest rank's, gathered once at the end (one all_reduce, outside the timing).
`schemoe bench` (bench/timer.py adds its report), `schemoe profile` and the auto tuner's quick
profile (`schemoe.tuning`) all time with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .devices import comm_device, control_tensor

__all__ = ["Stats", "interleaved", "measure", "percentile"]


@dataclass(frozen=True)
class Stats:
    """Summary of one candidate's samples, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: tuple[float, ...]

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Stats:
        if not samples_ms:
            raise ValueError("Stats.of needs at least one sample")
        s = tuple(float(v) for v in samples_ms)
        return cls(percentile(s, 50), percentile(s, 10), percentile(s, 90), s)

    def row(self) -> dict[str, float]:
        return {"median_ms": self.median_ms, "p10_ms": self.p10_ms, "p90_ms": self.p90_ms}


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values or not 0 <= q <= 100:
        raise ValueError(f"percentile needs values and 0 <= q <= 100, got {len(values)} and {q}")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def interleaved(names: Sequence[str], rounds: int) -> list[str]:
    """The run order: every candidate once per round, in the given order."""
    return [n for _ in range(rounds) for n in names]


def _sync(group: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def measure(
    candidates: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    repeats: int = 10,
    group: Any = None,
) -> dict[str, Stats]:
    """Time each candidate `repeats` times after `warmup` rounds, interleaved, barrier-synced.

    Collective: every rank of `group` must call it with the same candidate names. Each callable
    must finish its work before returning (wait on pending transfers). On NCCL (the backend's
    device is CUDA) each sample is timed with CUDA events around the call on the current stream;
    on gloo with the host clock.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    names = list(candidates)
    for name in interleaved(names, warmup):
        _sync(group)
        candidates[name]()
    cuda = comm_device(group).type == "cuda"
    ms = [[0.0] * len(names) for _ in range(repeats)]
    for i, name in enumerate(interleaved(names, repeats)):
        _sync(group)
        if cuda:  # the device's own clock: CUDA events on the current stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            candidates[name]()
            end.record()
            end.synchronize()  # host sync by design: the sample must be read
            ms[i // len(names)][i % len(names)] = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            candidates[name]()
            ms[i // len(names)][i % len(names)] = (time.perf_counter() - t0) * 1e3
    samples = control_tensor([v for row in ms for v in row], dtype=torch.float64, group=group)
    samples = samples.view(repeats, len(names))
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=group)  # the slowest rank counts
    return {n: Stats.of(samples[:, j].tolist()) for j, n in enumerate(names)}
