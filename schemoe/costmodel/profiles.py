"""Profiles: the fits that turn measured samples into a `Hardware` record, and the JSON store of
records by topology. Pure functions and file I/O; the measuring is `schemoe.profiler`'s.

A record is cached in a JSON file (`schemoe profile --path FILE`; by default DEFAULT_PATH,
~/.cache/schemoe/profiles.json) under the key "NODESxRANKS@RATE" (RATE: the inter-node link rate
in bit/s, or "unshaped"). Every reader takes an explicit `path` too, so tests and tools never
depend on the home directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from .hardware import Hardware, Link

__all__ = ["DEFAULT_PATH", "cache_key", "fit_gemm", "fit_line", "fit_link", "load", "save"]

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
