"""Per-task cost functions: pure functions of a `Hardware` record and a layer shape.

Legend: P ranks, R ranks per node (the ScheMoE paper's M), P / R nodes, S bytes a rank sends in
one all-to-all, E experts, El = E / P, C capacity rows per expert per rank, M model dim, H hidden
dim, b bytes per element.

An all-to-all is described by `sends` (a2a.py says how, and prices each algorithm on it): the
capacity partition sends S/P to every offset; FasterMoE's peers partition sends to a group of
offsets per chunk. `CostModel` binds the constants, the shape, the algorithm and the
compressors, and turns any `TaskGraph` of the layer into task durations (`TaskCosts`) for
`simulator.run` and the policies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .. import compression
from ..config import ExpertConfig, GateConfig, field_default
from ..routing.layout import Partition
from ..scheduling import SHARED, Direction, Task, TaskCosts, TaskGraph
from .a2a import A2A_MODELS
from .hardware import Hardware

__all__ = [
    "A2A_MODELS",
    "CostModel",
    "LayerShape",
    "TaskCosts",
    "codec_time",
    "copy_time",
    "expert_flops",
    "expert_time",
    "sharing_scale",
]


def expert_flops(rows: int, model_dim: int, hidden: int, activation: str = "gelu") -> float:
    """Forward FLOPs of the batched FFN on `rows` rows: 2 rows M H per GEMM, 2 GEMMs (3 for
    swiglu). Backward costs twice that (input and weight gradients; Kaplan et al. 2020)."""
    gemms = 3 if activation == "swiglu" else 2
    return 2.0 * rows * model_dim * hidden * gemms


def expert_time(
    hw: Hardware,
    rows: int,
    model_dim: int,
    hidden: int,
    activation: str = "gelu",
    backward: bool = False,
    wgrad_bytes: float = 0.0,
) -> float:
    """t = g gemm_alpha + FLOPs / flops (PipeMoE's t_gemm = alpha + beta m n k per GEMM), with
    g GEMM calls: 2 (3 swiglu) forward, twice that backward. A backward chunk after the first
    also adds its weight gradients into the accumulated ones: + wgrad_bytes / stream (the first
    chunk's gradients are the GEMMs' own output, inside FLOPs / flops)."""
    if rows <= 0:
        return 0.0
    mult = 2 if backward else 1
    gemms = (3 if activation == "swiglu" else 2) * mult
    flops = mult * expert_flops(rows, model_dim, hidden, activation)
    return (
        gemms * hw.gemm_alpha + flops / hw.flops + (wgrad_bytes / hw.stream_rate if backward else 0)
    )


def sharing_scale(hw: Hardware, busy: float, comm: float | None = None) -> float:
    """How much faster compute runs than profiled when ranks share a host's cores and are not in
    lockstep: with n = host_ranks ranks on c = host_cores cores, each computing a fraction
    `busy` of the time independently and communicating a fraction `comm` (default 1 - busy),
    during which it keeps `comm_cpu` of a core busy (gloo's threads, the kernel's TCP stack,
    overlapped with its own compute or not), a computing rank shares the cores with
    k = 1 + (n - 1) busy + n comm_cpu comm busy ranks on average and runs at min(1, c / k) of a
    core, against c / n when profiled (all n computing): duration scale = max(k, c) / n.
    1 without sharing."""
    n, c = hw.host_ranks, hw.host_cores
    if c <= 0 or n <= c:
        return 1.0
    busy = min(max(busy, 0.0), 1.0)
    comm = 1 - busy if comm is None else min(max(comm, 0.0), 1.0)
    k = 1 + (n - 1) * busy + n * hw.comm_cpu * comm
    return max(k, c) / n


def codec_time(hw: Hardware, name: str, raw_bytes: float, decode: bool = False) -> float:
    """t = raw_bytes x (encode or decode seconds per float-side byte); `none` is free."""
    enc, dec = hw.codec(name)
    return raw_bytes * (dec if decode else enc)


def copy_time(hw: Hardware, nbytes: float) -> float:
    """A row gather/scatter (index_select, index_copy) of `nbytes`: nbytes / memory."""
    return nbytes / hw.memory


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer call on every rank: `tokens` per rank, E experts over P ranks."""

    tokens: int
    model_dim: int
    hidden_dim: int
    experts: int
    top_k: int = field_default(GateConfig, "top_k")
    capacity_factor: float = field_default(GateConfig, "capacity_factor")
    activation: str = field_default(ExpertConfig, "activation")
    dtype_bytes: int = 4
    shared_hidden: int = 0  # the shared experts' num x hidden_dim (0: none); all T tokens
    dedup: bool = False  # ParallelConfig.dedup: a token crosses to a rank once (`reach`)

    def __post_init__(self) -> None:
        # The layer's own configs check experts, k, f and the dims, naming the bad value.
        GateConfig(num_experts=self.experts, top_k=self.top_k, capacity_factor=self.capacity_factor)
        ExpertConfig(
            model_dim=self.model_dim, hidden_dim=self.hidden_dim, activation=self.activation
        )
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {self.tokens!r}")
        if (
            isinstance(self.shared_hidden, bool)
            or not isinstance(self.shared_hidden, int)
            or self.shared_hidden < 0
        ):
            raise ValueError(f"shared_hidden must be an int >= 0, got {self.shared_hidden!r}")
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes!r}")

    @property
    def capacity(self) -> int:
        """C = min(ceil(f k T / E), T) (gating/router.py); dropless (f = 0): the mean k T / E."""
        f = self.capacity_factor or 1.0
        return min(math.ceil(f * self.top_k * self.tokens / self.experts), self.tokens)

    def reach(self, world: int) -> float:
        """The rows the all-to-alls carry over the k T routed ones: with dedup, a token once per
        rank its choices reach, P (1 - C(E - El, k) / C(E, k)) ranks on average under uniform
        routing, over k; 1 without."""
        if not self.dedup:
            return 1.0
        E, k, El = self.experts, self.top_k, self.experts // world
        return world * (1 - math.comb(E - El, k) / math.comb(E, k)) / k

    @classmethod
    def of(cls, config, tokens: int, dtype_bytes: int = 4) -> LayerShape:
        g, e = config.gate, config.experts
        return cls(
            tokens,
            e.model_dim,
            e.hidden_dim,
            g.num_experts,
            g.top_k,
            g.capacity_factor,
            e.activation,
            dtype_bytes,
            config.shared.total_hidden if getattr(config, "shared", None) is not None else 0,
            config.parallel.dedup,
        )


