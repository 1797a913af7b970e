"""The scheduled MoE region: dispatch all-to-all, experts, combine all-to-all, per chunk, under a
policy's Schedule, in forward AND backward.

A custom autograd Function wraps the whole region, so backward runs the backward TaskGraph under
the same policy (per-chunk expert backward overlapping the gradient all-to-alls) instead of
autograd's ready queue, which would serialise it. Forward compression is straight-through: the
gradient ignores the rounding of the forward payload (the usual choice; see the compression docs).
When no gradient is needed (torch.no_grad, inference_mode, or nothing requires grad) the region
runs the forward schedule alone and builds no expert graph.

With shared experts (`Region.shared`) the region also takes the layer's tokens x_TM and runs the
schedule's S task on them (forward: s_TM = shared(x_TM); backward: the gradients of x_TM and of
the shared weights from that of s_TM), wherever the policy placed it; it then returns
(out_NM, s_TM), and the layer adds s_TM to the combined output (shared.py).

Legend: N dispatch-buffer rows of this rank, T tokens of this rank, M model dim, W wire width of
a compressed row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import trace
from ..routing.dedup import sum_copies
from ..routing.layout import Chunk
from ..scheduling import Kind, Phase, Schedule, Task, TaskGraph, execute
from ..scheduling.background import Background
from .dispatcher import Dedup
from .shared import shared_backward, shared_forward, shared_params

__all__ = [
    "ChunkRunner",
    "OrderedSum",
    "Region",
    "expert_backward",
    "expert_forward",
    "expert_params",
    "keep_graph",
    "run_region",
]


FREED = (
    "this MoE region's backward already ran and freed its expert graphs; to run backward "
    "through it again, pass retain_graph=True the first time"
)


@dataclass
class Region:
    """Everything one layer call's scheduled region needs (built per call by MoELayer from its
    resolved configuration and the dispatcher's chunk plan)."""

    plan: Sequence[Chunk]
    algorithm: Any  # AllToAll
    forward_compressor: Any
    backward_compressor: Any
    experts: nn.Module
    forward: tuple[TaskGraph, Schedule]
    backward: tuple[TaskGraph, Schedule]
    background: Background | None = None  # gradient buckets to post into idle network time
    shared: nn.Module | None = None  # shared experts: the S task (both schedules have it)
    dedup: Dedup | None = None  # token deduplication: the call's weights and exchanges
    saved: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def links(self) -> tuple[str, ...]:
        return tuple(self.algorithm.links)


