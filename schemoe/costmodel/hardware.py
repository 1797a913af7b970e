"""The constants of the cost model: one `Hardware` record per cluster, fitted or preset.

A `Hardware` is what `schemoe profile` fits on the running cluster and what the presets describe
for clusters nobody here has. Every number is per rank unless it says per node, in seconds, bytes
and FLOP:

    intra        the rank's link to the other ranks of its node (loopback, PCIe, NVLink):
                 t = alpha + bytes / beta for one transfer of `bytes` leaving the rank
    inter        the node's network link (NIC), shared by the node's ranks:
                 t = alpha + bytes / beta for `bytes` leaving the node
    flops        expert GEMM throughput of one rank (FLOP/s, achieved, not peak), and
    gemm_alpha   fixed cost per GEMM call (launch, Python, small-matrix inefficiency)
    memory       bytes per second one rank copies (index_select / index_copy of rows)
    stream       bytes per second of a contiguous in-place add (read two, write one), what
                 accumulating a chunk's weight gradients costs; 0: same as `memory`
    codecs       compressor name -> (encode, decode) seconds per input byte (float side)
    task_overhead  executor cost per task (ordering logic, the runner, posting a transfer)
    step_overhead  fixed cost of one layer step outside the scheduled region (Python, autograd)
    compute_factor  the real layer's compute time over the model's at the profiled shape
                 (gelu, allocation, cache effects the GEMM and copy fits miss); multiplies
                 every compute cost. 1 for the presets
    backend      "gloo" or "nccl": how a plain all-to-all combines its intra and inter pairs
    host_ranks, host_cores   CPU ranks sharing one host's cores (the emulated testbed runs every
                 rank on one box); `flops`, `memory` and the codecs are then measured with all
                 host_ranks computing at once. host_cores = 0: every rank has its own device
    comm_cpu     the share of a core a CPU rank keeps busy while it communicates, waiting or
                 overlapped with its own compute (gloo's threads, the kernel's TCP stack)
    overlap      how much longer compute takes while one of the rank's transfers is in flight
                 (0.25: 1.25x; the simulator's `TaskCosts.overlap`), fitted on a layer step
                 whose transfers overlap its compute. 0 for the presets
    skew         seconds each all-to-all of a step takes beyond its link time: the wait for
                 the last rank to reach it (ranks drift apart between collectives; on CPU ranks
                 sharing cores, the OS's time slices), fitted on layer steps at r = 1 and r = 4
                 chunks. 0 for the presets
    link_rate_bps, intra_rate_bps, intra_link   the shaped rates (bit/s, None: unshaped) the
                 record was measured under (`links`), which its profile key names

Presets (`PRESETS`, `preset(name)`; data files in presets/, derivations in presets/README.md):

    local        this machine: 2 emulated nodes x 2 CPU ranks on loopback over gloo (a profile of
                 the 2-core dev box; run `schemoe profile` for your own)
    paper-32gpu  the ScheMoE paper's cluster, 8 nodes x 4 RTX 2080Ti, PCIe 3.0, 100 Gb/s IB
    h100-64gpu   8 nodes x 8 H100, NVLink (~450 GB/s per GPU) + 400 Gb/s IB per GPU
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import resources

from ..dist.links import Links

__all__ = ["PRESETS", "Hardware", "Link", "preset"]


@dataclass(frozen=True)
class Link:
    """One link class: `alpha` seconds per transfer plus `beta` bytes per second, and optionally
    the measured curve `points` ((bytes, seconds), sizes increasing, times non-decreasing) that
    `time` follows instead of the line.

    A measured curve beats a line where a link's efficiency depends on the transfer size (TCP
    windows, a shaper's burst bucket, NCCL's protocol switches). On the 2-node testbed at
    400 Mbit/s a node's inter-node part moved 512 KB at 56 MB/s and 8 MB at 40 MB/s; the
    least-squares line through those points (alpha clamped at 0) overestimates a 512 KB chunk by
    a third, which is exactly the size a chunked schedule sends.
    """

    alpha: float
    beta: float
    points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta > 0):
            raise ValueError(f"a link needs alpha >= 0 s and beta > 0 B/s, got {self}")
        pts = tuple((float(b), float(t)) for b, t in self.points)
        object.__setattr__(self, "points", pts)
        if pts and (
            len(pts) < 2
            or any(b1 <= b0 or t1 < t0 for (b0, t0), (b1, t1) in itertools.pairwise(pts))
            or pts[0][0] <= 0
            or pts[0][1] < 0
        ):
            raise ValueError(
                "link points need >= 2 (bytes, seconds) pairs with bytes > 0 increasing and "
                f"seconds non-decreasing, got {pts}"
            )

    def time(self, nbytes: float) -> float:
        """Seconds for one transfer of `nbytes`; an empty transfer costs nothing.

        Without points: t = alpha + bytes / beta (PipeMoE's linear model). With points: linear
        interpolation between them; past the last, its last segment's slope (1 / beta where
        that segment is flat); below the first, the first segment's line, but never less than
        the first point's time scaled by size (t0 b / b0)."""
        if nbytes <= 0:
            return 0.0
        if not self.points:
            return self.alpha + nbytes / self.beta
        pts = self.points
        (b0, t0), (b1, t1) = pts[0], pts[1]
        if nbytes <= b0:
            return max(t0 - (b0 - nbytes) * (t1 - t0) / (b1 - b0), t0 * nbytes / b0)
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if nbytes <= b1:
                return t0 + (nbytes - b0) * (t1 - t0) / (b1 - b0)
        slope = (t1 - t0) / (b1 - b0) or 1.0 / self.beta
        return t1 + (nbytes - b1) * slope


