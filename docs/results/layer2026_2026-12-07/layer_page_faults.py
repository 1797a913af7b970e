"""One process, one thread: the dropless E8 k2 and E64 k6 layers (T 2048, M 512, the same active
FLOPs) and their experts alone, forward + backward, interleaved, median of N repeats. With
`keep` as the second argument, schemoe.dist.host.keep_freed_memory() runs first. Prints the
medians, the E64 / E8 layer ratio, the time outside the experts, the peak RSS and the minor
page faults of the whole run.

    python docs/results/layer2026_2026-12-07/layer_page_faults.py 7 [keep]
"""

import resource
import statistics
import sys
import time

import torch

from schemoe import config as c
from schemoe.dist.host import keep_freed_memory
from schemoe.experts.ffn import BatchedFFN
from schemoe.layer.moe import MoELayer
from schemoe.routing.router import route

torch.set_num_threads(1)
if sys.argv[2:] == ["keep"]:
    keep_freed_memory()
T, M = 2048, 512
torch.manual_seed(0)
x = torch.randn(T, M, requires_grad=True)
g = torch.randn(T, M)
cands = {}
for E, k, H in [(8, 2, 1536), (64, 6, 512)]:
    cfg = c.MoEConfig(
        gate=c.GateConfig(num_experts=E, top_k=k, capacity_factor=0.0),
        experts=c.ExpertConfig(model_dim=M, hidden_dim=H, impl="grouped"),
        parallel=c.ParallelConfig(uniform_tokens=True),
        schedule=c.ScheduleConfig(policy="sequential", chunks=1),
    )
    layer = MoELayer(cfg)

    def step(layer=layer):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y, aux = layer(x)
        (y * g).sum().add(aux).backward()

    cands[f"layer E{E}"] = step
    counts = route(x.detach(), torch.randn(E, M), cfg.gate).host_counts()
    xn = torch.randn(sum(counts), M, requires_grad=True)
    gn = torch.randn_like(xn)
    ffn = BatchedFFN(cfg.experts, E)

    def experts(ffn=ffn, xn=xn, gn=gn, counts=counts):
        ffn.zero_grad(set_to_none=True)
        xn.grad = None
        ffn(xn, counts).backward(gn)

    cands[f"experts E{E}"] = experts
for f in cands.values():
    f()
    f()
times = {name: [] for name in cands}
for _ in range(int(sys.argv[1])):
    for name, f in cands.items():
        t0 = time.perf_counter()
        f()
        times[name].append(time.perf_counter() - t0)
med = {name: round(statistics.median(v) * 1e3, 1) for name, v in times.items()}
print(med)
print(f"layer E64 / E8: {med['layer E64'] / med['layer E8']:.3f}")
print(f"outside the experts: E8 {med['layer E8'] - med['experts E8']:.1f} ms, "
      f"E64 {med['layer E64'] - med['experts E64']:.1f} ms")  # fmt: skip
usage = resource.getrusage(resource.RUSAGE_SELF)
print(f"peak RSS {usage.ru_maxrss / 1024:.0f} MiB, minor page faults {usage.ru_minflt}")
