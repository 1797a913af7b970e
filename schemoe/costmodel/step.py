"""A whole training step of `schemoe train`'s GPT, predicted: dense compute, the MoE regions (the
layer simulator, `prediction.predict`) and the dense-gradient all-reduce buckets ("AR" tasks)
on the network, under DDP's immediate posting or the scheduled sync's idle-time rule.

Legend: T tokens per rank (batch x seq_len), L sequence length, M model dim, H hidden dim, V
vocabulary, P ranks, R ranks per node, S bytes of one bucket.

    predict_step(hw, StepShape(...), "schemoe", chunks=4, grad_sync="scheduled") -> StepPrediction

Costs (forward; backward is twice the FLOPs; every GEMM also costs gemm_alpha):
    attention   2 T M 3M (qkv) + 2 T M M (proj) + 4 T L M (scores and values, causal, dense)
    dense FFN   2 T M H x 2
    head        2 T M V, and its softmax / cross-entropy as 3 T V 4 bytes streamed
    norms etc.  12 T M 4 bytes per block streamed (two layer norms, residuals)
Streamed bytes are elementwise passes at the stream rate (an in-place add, `schemoe profile`'s
"stream"), not the row-gather rate ("memory") the layer's encode and decode copy at.
    optimizer   AdamW: 16 bytes per parameter read and 12 written, at the stream rate
An all-reduce of S bytes (`allreduce_time`), ring over the world (flat) or reduce / leaders'
ring / broadcast (hier): each node's link carries 2 (n - 1) / n S for a ring of n members, with
n - 1 link latencies per phase (gloo's ring; DDP divides before summing).

The backward's buckets: each block's dense gradients become ready when its backward ends (last
block first), DDP packs them into buckets of `bucket_bytes` in that order, and:
  * ddp: a bucket is posted when ready; the link runs transfers first-come first-served, so a
    region's all-to-alls wait behind buckets posted before the region started;
  * scheduled: a bucket is posted only while the link is idle (dense compute, or the gaps
    between a region's transfers, where it must fit: the executor posts one only between
    its tasks), one at a time; the rest go after the last block.

What it does not model: bandwidth sharing between an all-reduce and an all-to-all in flight
together (a FIFO link instead); DDP's first, smaller bucket; the router's and layout's costs
beyond `CostModel.outside`; the loss all-reduce (one alpha); Python overheads beyond the per-step
constant. CPU ranks sharing cores: the dense compute is taken at the profiled speed (every rank
computing at once, as in the dense parts of a step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..config import GateConfig, field_default
from ..routing.layout import Partition
from ..scheduling import POLICIES
from .hardware import Hardware
from .model import LayerShape
from .prediction import predict

__all__ = [
    "StepPrediction",
    "StepShape",
    "allreduce_time",
    "block_forward",
    "predict_step",
]


@dataclass(frozen=True)
class StepShape:
    """The GPT of `schemoe train` on one rank (its flags)."""

    batch: int
    seq_len: int
    model_dim: int
    hidden: int
    layers: int
    heads: int = 4
    moe_every: int = 2
    experts: int = 8
    top_k: int = field_default(GateConfig, "top_k")
    capacity_factor: float = field_default(GateConfig, "capacity_factor")
    vocab: int = 256
    dedup: bool = False  # ParallelConfig.dedup (LayerShape.reach)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def is_moe(self, i: int) -> bool:
        return (i + 1) % self.moe_every == 0

    def layer(self) -> LayerShape:
        return LayerShape(
            self.tokens,
            self.model_dim,
            self.hidden,
            self.experts,
            self.top_k,
            self.capacity_factor,
            dedup=self.dedup,
        )

    def block_dense_params(self, i: int) -> int:
        M, H = self.model_dim, self.hidden
        common = 4 * M + 4 * M * M  # two layer norms, qkv + proj
        return common + (self.experts * M if self.is_moe(i) else 2 * M * H + H + M)

    def dense_params(self) -> int:
        edge = self.vocab * self.model_dim + self.seq_len * self.model_dim + 2 * self.model_dim
        return edge + sum(self.block_dense_params(i) for i in range(self.layers))

    def expert_params(self) -> int:
        moe = sum(self.is_moe(i) for i in range(self.layers))
        return moe * (self.experts * 2 * self.model_dim * self.hidden)


@dataclass(frozen=True)
class StepPrediction:
    forward_s: float
    backward_s: float
    optimizer_s: float
    network_s: float  # the step's transfers alone (all-to-alls and buckets, back to back)

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


def _gemm(hw: Hardware, flops: float, gemms: int) -> float:
    return (gemms * hw.gemm_alpha + flops / hw.flops) * hw.compute_factor


def block_forward(hw: Hardware, sh: StepShape, moe: bool) -> float:
    """Seconds of one block's dense forward: attention and norms (and the dense FFN if not moe)."""
    T, L, M, H = sh.tokens, sh.seq_len, sh.model_dim, sh.hidden
    t = _gemm(hw, 2 * T * M * 3 * M + 2 * T * M * M + 4 * T * L * M, 4)
    t += 12 * T * M * 4 / hw.stream_rate * hw.compute_factor
    if not moe:
        t += _gemm(hw, 2 * T * M * H * 2, 2)
    return t


