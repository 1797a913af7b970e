"""One MoE layer call (forward + backward) with and without ParallelConfig.dedup, interleaved,
12 repeats per rank (median of the last 10), on loopback gloo ranks: what dedup's index work
costs where the link is not the bottleneck.

    python docs/results/layer2026_2026-12-07_dedup/dedup_overhead.py WORLD E K M H T SHARED

The example's shape: 4 32 4 128 64 512 1 (schemoe train @examples/deepseek_v3_style.args: one
MoE layer call of 8 x 64 tokens per rank, swiglu, one shared expert, schemoe r=2).
"""

import sys
import time

import torch

from schemoe import MoELayer, SharedExpertConfig
from schemoe import config as c
from schemoe.dist.launch import spawn


def _config(dedup, E, k, M, H, shared):
    return c.MoEConfig(
        gate=c.GateConfig(num_experts=E, top_k=k, capacity_factor=0.0),
        experts=c.ExpertConfig(model_dim=M, hidden_dim=H, activation="swiglu"),
        parallel=c.ParallelConfig(dedup=dedup),
        schedule=c.ScheduleConfig(policy="schemoe", chunks=2),
        shared=SharedExpertConfig(num=1, hidden_dim=H) if shared else None,
    )


def _rank(rank, world, E, k, M, H, T, shared):
    torch.manual_seed(0)
    layers = {d: MoELayer(_config(d, E, k, M, H, shared)) for d in (False, True)}
    x = torch.randn(T, M)
    times = {False: [], True: []}
    for _ in range(12):
        for d in (False, True):
            xx = x.clone().requires_grad_()
            t0 = time.perf_counter()
            y, aux = layers[d](xx)
            (y.sum() + aux).backward()
            times[d].append(time.perf_counter() - t0)
    return {d: sorted(v[2:])[5] * 1000 for d, v in times.items()}


if __name__ == "__main__":
    world, E, k, M, H, T, shared = (int(a) for a in sys.argv[1:8])
    print(f"# world={world} E={E} k={k} M={M} H={H} T={T} shared={shared}")
    for rank, med in enumerate(spawn(_rank, world, E, k, M, H, T, shared)):
        print(f"rank {rank}: plain {med[False]:.2f} ms, dedup {med[True]:.2f} ms, "
              f"dedup / plain {med[True] / med[False]:.3f}")  # fmt: skip
