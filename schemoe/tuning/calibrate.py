"""The cost model's constants that no micro-benchmark isolates, fitted on real layer steps.

`schemoe profile` (measure.py) fits links, GEMMs, copies and codecs from micro-benchmarks, then
calls `calibrate` to time whole MoE layer steps (forward + backward) at the profiled shape, with
every rank measuring at once, and solve the model for what those steps add: the fixed cost per
step, the cost per task, the compute factor, when CPU ranks share cores `comm_cpu`, what each
all-to-all waits for the last rank (`skew`), and how much compute slows while a transfer
overlaps it (`overlap`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from ..config import ExpertConfig, GateConfig, MoEConfig, ParallelConfig, ScheduleConfig
from ..costmodel.hardware import Hardware
from ..costmodel.model import LayerShape
from ..costmodel.prediction import predict
from ..layer.moe import MoELayer

__all__ = ["calibrate", "fit_sharing"]

OVERLAP_R = 4  # chunks of the layer steps `skew` (sequential) and `overlap` (schemoe) use
SKEW_MAX = 0.05  # seconds: the most `skew` is solved up to


def _layer(shape, ranks_per_node: int, r: int, group=None, policy: str = "sequential"):
    """One training step (forward + backward) of an MoE layer of `shape`, `policy` at r chunks."""
    gate = GateConfig(
        num_experts=shape.experts, top_k=shape.top_k, capacity_factor=shape.capacity_factor
    )
    experts = ExpertConfig(model_dim=shape.model_dim, hidden_dim=shape.hidden_dim)
    schedule = ScheduleConfig(policy=policy, chunks=r)
    parallel = ParallelConfig(ranks_per_node=ranks_per_node)
    cfg = MoEConfig(gate=gate, experts=experts, parallel=parallel, schedule=schedule)
    layer = MoELayer(cfg, group=group)
    x = torch.randn(shape.tokens, shape.model_dim, requires_grad=True)

    def run():
        y, aux = layer(x)
        (y.sum() + aux).backward()

    return run


def _solve(f, target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) = target for an increasing f (bisection; clamped to the ends)."""
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _fit(hw: Hardware, shape, name: str, target: float, hi: float, policy: str, r: int):
    """`hw` with field `name` in [0, hi] such that the model's layer step (`policy`, r chunks)
    takes `target` seconds."""

    def step(value):
        return predict(replace(hw, **{name: value}), shape, policy, chunks=r).step_s

    return replace(hw, **{name: _solve(step, target, 0.0, hi)})


def fit_sharing(hw: Hardware, shape, t1: float, t4: float) -> Hardware:
    """`hw` with `comm_cpu` (when CPU ranks share cores) and `skew` such that the model's
    sequential layer step takes t1 seconds at r = 1 and t4 at r = OVERLAP_R: for each skew
    tried, comm_cpu fitted on t1; skew solved on t4 (nested bisection)."""

    def at(skew):
        out = replace(hw, skew=skew)
        return _fit(out, shape, "comm_cpu", t1, 1.0, "sequential", 1) if hw.host_cores else out

    def step(skew):
        return predict(at(skew), shape, "sequential", chunks=OVERLAP_R).step_s

    return at(_solve(step, t4, 0.0, SKEW_MAX))


def calibrate(
    hw: Hardware, topo, shape: LayerShape, repeats: int, timed: Callable[[dict, int], dict]
) -> Hardware:
    """The constants no micro-benchmark isolates, fitted on real layer steps (forward + backward),
    all ranks at once:

    - step_overhead: a tiny one-rank layer (T=256, D=64, E=8) at r = 1, minus the model;
    - compute_factor s and task_overhead o: the layer at `shape` on a one-rank group with a
      rank's share of the experts, E / P (its all-to-alls are local copies: compute only; tokens
      such that each expert gets P C rows, the GEMMs a rank runs in the distributed step; top-k
      at most E / P), at r = 1 and r = 8:
      t_r = s (m_r + o n_r), with m_r the model's step and n_r its tasks (o >= 0);
    - comm_cpu and skew: the layer at `shape` on all ranks, sequential at r = 1 and at r = 4
      (4x the all-to-alls, the same bytes and compute), solved together so the model's steps
      match both (`model.sharing_scale`; skew in [0, SKEW_MAX] on each transfer). comm_cpu is 0
      unless CPU ranks share cores;
    - overlap: the layer at `shape` on all ranks under schemoe at r = 4 (chunk i+1's compute
      under chunk i's transfers), solved so the model's step (the simulator's `overlap`)
      matches it, in [0, 2]. 0 on one rank (no transfer).

    `timed(candidates, repeats)` -> median seconds per candidate (measure.timed).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    solo = [dist.new_group([q]) for q in range(world)][rank]  # collective: all create all
    tiny = LayerShape(256, 64, 128, 8)
    El = max(1, shape.experts // world)  # top-k' of E / P, tokens so each expert gets P C rows
    k = min(shape.top_k, El)
    T = round(world * shape.capacity * El / ((shape.capacity_factor or 1.0) * k))
    local = replace(shape, tokens=T, experts=El, top_k=k)
    cands = {"tiny": _layer(tiny, 1, 1, solo)}
    cands.update({("solo", r): _layer(local, 1, r, solo) for r in (1, 8)})
    if world > 1:
        cands["all"] = _layer(shape, topo.ranks_per_node, 1)
        cands["skew"] = _layer(shape, topo.ranks_per_node, OVERLAP_R)
        cands["overlap"] = _layer(shape, topo.ranks_per_node, OVERLAP_R, policy="schemoe")
    times = timed(cands, repeats)
    one = replace(hw, nodes=1, ranks_per_node=1, task_overhead=0.0, step_overhead=0.0)
    step = max(0.0, times["tiny"] - predict(one, tiny, "sequential").step_s)
    one = replace(one, step_overhead=step)

    def model(r, o=0.0):
        return predict(replace(one, task_overhead=o), local, "sequential", chunks=r).step_s

    (m1, m8), dt = (model(1), model(8)), 1e-4
    n1, n8 = (model(1, dt) - m1) / dt, (model(8, dt) - m8) / dt
    t1, t8 = times["solo", 1], times["solo", 8]
    det = m1 * n8 - m8 * n1
    s, q = (t1 * n8 - t8 * n1) / det, (m1 * t8 - m8 * t1) / det
    if q < 0 or s <= 0:  # more chunks cost less than the model says: no per-task cost
        s, q = (t1 * m1 + t8 * m8) / (m1 * m1 + m8 * m8), 0.0
    hw = replace(hw, step_overhead=step, task_overhead=q / s, compute_factor=s)
    if "all" in times:
        hw = fit_sharing(hw, shape, times["all"], times["skew"])
    if "overlap" in times:
        hw = _fit(hw, shape, "overlap", times["overlap"], 2.0, "schemoe", OVERLAP_R)
    return hw
