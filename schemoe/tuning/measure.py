"""Fit the cost model's constants on the running cluster, in seconds: what `schemoe profile` runs,
and, as a quick profile, what the auto tuner runs when no profile of the run's key is stored.

Collective over the ranks of `topo.group` (every rank measures at the same time, so compute
contends as it does in training; a sample's time is the slowest rank's, from
`schemoe.dist.timing.measure`):

  1. links: Pipe-A2A's two parts alone (`link="intra"`, `link="inter"`) at a few sizes give
     (bytes, seconds) per link class, with bytes counted as the cost model counts them (the
     most a local rank sends to its node; what the node sends over its NIC); least squares
     fits t = alpha + bytes / beta for each, and the points themselves are kept as the link's
     measured curve (`Link.points`), which the model follows. One node: the plain all-to-all
     fits both; one rank: both are a local copy at the memory rate (step 3);
  2. experts: the batched FFN forward and backward at a few row counts: t = g alpha + FLOP / flops
     (g GEMM calls) by least squares;
  3. memory: index_select of rows at a few sizes: bytes / second; stream: an in-place add (a
     weight-gradient accumulation) at the same sizes;
  4. codecs: every registered compressor's encode and decode: seconds per float byte;
  5. real layer steps (`calibrate.py`): a tiny layer on a one-rank group gives the fixed cost per
     step (its time minus the model); the layer at the profiled shape on a one-rank group
     (compute only) at r = 1 and r = 8 gives `compute_factor` and the cost per task, and on
     all ranks (sequential, r = 1 and 4) `comm_cpu` and `skew`, (schemoe, r = 4) `overlap`. Left out with
     calibrated=False (the quick profile of the auto tuner, which times the real layer itself).

quick=True: 3 repeats instead of 7, link sizes 256 KB, 1 MB, 4 MB, GEMMs at 16 and 64 rows
(per expert), copies of 256 KB, 1 MB, 4 MB, codecs at 64 and 512 rows.
The result is a `Hardware` record carrying the `Links` it was measured under;
`costmodel.profiles.save` stores it under `profiles.key_of(hw)`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist

from .. import compression
from ..collectives import build
from ..config import ExpertConfig
from ..costmodel.a2a import split_bytes
from ..costmodel.hardware import Hardware, Link
from ..costmodel.model import LayerShape, expert_flops
from ..costmodel.profiles import fit_gemm, fit_link, fit_rate
from ..dist.devices import comm_device
from ..dist.links import Links
from ..dist.timing import measure as timed_rounds
from ..experts.ffn import BatchedFFN
from .calibrate import calibrate

__all__ = ["UNCALIBRATED", "measure", "timed"]

UNCALIBRATED = "layer steps not calibrated"  # in the notes of a record measured calibrated=False


def timed(cands: dict, repeats: int, group=None) -> dict:
    """Median seconds of each candidate, interleaved round by round after one warm-up round and
    barrier-synced over `group`, the slowest rank's time (the shared timer)."""
    names = {f"c{i}": k for i, k in enumerate(cands)}
    stats = timed_rounds(
        {n: cands[k] for n, k in names.items()}, warmup=1, repeats=repeats, group=group
    )
    return {k: stats[n].median_ms / 1e3 for n, k in names.items()}


def _wait(algo, x, sp, **kw) -> None:
    algo.start(x, sp, sp, **kw).wait()


def _links(topo, sizes: Sequence[int], repeats: int) -> tuple[Link, Link, dict]:
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
    times = timed(cands, repeats, topo.group)
    pts: dict[str, list] = {}
    for (kind, S), t in times.items():
        pts.setdefault(kind, []).append((nbytes[kind, S], t))
    fit = {k: fit_link(*zip(*v)) for k, v in pts.items() if len(v) >= 2}
    inter = fit.get("inter", fit["naive"])
    intra = fit.get("intra", fit["naive"] if topo.nodes == 1 else inter)
    return intra, inter, pts


def _ffn_backward(ffn, x, counts, params) -> None:
    y = ffn(x, counts)
    torch.autograd.grad(y, (x, *params), torch.ones_like(y))


def _experts(model_dim: int, hidden: int, rows: Sequence[int], repeats: int, group):
    """(alpha per GEMM, FLOP/s, points) of two experts' FFN, forward and backward (backward:
    forward + backward minus forward; a sample that noise drove to <= 0 is left out)."""
    ffn = BatchedFFN(ExpertConfig(model_dim=model_dim, hidden_dim=hidden), 2, 0, 0)
    params = list(ffn.parameters())
    cands = {}
    for n in rows:
        x = torch.randn(2 * n, model_dim, requires_grad=True)
        cands["fwd", n] = partial(ffn, x.detach(), [n, n])
        cands["both", n] = partial(_ffn_backward, ffn, x, [n, n], params)
    times = timed(cands, repeats, group)
    g, f, t = [], [], []
    for n in rows:
        flops = expert_flops(2 * n, model_dim, hidden)
        bwd = times["both", n] - times["fwd", n]  # backward alone
        for gemms, fl, sec in ((2, flops, times["fwd", n]), (4, 2 * flops, bwd)):
            if sec > 0:
                g, f, t = g + [gemms], f + [fl], t + [sec]
    return (*fit_gemm(g, f, t), list(zip(g, f, t)))