def _part(n: int, i: int, r: int) -> int:
    return n * (i + 1) // r - n * i // r


@dataclass(frozen=True)
class CostModel:
    """The costs of one layer on one cluster: a CostModel for policies and the simulator.

    `task_costs(graph)` gives every task of a forward or backward graph its duration; chunk
    sizes follow the chunk plan, `layout.build_plan` (capacity: C*(i+1)//r - C*i//r rows of
    every expert; peers: whole experts for offsets [P i // r, P (i + 1) // r)).
    """

    hardware: Hardware
    shape: LayerShape
    algorithm: str = "naive"
    compressors: tuple[str, str] = ("none", "none")
    wire: Mapping[str, float] = field(default_factory=dict)  # compressor -> wire/raw bytes
    compute_scale: float = 1.0  # multiplies every compute task (sharing_scale)

    def __post_init__(self) -> None:
        if self.algorithm not in A2A_MODELS:
            raise ValueError(
                f"no cost model for all-to-all {self.algorithm!r}; known: "
                f"{', '.join(sorted(A2A_MODELS))}"
            )
        if self.shape.experts % self.hardware.world:
            raise ValueError(
                f"{self.shape.experts} experts do not split over {self.hardware.world} ranks"
            )

    @property
    def links(self) -> tuple[str, ...]:
        return A2A_MODELS[self.algorithm][0]

    def _ratio(self, name: str) -> float:
        if name == "none":
            return 1.0
        if name in self.wire:
            return self.wire[name]
        return wire_ratio(name, self.shape.model_dim, self.shape.dtype_bytes)

    @cached_property
    def _cache(self) -> dict:
        return {}

    def task_costs(self, graph: TaskGraph) -> TaskCosts:
        key = (graph.chunks, graph.links, graph.direction, graph.partition, graph.shared)
        if key not in self._cache:
            k, hw = self.compute_scale, self.hardware
            durations = {  # a transfer: its link time and the wait for the last rank (skew)
                t: (v + hw.skew if v > 0 else v) if t.is_comm else v * k
                for t, v in self._durations(graph).items()
            }
            self._cache[key] = TaskCosts(durations, hw.task_overhead * k, hw.overlap)
        return self._cache[key]

    def _durations(self, graph: TaskGraph) -> dict[Task, float]:
        hw, sh = self.hardware, self.shape
        P, r = hw.world, graph.chunks
        El, C, M, b = sh.experts // P, sh.capacity, sh.model_dim, sh.dtype_bytes
        if tuple(graph.links) != self.links:
            raise ValueError(f"graph links {graph.links} are not {self.algorithm}'s {self.links}")
        backward = graph.direction == Direction.BACKWARD
        comp = self.compressors[1 if backward else 0]
        ratio = self._ratio(comp)
        a2a = A2A_MODELS[self.algorithm][1]
        permute = P > 1 and El > 1
        weights = El * M * sh.hidden_dim * (3 if sh.activation == "swiglu" else 2) * b
        out: dict[Task, float] = {}
        for i in range(r):
            if graph.partition == Partition.PEERS:
                lo, hi = P * i // r, P * (i + 1) // r
                pair = [El * C * M * b if lo <= o < hi else 0.0 for o in range(P)]
                gathered = True
            else:
                pair = [El * _part(C, i, r) * M * b] * P
                gathered = r > 1
            raw = sum(pair)
            rows = raw / (M * b)
            # With dedup the transfers and their codecs carry `reach` of the rows; the copies
            # to and from the experts' order (now expand and weighted sum) stay full size.
            wire = sh.reach(P)
            links = a2a(hw, [s * ratio * wire for s in pair])
            enc = codec_time(hw, comp, raw * wire)
            dec = codec_time(hw, comp, raw * wire, decode=True)
            mv = copy_time(hw, raw)
            out[Task("C", 1, i)] = enc + (mv if gathered else 0.0)
            out[Task("D", 1, i)] = dec + (mv if permute else 0.0)
            # Backward: chunk 0's weight gradients are the GEMMs' output; each later chunk's
            # are added into them (region.py: read both, write one).
            wgrad = weights * (0 if i == 0 else 3)
            out[Task("E", 0, i)] = expert_time(
                hw, int(rows), M, sh.hidden_dim, sh.activation, backward, wgrad
            )
            out[Task("C", 2, i)] = enc + (mv if permute else 0.0)
            out[Task("D", 2, i)] = dec + (mv if gathered else 0.0)
            for p in (1, 2):
                for ln in graph.links:
                    out[Task("A", p, i, ln)] = links[ln]
        if graph.shared:
            out[SHARED] = self.shared_time(backward)
        return out

    def shared_time(self, backward: bool = False) -> float:
        """The shared experts' task S: one FFN of hidden num x H over all T tokens of the rank,
        at the routed experts' compute rate (`expert_time`; the optional [M, 1] gate's 2 T M
        FLOPs are left out, under 1/H of the FFN's)."""
        sh = self.shape
        if not sh.shared_hidden:
            raise ValueError("the graph has a shared-experts task but the shape has none")
        return expert_time(
            self.hardware, sh.tokens, sh.model_dim, sh.shared_hidden, sh.activation, backward
        )

    def outside(self) -> float:
        """Seconds of one step outside the scheduled region: the router's GEMM forward and
        backward (3 x 2 T M E FLOPs), the layout's row copies (encode, decode and their
        gradients: ~8 E C M b bytes), the blocking counts exchange (one alpha of the slowest
        link class) and the fitted fixed cost per step."""
        hw, sh = self.hardware, self.shape
        gate = 3 * 2.0 * sh.tokens * sh.model_dim * sh.experts / hw.flops
        layout = 8.0 * sh.experts * sh.capacity * sh.model_dim * sh.dtype_bytes / hw.memory
        counts = 0.0
        if hw.world > 1:
            counts = hw.inter.alpha if hw.nodes > 1 else hw.intra.alpha
        return (hw.step_overhead + gate + layout) * self.compute_scale + counts


def wire_ratio(name: str, model_dim: int, dtype_bytes: int = 4) -> float:
    """Wire bytes over raw bytes of compressor `name` for rows of `model_dim` values, from the
    plug-in's own `wire_bytes` (default options)."""
    dtype = {4: torch.float32, 2: torch.bfloat16}.get(dtype_bytes, torch.float32)
    comp = compression.build(name)
    return comp.wire_bytes(64, model_dim, dtype) / (64 * model_dim * dtype_bytes)