class ChunkRunner:
    """Maps the region tasks of one direction onto tensors (the executor's TaskRunner; the stack
    runtime runs one per block and micro-chunk). Forward and backward differ only in the source
    rows, the compressor and what the expert task does: `expert_fn(chunk, rows, counts)`; the
    shared-experts task S calls `shared_fn()` and keeps its result in `shared_out`."""

    def __init__(
        self,
        region: Region,
        src_NM: torch.Tensor,
        comp,
        expert_fn: Callable,
        shared_fn: Callable | None = None,
        *,
        backward: bool = False,
    ) -> None:
        self.r, self.src, self.comp, self.expert_fn = region, src_NM, comp, expert_fn
        self.shared_fn, self.shared_out = shared_fn, None
        # Token deduplication: every transfer carries unique rows, in and out alike.
        self.dedup, self.backward = region.dedup is not None, backward
        self.rows = region.plan[-1].unique.hi if self.dedup else src_NM.shape[0]
        self.weight_grad: list[tuple[torch.Tensor, torch.Tensor]] = []  # backward, dedup
        self.multi = len(region.links) > 1
        self.out: torch.Tensor | None = None
        self.payload: dict[tuple[int, int], torch.Tensor] = {}
        self.recv: dict[tuple[int, int], torch.Tensor] = {}
        self.bufs: dict[tuple[int, int], torch.Tensor] = {}
        self.dtype: dict[tuple[int, int], torch.dtype] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.cols = src_NM.shape[1]

    def _encode(self, key, x: torch.Tensor) -> None:
        self.dtype[key] = x.dtype
        self.payload[key] = self.comp.encode(x)

    def run(self, t: Task) -> None:
        if t.kind == Kind.S:
            assert self.shared_fn is not None, "an S task in a region without shared experts"
            self.shared_out = self.shared_fn()
            return
        ch = self.r.plan[t.chunk]
        key = (t.phase, t.chunk)
        u = ch.unique
        if t.kind == Kind.C and t.phase == Phase.DISPATCH:
            if u is not None:  # the chunk's unique rows, contiguous
                x = self.src[u.lo : u.hi]
            else:
                x = self.src if ch.send_idx is None else self.src.index_select(0, ch.send_idx)
            self._encode(key, x)
        elif t.kind == Kind.D and t.phase == Phase.DISPATCH:
            x = self.comp.decode(self.recv.pop(key), self.dtype[key], self.cols)
            if u is not None:  # every unique row copied to the experts that take it
                x = x.index_select(0, u.expand)
                if self.backward:
                    x = self._weigh(t.chunk, u, x)
            elif ch.perm is not None:
                x = x.index_select(0, ch.perm)
            self.hidden[t.chunk] = x
        elif t.kind == Kind.E:
            self.hidden[t.chunk] = self.expert_fn(t.chunk, self.hidden[t.chunk], ch.expert_counts)
        elif t.kind == Kind.C:
            y = self.hidden.pop(t.chunk)
            if u is not None:  # a unique row's copies summed: forward the weighted expert
                w = None if self.backward else u.weights  # outputs (in fp32), backward the grads
                y = sum_copies(y, u.expand, sum(u.recv_splits), w).to(y.dtype)
            elif ch.inv_perm is not None:
                y = y.index_select(0, ch.inv_perm)
            self._encode(key, y)
        else:  # D2: back in this rank's buffer order
            z = self.comp.decode(self.recv.pop(key), self.dtype[key], self.cols)
            if u is not None and u.lo == 0 and u.hi == self.rows:  # the whole buffer
                self.out = z
            elif u is not None:
                self._out(z)[u.lo : u.hi] = z
            elif ch.send_idx is None:
                self.out = z
            else:
                self._out(z).index_copy_(0, ch.send_idx, z)

    def _weigh(self, i: int, u, g: torch.Tensor) -> torch.Tensor:
        """Backward with dedup: the gradient of each copy's expert output, w g, from that of its
        token's weighted sum g; and the weight's gradient <g, expert output> (fp32), kept for
        `weight_grads`."""
        if i not in self.r.saved:
            raise RuntimeError(FREED)
        y = self.r.saved[i][1].detach()
        self.weight_grad.append((u.rows, (g.float() * y.float()).sum(-1)))
        return (g.float() * u.weights[:, None]).to(g.dtype)

    def weight_grads(self) -> torch.Tensor | None:
        """Backward with dedup: the gradient of the region's combine weights (`Dedup.weights_N`),
        back from the receivers that applied them (collective); None without dedup."""
        if not (self.dedup and self.backward):
            return None
        return self.r.dedup.weight_grads(self.weight_grad)

    def _out(self, like: torch.Tensor) -> torch.Tensor:
        if self.out is None:
            self.out = like.new_empty((self.rows, self.cols))
        return self.out

    def start(self, t: Task):
        ch = self.r.plan[t.chunk]
        key = (t.phase, t.chunk)
        x = self.payload[key]
        u = ch.unique
        ours, theirs = (
            (u.send_splits, u.recv_splits) if u is not None else (ch.send_splits, ch.recv_splits)
        )
        send, recv = (ours, theirs) if t.phase == Phase.DISPATCH else (theirs, ours)
        if not self.multi:
            self.payload.pop(key)
            return self.r.algorithm.start(x, send, recv)
        if key not in self.bufs:
            self.bufs[key] = x.new_empty((sum(recv), *x.shape[1:]))
        return self.r.algorithm.start(x, send, recv, link=t.link, out=self.bufs[key])

    def finish(self, t: Task, result: torch.Tensor) -> None:
        self.recv[(t.phase, t.chunk)] = result

    def result(self) -> torch.Tensor:
        if self.out is None:  # no rows at all on this rank
            return self.src.new_empty((self.rows, self.cols))
        return self.out


