"""`schemoe profile`: fit the cost model's constants on the running cluster, in seconds.

Collective over the launched ranks (every rank measures at the same time, so compute contends as
it does in training; a sample's time is the slowest rank's, from `schemoe.bench.timer.measure`):

  1. links: Pipe-A2A's two parts alone (`link="intra"`, `link="inter"`) at a few sizes give
     (bytes, seconds) per link class, with bytes counted as the cost model counts them (the
     most a local rank sends to its node; what the node sends over its NIC); least squares
     fits t = alpha + bytes / beta for each, and the points themselves are kept as the link's
     measured curve (`Link.points`), which the model follows. One node: the plain all-to-all
     fits both;
  2. experts: the batched FFN forward and backward at a few row counts: t = g alpha + FLOP / flops
     (g GEMM calls) by least squares;
  3. memory: index_select of rows at a few sizes: bytes / second; stream: an in-place add (a
     weight-gradient accumulation) at the same sizes;
  4. codecs: every registered compressor's encode and decode: seconds per float byte;
  5. real layer steps (`calibrate.py`): a tiny layer on a one-rank group gives the fixed cost per
     step (its time minus the model); the layer at the profiled shape on a one-rank group
     (compute only) at r = 1 and r = 8 gives `compute_factor` and the cost per task, and on
     all ranks (sequential, r = 1) `comm_cpu`.

The result is a `Hardware` record, cached as JSON in `path` (default ~/.cache/schemoe/
profiles.json) under the key "NODESxRANKS@RATE" (RATE: the link rate in bit/s, or "unshaped").
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import partial

from .hardware import Hardware, Link

__all__ = ["DEFAULT_PATH", "cache_key", "fit_line", "fit_link", "load", "measure", "save"]

DEFAULT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "schemoe", "profiles.json")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + s x, with a clamped at 0 (refit through 0)."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError(f"fit_line needs >= 2 paired points, got {len(xs)} x and {len(ys)} y")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line needs at least two distinct x values")
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - s * mx
    if a < 0:
        a, s = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, s


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """t = alpha + bytes / beta from (bytes, seconds) samples, keeping the samples as the link's
    measured curve (`Link.points`: one point per size, the median of repeats where a size comes
    more than once, made non-decreasing, since a larger transfer never takes less time and a
    dip is noise). The line is fitted to the samples; where noise makes them fall with size
    (a fast link at small sizes), to the curve's end through the origin."""
    by_size: dict[float, list[float]] = {}
    for b, t in zip(nbytes, seconds):
        by_size.setdefault(float(b), []).append(float(t))
    points, floor = [], 0.0
    for b in sorted(by_size):
        ts = sorted(by_size[b])
        floor = max(floor, ts[len(ts) // 2])
        points.append((b, floor))
    a, s = fit_line(nbytes, seconds)
    if s <= 0:
        a, s = 0.0, points[-1][1] / points[-1][0]
    return Link(alpha=a, beta=1.0 / s, points=tuple(points) if len(points) >= 2 else ())


def fit_gemm(gemms: Sequence[int], flops: Sequence[float], seconds: Sequence[float]):
    """(alpha per GEMM, FLOP/s) of t = g alpha + F / flops, least squares on two regressors."""
    s11 = sum(g * g for g in gemms)
    s12 = sum(g * f for g, f in zip(gemms, flops))
    s22 = sum(f * f for f in flops)
    b1 = sum(g * t for g, t in zip(gemms, seconds))
    b2 = sum(f * t for f, t in zip(flops, seconds))
    det = s11 * s22 - s12 * s12
    alpha, inv = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    if alpha < 0:
        alpha, inv = 0.0, b2 / s22
    return alpha, 1.0 / inv


def cache_key(nodes: int, ranks_per_node: int, rate_bps: float | None = None) -> str:
    return f"{nodes}x{ranks_per_node}@" + (f"{rate_bps:g}" if rate_bps else "unshaped")


def save(hw: Hardware, path: str | None = None) -> str:
    """Add `hw` to the JSON cache at `path` under its topology key; return the key."""
    path = path or DEFAULT_PATH
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    key = cache_key(hw.nodes, hw.ranks_per_node, hw.link_rate_bps)
    data.pop(key, None)  # re-insert last: the newest entry of a topology wins in `load`
    data[key] = hw.to_json()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return key


def load(
    nodes: int | None,
    ranks_per_node: int | None,
    rate_bps: float | None = None,
    path: str | None = None,
) -> Hardware | None:
    """The cached profile of this topology (and link rate, if given; else the newest), or None.
    nodes or ranks_per_node None: the newest profile of any topology."""
    path = path or DEFAULT_PATH
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    if rate_bps is not None:
        d = data.get(cache_key(nodes, ranks_per_node, rate_bps))
        return None if d is None else Hardware.from_json(d)
    want = f"{nodes}x{ranks_per_node}@" if nodes and ranks_per_node else ""
    keys = [k for k in data if k.startswith(want)]
    return Hardware.from_json(data[keys[-1]]) if keys else None


def _timed(cands: dict, repeats: int) -> dict:
    """Median seconds of each candidate, interleaved round by round after one warm-up round and
    barrier-synced, the slowest rank's time (the shared benchmark timer)."""
    from ..bench.timer import measure

    names = {f"c{i}": k for i, k in enumerate(cands)}
    stats = measure({n: cands[k] for n, k in names.items()}, warmup=1, repeats=repeats)
    return {k: stats[n].median_ms / 1e3 for n, k in names.items()}


def _wait(algo, x, sp, **kw) -> None:
    algo.start(x, sp, sp, **kw).wait()


def _links(topo, sizes: Sequence[int], repeats: int) -> tuple[Link, Link, dict]:
    import torch

    from ..collectives import build
    from .model import split_bytes

    P, M = topo.world, topo.ranks_per_node
    pipe, naive = build("pipe", topo), build("naive", topo)
    cands, nbytes = {}, {}
    for S in sizes:
        rows = max(P, S // (4 * 256)) // P * P
        x = torch.randn(rows, 256)
        sp = [rows // P] * P
        intra, nic = split_bytes([rows // P * 256 * 4] * P, M)
        buf = torch.empty_like(x)
        if M > 1 and topo.nodes > 1:
            cands["intra", S] = partial(_wait, pipe, x, sp, link="intra", out=buf)
            nbytes["intra", S] = max(intra)
        if topo.nodes > 1:
            cands["inter", S] = partial(_wait, pipe, x, sp, link="inter", out=buf)
            nbytes["inter", S] = nic
        cands["naive", S] = partial(_wait, naive, x, sp)
        nbytes["naive", S] = max(max(intra), nic)
    times = _timed(cands, repeats)
    pts: dict[str, list] = {}
    for (kind, S), t in times.items():
        pts.setdefault(kind, []).append((nbytes[kind, S], t))
    fit = {k: fit_link(*zip(*v)) for k, v in pts.items() if len(v) >= 2}
    inter = fit.get("inter", fit["naive"])
    intra = fit.get("intra", fit["naive"] if topo.nodes == 1 else inter)
    return intra, inter, pts


def _ffn_backward(ffn, x, counts, params) -> None:
    import torch

    y = ffn(x, counts)
    torch.autograd.grad(y, (x, *params), torch.ones_like(y))


def _experts(model_dim: int, hidden: int, rows: Sequence[int], repeats: int):
    """(alpha per GEMM, FLOP/s, points) of two experts' FFN, forward and backward (backward:
    forward + backward minus forward; a sample that noise drove to <= 0 is left out)."""
    import torch

    from ..config import ExpertConfig
    from ..experts import BatchedFFN
    from .model import expert_flops

    ffn = BatchedFFN(ExpertConfig(model_dim=model_dim, hidden_dim=hidden), 2, 0, 0)
    params = list(ffn.parameters())
    cands = {}
    for n in rows:
        x = torch.randn(2 * n, model_dim, requires_grad=True)
        cands["fwd", n] = partial(ffn, x.detach(), [n, n])
        cands["both", n] = partial(_ffn_backward, ffn, x, [n, n], params)
    times = _timed(cands, repeats)
    g, f, t = [], [], []
    for n in rows:
        flops = expert_flops(2 * n, model_dim, hidden)
        bwd = times["both", n] - times["fwd", n]  # backward alone
        for gemms, fl, sec in ((2, flops, times["fwd", n]), (4, 2 * flops, bwd)):
            if sec > 0:
                g, f, t = g + [gemms], f + [fl], t + [sec]
    return (*fit_gemm(g, f, t), list(zip(g, f, t)))


def _memory_and_codecs(model_dim: int, repeats: int):
    import torch

    from .. import compression

    cands, nbytes = {}, {}
    for n in (512, 2048, 8192):
        x = torch.randn(n, model_dim)
        cands["copy", n] = partial(x.index_select, 0, torch.randperm(n))
        nbytes["copy", n] = x.numel() * 4
        acc, g = torch.zeros(n, model_dim), torch.randn(n, model_dim)
        cands["stream", n] = partial(acc.add_, g)  # a gradient accumulation: read 2, write 1
        nbytes["stream", n] = 3 * x.numel() * 4
    for name in compression.COMPRESSORS.names():
        if name == "none":
            continue
        try:
            comp = compression.build(name)
        except ImportError:
            continue
        for n in (256, 2048):
            x = torch.randn(n, model_dim)
            cands[name + ".enc", n] = partial(comp.encode, x)
            cands[name + ".dec", n] = partial(comp.decode, comp.encode(x), torch.float32, model_dim)
            nbytes[name + ".enc", n] = nbytes[name + ".dec", n] = x.numel() * 4
    times = _timed(cands, repeats)
    pts: dict[str, list] = {}
    for key, t in times.items():
        pts.setdefault(key[0], []).append((nbytes[key], t))
    memory = 1.0 / fit_line(*zip(*pts.pop("copy")))[1]
    stream = 1.0 / fit_line(*zip(*pts.pop("stream")))[1]
    codecs = {
        name: (fit_line(*zip(*pts[name + ".enc"]))[1], fit_line(*zip(*pts[name + ".dec"]))[1])
        for name in {k.rsplit(".", 1)[0] for k in pts}
    }
    return memory, stream, codecs


def _host_sharing() -> tuple[int, int]:
    """(ranks on this host, its cores) when CPU ranks share cores, else (1, 0). The testbed's
    namespaces share one kernel, so the hostname names the box."""
    import socket

    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() or not dist.is_initialized():
        return 1, 0
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    n = names.count(socket.gethostname())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (n, cores) if n > cores else (1, 0)


def measure(
    topo,
    *,
    model_dim: int = 512,
    hidden: int = 1024,
    tokens: int = 1024,
    experts: int = 0,
    rate_bps: float | None = None,
    quick: bool = False,
    name: str = "profile",
) -> tuple[Hardware, dict]:
    """Fit a Hardware record on the ranks of `topo` (collective); (record, raw points). The
    GEMMs are fitted at `model_dim` x `hidden`, and the layer steps run `tokens` per rank and
    `experts` experts (0: 2 per rank), top-2, f = 1.25: profile at your layer's shape."""
    import torch.distributed as dist

    from .calibrate import calibrate
    from .model import LayerShape

    repeats = 3 if quick else 7
    E = experts or 2 * topo.world
    sizes = (256 << 10, 1 << 20, 4 << 20) if quick else (128 << 10, 512 << 10, 2 << 20, 8 << 20)
    intra, inter, pts = _links(topo, sizes, repeats)
    memory, stream, codecs = _memory_and_codecs(model_dim, repeats)
    gemm_alpha, flops, pts["experts"] = _experts(model_dim, hidden, (16, 128, 1024), repeats)
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    host_ranks, cores = _host_sharing()
    hw = Hardware(
        name=name,
        nodes=topo.nodes,
        ranks_per_node=topo.ranks_per_node,
        intra=intra,
        inter=inter,
        flops=flops,
        gemm_alpha=gemm_alpha,
        memory=memory,
        stream=stream,
        codecs=codecs,
        backend="nccl" if backend == "nccl" else "gloo",
        link_rate_bps=rate_bps,
        host_ranks=host_ranks,
        host_cores=cores,
        notes=f"fitted by schemoe profile at T={tokens}, D={model_dim}, H={hidden}, E={E}",
    )
    hw = calibrate(hw, topo, LayerShape(tokens, model_dim, hidden, E), repeats)
    return hw, {k: [list(p) for p in v] for k, v in pts.items()}