def allreduce_time(hw: Hardware, nbytes: float, algorithm: str = "flat") -> float:
    """Seconds of one all-reduce of `nbytes` (module docstring)."""
    P, R = hw.world, hw.ranks_per_node
    nodes = P // R
    if P == 1 or nbytes <= 0:
        return 0.0
    link = hw.inter if nodes > 1 else hw.intra
    if algorithm == "flat":
        return (P - 1) * 2 * link.alpha + link.time(2 * (P - 1) / P * nbytes) - link.alpha
    if algorithm != "hier":
        raise ValueError(f"algorithm must be 'flat' or 'hier', got {algorithm!r}")
    inside = 2 * hw.intra.time(nbytes) if R > 1 else 0.0  # reduce in, broadcast out
    across = 0.0
    if nodes > 1:
        across = (nodes - 1) * 2 * hw.inter.alpha + hw.inter.time(2 * (nodes - 1) / nodes * nbytes)
        across -= hw.inter.alpha
    return inside + across


def _buckets(sizes: list[float], cap: float) -> list[tuple[int, float]]:
    """(index of the segment whose gradients complete it, bytes) of DDP-style buckets over the
    segments' gradient bytes in ready order."""
    out, fill = [], 0.0
    for i, b in enumerate(sizes):
        fill += b
        while fill >= cap:
            out.append((i, cap))
            fill -= cap
    if fill > 0:
        out.append((len(sizes) - 1, fill))
    return out


_WIRE_BYTES = {"none": 4, "bf16": 2, "fp16": 2}


def wire_ratio(grad_compress: str) -> float:
    """Bytes on the wire per fp32 gradient byte for a gradient compressor."""
    if grad_compress not in _WIRE_BYTES:
        raise ValueError(
            f"grad_compress must be one of {sorted(_WIRE_BYTES)}, got {grad_compress!r}"
        )
    return _WIRE_BYTES[grad_compress] / 4


def head_time(hw: Hardware, shape: StepShape) -> float:
    """The output head's forward: the logits GEMM and softmax / cross-entropy traffic."""
    T, M, V = shape.tokens, shape.model_dim, shape.vocab
    return _gemm(hw, 2 * T * M * V, 1) + 3 * T * V * 4 / hw.stream_rate * hw.compute_factor


def optimizer_time(hw: Hardware, shape: StepShape) -> float:
    """AdamW over this rank's parameters (dense, and its share of the experts)."""
    params = shape.dense_params() + shape.expert_params() // hw.world
    return params * 28 / hw.stream_rate * hw.compute_factor


def gradient_bytes(shape: StepShape) -> float:
    """fp32 bytes of the dense gradients DDP all-reduces each step."""
    return 4.0 * shape.dense_params()