@dataclass(frozen=True)
class Hardware:
    """The cost model's constants for one cluster (see the module docstring for units)."""

    name: str
    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    flops: float
    gemm_alpha: float
    memory: float
    codecs: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    task_overhead: float = 0.0
    step_overhead: float = 0.0
    stream: float = 0.0
    backend: str = "gloo"
    link_rate_bps: float | None = None
    intra_rate_bps: float | None = None
    intra_link: str = "shared"
    host_ranks: int = 1
    host_cores: int = 0
    compute_factor: float = 1.0
    comm_cpu: float = 0.0
    overlap: float = 0.0
    skew: float = 0.0
    notes: str = ""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"need nodes, ranks_per_node >= 1, got {self.nodes}, {self.ranks_per_node}"
            )
        if self.flops <= 0 or self.memory <= 0 or self.stream < 0:
            raise ValueError(
                f"flops and memory must be > 0 and stream >= 0, got {self.flops}, "
                f"{self.memory}, {self.stream}"
            )
        self.links  # noqa: B018  (validates the rates: ValueError naming a bad one)
        if (
            self.compute_factor <= 0
            or not 0 <= self.comm_cpu <= 1
            or self.overlap < 0
            or self.skew < 0
        ):
            raise ValueError(
                "need compute_factor > 0, 0 <= comm_cpu <= 1, overlap >= 0 and skew >= 0, got "
                f"{self.compute_factor}, {self.comm_cpu}, {self.overlap}, {self.skew}"
            )

    @property
    def links(self) -> Links:
        """The link rates this record was measured under (its profile key's links)."""
        return Links(self.link_rate_bps, self.intra_rate_bps, self.intra_link)

    @property
    def stream_rate(self) -> float:
        """Bytes per second of contiguous elementwise work (`stream`, else `memory`)."""
        return self.stream or self.memory

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def codec(self, name: str) -> tuple[float, float]:
        """(encode, decode) seconds per input byte of compressor `name`; `none` is free.

        Unknown compressors raise ValueError listing the ones this record knows."""
        if name == "none":
            return (0.0, 0.0)
        if name not in self.codecs:
            raise ValueError(
                f"no codec cost for compressor {name!r} in hardware {self.name!r}; known: "
                f"{', '.join(sorted(self.codecs)) or 'none'} (run `schemoe profile`)"
            )
        return tuple(self.codecs[name])

    def with_topology(self, nodes: int, ranks_per_node: int) -> Hardware:
        """The same constants for another node count (the per-rank and per-node rates stay)."""
        return replace(self, nodes=nodes, ranks_per_node=ranks_per_node)

    def to_json(self) -> dict:
        d = asdict(self)
        d["codecs"] = {k: list(v) for k, v in self.codecs.items()}
        for name in ("intra", "inter"):
            if not d[name]["points"]:
                del d[name]["points"]  # records without curves read as before
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> Hardware:
        d = dict(d)
        d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
        d["codecs"] = {k: tuple(v) for k, v in d.get("codecs", {}).items()}
        return cls(**d)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)


def _load_presets() -> dict[str, Hardware]:
    """The presets shipped as data: one JSON record per file in presets/ (their derivations are
    in presets/README.md)."""
    out = {}
    for f in sorted(resources.files(__package__).joinpath("presets").iterdir()):
        if f.name.endswith(".json"):
            hw = Hardware.from_json(json.loads(f.read_text()))
            out[hw.name] = hw
    return out


PRESETS: dict[str, Hardware] = _load_presets()


def preset(name: str) -> Hardware:
    """The preset `name`; unknown names raise ValueError listing the presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