def keep_graph() -> bool:
    """Whether the backward running now keeps its graph (retain_graph=True). torch says so only
    through a private function; without it a second backward raises the clear error below."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(probe()) if probe is not None else False


def expert_params(experts: nn.Module) -> list[nn.Parameter]:
    return [p for p in experts.parameters() if p.requires_grad]


def expert_forward(region: Region) -> Callable:
    """The expert task of a forward that will be differentiated: each chunk's expert graph is
    built on a leaf and kept in `region.saved` for `expert_backward`."""

    def fn(i: int, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        leaf = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = region.experts(leaf, counts)
        region.saved[i] = (leaf, y)
        return y.detach()

    return fn


def expert_backward(
    region: Region, params: Sequence[torch.Tensor], keep: bool, on_grads: Callable
) -> Callable:
    """The expert task of backward: chunk i's input gradient from its saved graph; the weight
    gradients go to `on_grads(i, grads)` (one entry per param, None where unused), each a tensor
    of their own (a weight gradient that autograd passed through from `gy` is copied), so a sum
    of them may be taken in place."""

    def fn(i: int, gy: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        if i not in region.saved:
            raise RuntimeError(FREED)
        leaf, y = region.saved[i] if keep else region.saved.pop(i)
        grads = torch.autograd.grad(
            y, (leaf, *params), gy.to(y.dtype), allow_unused=True, retain_graph=keep
        )
        gy_ptr = gy.untyped_storage().data_ptr()
        own = [g.clone() if g is not None and g.untyped_storage().data_ptr() == gy_ptr else g
               for g in grads[1:]]  # fmt: skip
        on_grads(i, own)
        return grads[0] if grads[0] is not None else torch.zeros_like(leaf)

    return fn


class OrderedSum:
    """Per-parameter gradient sums in a fixed order: `expected[p]` lists the keys (tasks) of
    parameter p's contributions in summation order; one that arrives before the ones ahead of
    it waits, so the sum's rounding does not depend on the schedule that produced them.
    `on_final(p)`, if given, runs once parameter p's last expected contribution is in."""

    def __init__(
        self, n: int, expected: dict[int, list], on_final: Callable[[int], None] | None = None
    ) -> None:
        self.expected, self.next, self.on_final = expected, [0] * n, on_final
        self.pending: list[dict[Any, torch.Tensor | None]] = [{} for _ in range(n)]
        self.acc: list[torch.Tensor | None] = [None] * n
        self.owned = [False] * n  # acc[p] is our own sum (safe to add into in place)

    def put(self, key, idx: Sequence[int], grads, owned: bool = False) -> None:
        """Key `key`'s contributions: grads[n] (None where unused) to parameter idx[n]. `owned`:
        the tensors alias nothing else, so the sum may be taken into the first one in place
        (no [E, M, H]-sized allocation per contribution)."""
        for p, g in zip(idx, grads):
            self.pending[p][key] = (g, owned)
            q = self.expected[p]
            while self.next[p] < len(q) and q[self.next[p]] in self.pending[p]:
                self._add(p, *self.pending[p].pop(q[self.next[p]]))
                self.next[p] += 1
                if self.next[p] == len(q) and self.on_final is not None:
                    self.on_final(p)

    def _add(self, p: int, g: torch.Tensor | None, owned: bool) -> None:
        if g is None:
            return
        if self.acc[p] is None:
            # Unless owned, it may alias a buffer autograd passed through: not added into.
            self.acc[p], self.owned[p] = g, owned
        elif self.owned[p]:
            self.acc[p].add_(g)
        else:
            self.acc[p], self.owned[p] = self.acc[p] + g, True

    def total(self, p: int, param: torch.Tensor) -> torch.Tensor:
        """Parameter p's sum so far (zeros where nothing came)."""
        return self.acc[p] if self.acc[p] is not None else torch.zeros_like(param)

    def result(self, params) -> list[torch.Tensor]:
        assert all(not d for d in self.pending), "a gradient arrived out of its expected set"
        return [self.total(n, p) for n, p in enumerate(params)]