def _backward_span(
    segments: list[tuple[float, list[tuple[float, float]], float]],
    by_seg: dict[int, list[float]],
    grad_sync: str,
) -> float:
    """The backward's end: `segments` (compute seconds, a region's link intervals relative to
    its start, gradient bytes) run in order on the compute; after segment k its buckets
    (`by_seg[k]`, all-reduce seconds) queue for the link. ddp posts them FIFO as soon as they are
    ready and a region's transfers wait behind them; scheduled posts only those that end before
    the next region's first transfer (the gaps), the rest after."""
    now, link = 0.0, 0.0
    pending: deque[tuple[float, float]] = deque()  # (ready time, seconds)

    def post(until: float | None) -> None:
        """Post pending buckets FIFO (scheduled: only those that can start before `until`)."""
        nonlocal link
        while pending and (until is None or max(pending[0][0], link) < until):
            r, d = pending.popleft()
            link = max(r, link) + d

    for k, (dur, intervals, _) in enumerate(segments):
        if not intervals:  # dense compute: the link is free for buckets
            post(None if grad_sync == "ddp" else now + dur)
            now += dur
        else:  # a region: its transfers wait for what is on the link when it starts
            if grad_sync == "ddp":
                post(None)
            delay = max(0.0, link - now - intervals[0][0])
            for a, b in intervals:  # the region's transfers, shifted by the delay
                a, b = now + delay + a, now + delay + b
                if grad_sync == "scheduled":  # buckets that fit in the idle gap before it
                    while pending and max(pending[0][0], link) + pending[0][1] <= a:
                        r, d = pending.popleft()
                        link = max(r, link) + d
                link = max(link, b)
            now += dur + delay
        pending.extend((now, d) for d in by_seg.get(k, []))
    post(None)
    return max(now, link)


def predict_step(
    hw: Hardware,
    shape: StepShape,
    policy: str = "schemoe",
    algorithm: str = "naive",
    chunks: int = 1,
    *,
    grad_sync: str = "ddp",
    grad_compress: str = "none",
    grad_algorithm: str = "flat",
    bucket_bytes: float = 1 << 20,
    compressors: tuple[str, str] = ("none", "none"),
) -> StepPrediction:
    """One training step of `shape` on `hw` (module docstring); `compressors` are the MoE
    all-to-alls' (dispatch, combine), as `prediction.predict` takes them."""
    if grad_sync not in ("ddp", "scheduled"):
        raise ValueError(f"grad_sync must be 'ddp' or 'scheduled', got {grad_sync!r}")
    ratio = wire_ratio(grad_compress)
    if POLICIES.get(policy).partition == Partition.PEERS and chunks > hw.world:
        raise ValueError(f"policy {policy!r} needs chunks <= {hw.world}, got {chunks}")
    events: list = []
    layer = predict(hw, shape.layer(), policy, algorithm, compressors, chunks, events=events)
    link_of_backward = sorted(
        (e.start, e.end)
        for e in events
        if e.direction == "backward" and e.resource != "compute" and e.end > e.start
    )
    region_bwd = layer.backward_s + layer.outside_s / 2
    t0 = link_of_backward[0][0] if link_of_backward else 0.0
    a2a = [(a - t0, b - t0) for a, b in link_of_backward]  # relative to the region's start
    # Forward: blocks, the head; the MoE blocks' regions.
    M, V = shape.model_dim, shape.vocab
    head = head_time(hw, shape)
    forward = head + hw.step_overhead
    for i in range(shape.layers):
        forward += block_forward(hw, shape, shape.is_moe(i))
        if shape.is_moe(i):
            forward += layer.forward_s + layer.outside_s / 2
    # Backward, last block first; segments: (compute seconds, link intervals, gradient bytes).
    segments = [(2 * head, [], 4.0 * (V * M + 2 * M))]
    for i in reversed(range(shape.layers)):
        dense = 2 * block_forward(hw, shape, shape.is_moe(i))
        grads = 4.0 * shape.block_dense_params(i)
        if shape.is_moe(i):
            segments.append((region_bwd, a2a, 0.0))
        segments.append((dense, [], grads))
    segments[-1] = (segments[-1][0], [], segments[-1][2] + 4.0 * shape.seq_len * M)
    by_seg: dict[int, list[float]] = {}  # segment -> its buckets' all-reduce seconds
    for seg, nbytes in _buckets([s[2] for s in segments], bucket_bytes):
        by_seg.setdefault(seg, []).append(allreduce_time(hw, nbytes * ratio, grad_algorithm))
    backward = _backward_span(segments, by_seg, grad_sync)
    optimizer = optimizer_time(hw, shape)
    a2a_s = sum(b - a for a, b in a2a) * 2 * sum(shape.is_moe(i) for i in range(shape.layers))
    buckets = sum(d for ds in by_seg.values() for d in ds)
    return StepPrediction(forward, backward, optimizer, a2a_s + buckets)