def _memory_and_codecs(model_dim: int, repeats: int, group, quick: bool = False):
    cands, nbytes = {}, {}
    quick_rows = [max(1, b // (4 * model_dim)) for b in (256 << 10, 1 << 20, 4 << 20)]
    for n in quick_rows if quick else (512, 2048, 8192):
        x = torch.randn(n, model_dim)
        cands["copy", n] = partial(x.index_select, 0, torch.randperm(n, device=x.device))
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
        for n in (64, 512) if quick else (256, 2048):
            x = torch.randn(n, model_dim)
            cands[name + ".enc", n] = partial(comp.encode, x)
            cands[name + ".dec", n] = partial(comp.decode, comp.encode(x), torch.float32, model_dim)
            nbytes[name + ".enc", n] = nbytes[name + ".dec", n] = x.numel() * 4
    times = timed(cands, repeats, group)
    pts: dict[str, list] = {}
    for key, t in times.items():
        pts.setdefault(key[0], []).append((nbytes[key], t))
    memory = 1.0 / fit_rate(*zip(*pts.pop("copy")))
    stream = 1.0 / fit_rate(*zip(*pts.pop("stream")))
    codecs = {
        name: (fit_rate(*zip(*pts[name + ".enc"])), fit_rate(*zip(*pts[name + ".dec"])))
        for name in {k.rsplit(".", 1)[0] for k in pts}
    }
    return memory, stream, codecs


def _host_sharing(group=None) -> tuple[int, int]:
    """(ranks of `group` on this host, its cores) when CPU ranks share cores, else (1, 0). The
    testbed's namespaces share one kernel, so the hostname names the box."""
    if torch.cuda.is_available() or not dist.is_initialized():
        return 1, 0
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
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
    links: Links | None = None,
    quick: bool = False,
    calibrated: bool = True,
    name: str = "profile",
) -> tuple[Hardware, dict]:
    """Fit a Hardware record on the ranks of `topo` (collective); (record, raw points). The
    GEMMs are fitted at `model_dim` x `hidden`, and the layer steps run `tokens` per rank and
    `experts` experts (0: 2 per rank), top-2, f = 1.25: profile at your layer's shape. `links`:
    the link rates the ranks run under (the record's, hence its profile key's). calibrated:
    also fit the constants of real layer steps (step 5; collective over the whole world)."""
    # Every sample runs on the backend's device (CUDA under NCCL), timed by the shared timer
    # (CUDA events there); tensors made without a device land on it.
    with torch.device(comm_device(topo.group)):
        links = links or Links()
        return _measure(topo, model_dim, hidden, tokens, experts, links, quick, calibrated, name)


def _measure(topo, model_dim, hidden, tokens, experts, links, quick, calibrated, name):
    repeats = 3 if quick else 7
    E = experts or 2 * topo.world
    sizes = (256 << 10, 1 << 20, 4 << 20) if quick else (128 << 10, 512 << 10, 2 << 20, 8 << 20)
    rows = (16, 64) if quick else (16, 128, 1024)
    memory, stream, codecs = _memory_and_codecs(model_dim, repeats, topo.group, quick)
    if topo.world > 1:
        intra, inter, pts = _links(topo, sizes, repeats)
    else:  # nothing leaves a one-rank group: its all-to-all is a local copy
        intra = inter = Link(0.0, memory)
        pts = {}
    gemm_alpha, flops, pts["experts"] = _experts(model_dim, hidden, rows, repeats, topo.group)
    backend = dist.get_backend(topo.group) if dist.is_initialized() else "gloo"
    host_ranks, cores = _host_sharing(topo.group)
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
        link_rate_bps=links.inter_bps,
        intra_rate_bps=links.intra_bps,
        intra_link=links.intra_link,
        host_ranks=host_ranks,
        host_cores=cores,
        notes=f"fitted at T={tokens}, D={model_dim}, H={hidden}, E={E}"
        + (", quick" if quick else "")
        + ("" if calibrated else f", {UNCALIBRATED}"),
    )
    if calibrated:
        hw = calibrate(hw, topo, LayerShape(tokens, model_dim, hidden, E), repeats, timed)
    return hw, {k: [list(p) for p in v] for k, v in pts.items()}