class _RegionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: Region, rows_NM: torch.Tensor, x_TM, w_N, *params: torch.Tensor):
        # params: the experts', then the shared experts' (x_TM is None without them); w_N:
        # with dedup the combine weights the receivers apply (region.dedup.weights_N), else None.
        s_fn = None if region.shared is None else shared_forward(region.shared, x_TM, region.saved)
        out_NM, s_TM = _run_forward(region, rows_NM, expert_forward(region), s_fn)
        ctx.region = region
        ctx.n_params = len(params)
        return out_NM if s_TM is None else (out_NM, s_TM)

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor, *grad_s):
        region: Region = ctx.region
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through a scheduled MoE region is not "
                "supported: its backward runs the experts' gradients outside the graph"
            )
        keep = keep_graph()  # backward(retain_graph=True): the expert graphs must survive it
        params = expert_params(region.experts)
        graph, sched = region.backward
        # Each chunk's weight gradients, summed in the order its E tasks run.
        chunks = [t.chunk for t in sched.order["compute"] if t.kind == Kind.E]
        acc = OrderedSum(len(params), dict.fromkeys(range(len(params)), chunks))
        idx = list(range(len(params)))
        expert_bwd = expert_backward(
            region, params, keep, lambda i, gs: acc.put(i, idx, gs, owned=True)
        )
        s_params, s_fn = shared_params(region.shared), None
        if region.shared is not None:
            s_fn = shared_backward(region.saved, s_params, grad_s[0], keep)
        runner = ChunkRunner(
            region,
            grad_NM.contiguous(),
            region.backward_compressor,
            expert_bwd,
            s_fn,
            backward=True,
        )
        execute(sched, graph, runner, trace.active("backward"), region.background)
        g_x, g_s = runner.shared_out if s_fn is not None else (None, [])
        g_w = runner.weight_grads()
        return (None, runner.result(), g_x, g_w, *acc.result(params), *g_s)


def _run_forward(
    region: Region, rows_NM: torch.Tensor, expert_fn: Callable, shared_fn: Callable | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    runner = ChunkRunner(region, rows_NM, region.forward_compressor, expert_fn, shared_fn)
    graph, sched = region.forward
    execute(sched, graph, runner, trace.active("forward"), region.background)
    return runner.result(), runner.shared_out


def run_region(region: Region, rows_NM: torch.Tensor, x_TM: torch.Tensor | None = None):
    """Dispatch, experts and combine for this rank's buffer rows; returns the combined rows
    [N, M], or with shared experts (`region.shared`, which need this rank's tokens x_TM [T, M])
    (combined rows [N, M], shared output [T, M]). With dedup (`region.dedup`) the rows in and
    out are the unique rows [U, M], the out rows each a weighted sum of its experts' outputs."""
    if (region.shared is None) != (x_TM is None):
        raise ValueError("x_TM is needed exactly when the region has shared experts")
    params = expert_params(region.experts) + shared_params(region.shared)
    w_N = None if region.dedup is None else region.dedup.weights_N
    grad = rows_NM.requires_grad or params or (x_TM is not None and x_TM.requires_grad)
    grad = grad or (w_N is not None and w_N.requires_grad)
    if not torch.is_grad_enabled() or not grad:
        s_fn = None if region.shared is None else (lambda: region.shared(x_TM))
        out_NM, s_TM = _run_forward(
            region, rows_NM, lambda i, x, counts: region.experts(x, counts), s_fn
        )
        return out_NM if s_TM is None else (out_NM, s_TM)
    return _RegionFn.apply(region, rows_NM, x_TM, w_N, *params)
