"""Profiles: the fits that turn measured samples into a `Hardware` record, and the JSON store of
records by topology. Pure functions and file I/O; the measuring is `schemoe.profile`'s.

A record is cached in a JSON file (`schemoe profile --path FILE`; by default DEFAULT_PATH,
~/.cache/schemoe/profiles.json) under the key `cache_key(nodes, ranks_per_node, links)`,
"NODESxRANKS@inter=RATE,intra=RATE" (rates in bit/s, or "unshaped"; `schemoe.dist.links.Links`): the
topology and the link rates it was measured under. Every reader names the key it wants (a run's
is `cache_key` of its topology and `Links.of_run()`) and gets that record or none: a profile of
another link rate is never used in its place. Files with the old keys ("NxR@RATE") still read,
as intra unshaped. Every reader takes an explicit `path` too, so tests and tools never depend on
the home directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from ..dist.links import Links
from .hardware import Hardware, Link

__all__ = [
    "DEFAULT_PATH",
    "cache_key",
    "fit_gemm",
    "fit_line",
    "fit_link",
    "fit_rate",
    "key_of",
    "keys",
    "load",
    "parse_key",
    "save",
]

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


def fit_rate(nbytes: Sequence[float], seconds: Sequence[float]) -> float:
    """Seconds per byte: the slope of `fit_line`, or, where noise makes it <= 0 (small, fast
    samples on a busy box), the largest sample's seconds / bytes."""
    s = fit_line(nbytes, seconds)[1]
    if s > 0:
        return s
    b, t = max(zip(nbytes, seconds))
    return t / b


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
    """(alpha per GEMM, FLOP/s) of t = g alpha + F / flops, least squares on two regressors;
    where that gives alpha < 0 or flops <= 0, t = F / flops through the origin."""
    s11 = sum(g * g for g in gemms)
    s12 = sum(g * f for g, f in zip(gemms, flops))
    s22 = sum(f * f for f in flops)
    b1 = sum(g * t for g, t in zip(gemms, seconds))
    b2 = sum(f * t for f, t in zip(flops, seconds))
    det = s11 * s22 - s12 * s12
    alpha = inv = -1.0
    if det > 1e-9 * s11 * s22:  # else one sample shape (noise dropped the rest): no alpha to fit
        alpha, inv = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    if alpha < 0 or inv <= 0:  # inv <= 0: tiny GEMMs, the FLOP term lost in per-call noise
        alpha, inv = 0.0, b2 / s22
    return alpha, 1.0 / inv


def cache_key(nodes: int, ranks_per_node: int, links: Links) -> str:
    """The one profile key: "NODESxRANKS@inter=RATE,intra=RATE[/separate]" (rates in bit/s as
    %g, or "unshaped"), e.g. "2x2@inter=4e+08,intra=unshaped"."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"need nodes, ranks_per_node >= 1, got {nodes}, {ranks_per_node}")
    return f"{nodes}x{ranks_per_node}@{links}"


def parse_key(key: str) -> tuple[int, int, Links]:
    """(nodes, ranks_per_node, links) of a key; also the old "NxR@RATE" form (intra unshaped)."""
    topo, sep, links = key.partition("@")
    nodes, x, rpn = topo.partition("x")
    if not (sep and x and nodes.isdigit() and rpn.isdigit()):
        raise ValueError(f"profile key {key!r}: expected 'NODESxRANKS@inter=RATE,intra=RATE'")
    return int(nodes), int(rpn), Links.parse(links)


def key_of(hw: Hardware) -> str:
    """The key `hw` is stored under: its topology and the links it was measured under."""
    return cache_key(hw.nodes, hw.ranks_per_node, hw.links)


def _read(path: str) -> dict[str, dict]:
    """The store's records by current key (old keys rewritten; the record takes its key's links,
    so an old record without an intra rate reads as measured with intra unshaped)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    out = {}
    for key, d in data.items():
        try:
            nodes, rpn, links = parse_key(key)
        except ValueError as e:
            raise ValueError(f"profile store {path}: {e}") from None
        d = {**d, "link_rate_bps": links.inter_bps, "intra_rate_bps": links.intra_bps,
             "intra_link": links.intra_link}  # fmt: skip
        out[cache_key(nodes, rpn, links)] = d
    return out


def keys(path: str | None = None) -> list[str]:
    """The keys stored at `path` (default DEFAULT_PATH), oldest first."""
    return list(_read(path or DEFAULT_PATH))


def save(hw: Hardware, path: str | None = None) -> str:
    """Add `hw` to the JSON store at `path` under `key_of(hw)` (replacing one there); the key."""
    path = path or DEFAULT_PATH
    data = _read(path)
    key = key_of(hw)
    data.pop(key, None)
    data[key] = hw.to_json()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # whole or not at all: a reader never sees half a file
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return key


def load(key: str, path: str | None = None) -> Hardware | None:
    """The record stored under `key` (`cache_key`; old forms accepted) at `path`, or None. Only
    that key: a record of another topology or link rate is never substituted."""
    nodes, rpn, links = parse_key(key)
    d = _read(path or DEFAULT_PATH).get(cache_key(nodes, rpn, links))
    return None if d is None else Hardware.from_json(d)
