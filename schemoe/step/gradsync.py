"""Scheduled gradient synchronisation: DDP's dense-gradient buckets as low-priority network tasks.

    model = DDP(ddp_ignore_experts(model), bucket_cap_mb=1)
    sync = GradSync(model, algorithm="hier", compress="bf16")   # a DDP comm hook

DDP keeps doing what it does well (buckets in gradient-ready order, the reducer's bookkeeping);
its comm hook, PyTorch's seam for this, hands each bucket to a `Background` queue instead of
all-reducing it at once. The MoE layers of the model are handed the same queue, so their
scheduled regions post buckets only into idle network time: a bucket goes out when no all-to-all
of a region is in flight and fewer than `window` buckets are in flight; the last bucket of the
backward posts and waits for every bucket left (`flush`), so all are done before the optimizer.
The all-reduces run on their own communicator, never behind the all-to-alls in one queue.

A micro-chunk stack (schemoe/stack.py) is one autograd Function, so DDP sees its weights'
gradients only when its whole backward returns. The sync does not wait for that: the stack hands
each dense weight's gradient over as soon as it is final (`ready`, via the layers'
`grad_ready`), and they are all-reduced then, sharing the link with the stack's all-to-alls
(the stack does not hold them back), together until they fill one of DDP's buckets (the rest
with DDP's first bucket). When DDP later calls the hook for a bucket, each parameter whose
gradient is bit for bit what was sent early takes the early result; the others (a weight also
used outside the stack, whose gradient grew afterwards) are all-reduced from the bucket as
usual. `early_params` / `bucket_params` count both ways. Inside `no_sync()` nothing is sent
early, as DDP sends nothing.

Algorithms (GRAD_SYNCS, plug-ins): `flat`, one all-reduce over the world; `hier`, a reduce to
each node's first rank, an all-reduce among those ranks (one flow per node crosses the network:
(P/R - 1)/(P/R) of the bytes instead of (P - 1)/P of them, R ranks per node) and a broadcast
back inside each node. Compression (`compress`): "none", or "bf16" / "fp16": the bucket is cast,
divided by the world size, all-reduced in that dtype and cast back, the same arithmetic as
torch's bf16_compress_hook / fp16_compress_hook; per-element error after the sum: each of the
P addends and every partial sum rounds to 8 (bf16) or 11 (fp16) significant bits, so the relative
error of an element is at most about (P + 1) 2^-8 (bf16) or (P + 1) 2^-11 (fp16) of the largest
addend's magnitude.

On gloo `hier`'s three phases run on one comm thread in bucket order (each phase waits for the
one before); on NCCL they would be enqueued from the calling thread on the communicators' streams
(not yet run on CUDA: the CUDA branch raises).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import trace
from ..collectives import Done, Works
from ..collectives._common import CommThread
from ..dist.topology import Topology
from ..layer.moe import MoELayer
from ..registry import Registry
from ..scheduling.background import Background

__all__ = ["COMPRESS", "GRAD_SYNCS", "SYNCS", "Flat", "GradSync", "Hier", "data_parallel"]

GRAD_SYNCS: Registry[type] = Registry("gradient sync algorithm")
COMPRESS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@GRAD_SYNCS.register("flat")
class Flat:
    """One all-reduce (sum) over the world, on the sync's own communicator."""

    def __init__(self, topology: Topology) -> None:
        self.group = topology.subgroup(tuple(range(topology.world)), tag="gradsync")

    def start(self, t: torch.Tensor) -> Any:
        return Works([dist.all_reduce(t, group=self.group, async_op=True)], t, t)


@GRAD_SYNCS.register("hier")
class Hier:
    """Reduce to each node's first rank, all-reduce among those ranks, broadcast in the node."""

    def __init__(self, topology: Topology) -> None:
        R, nodes = topology.ranks_per_node, topology.nodes
        # new_group is collective: every rank creates every group, in the same order.
        node_groups = [
            topology.subgroup(tuple(range(n * R, (n + 1) * R)), tag="gradsync-node")
            for n in range(nodes)
        ]
        leaders = topology.subgroup(tuple(range(0, topology.world, R)), tag="gradsync-leaders")
        self.topo, self.node_group = topology, node_groups[topology.node]
        self.leaders = leaders if topology.local_rank == 0 else None
        self.leader = topology.global_rank(topology.node * R)
        self._thread = CommThread("gradsync")

    def _run(self, t: torch.Tensor) -> torch.Tensor:
        R = self.topo.ranks_per_node
        if R > 1:
            dist.reduce(t, self.leader, group=self.node_group)
        if self.leaders is not None and self.topo.nodes > 1:
            dist.all_reduce(t, group=self.leaders)
        if R > 1:
            dist.broadcast(t, self.leader, group=self.node_group)
        return t

    def start(self, t: torch.Tensor) -> Any:
        if t.is_cuda:  # CUDA: enqueue the phases from the calling thread (not yet written)
            raise NotImplementedError("hier gradient sync on CUDA is not implemented yet")
        return self._thread.submit(lambda: self._run(t), t, t)


class GradSync:
    """A DDP comm hook that posts DDP's gradient buckets as background network tasks (see the
    module docstring); registered on `ddp` by the constructor (collective: creates groups).

    Args:
        ddp: the DistributedDataParallel model (its module's MoELayers get the queue).
        algorithm: a GRAD_SYNCS name ("flat", "hier").
        compress: "none", "bf16" or "fp16".
        window: buckets in flight at once.
        ranks_per_node: the node layout for "hier" (default: the launcher's LOCAL_WORLD_SIZE).
    """

    def __init__(
        self,
        ddp: nn.parallel.DistributedDataParallel,
        *,
        algorithm: str = "flat",
        compress: str = "none",
        window: int = 1,
        ranks_per_node: int | None = None,
    ) -> None:
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            raise TypeError(f"GradSync needs a DistributedDataParallel, got {type(ddp).__name__}")
        if compress not in COMPRESS:
            raise ValueError(f"compress must be one of {sorted(COMPRESS)}, got {compress!r}")
        cls = GRAD_SYNCS.get(algorithm)
        self.topology = Topology.from_group(None, ranks_per_node)
        self.algorithm, self.dtype = cls(self.topology), COMPRESS[compress]
        self.background = Background(window)
        self.ddp = ddp
        self._managed = {id(p) for p in ddp.parameters() if p.requires_grad} - {
            id(p) for n, p in ddp.module.named_parameters() if n in ddp.parameters_to_ignore
        }
        self._early: dict[int, tuple[_Early, int, int]] = {}  # id(param) -> (entry, offset, numel)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its local gradient)
        self.early_bytes = ddp.bucket_bytes_cap  # an early transfer's size, at least
        self.early_params = self.bucket_params = 0  # gradients synced early / in DDP's buckets
        self.early_posts = 0  # early all-reduces posted in this backward (trace names AR.e<k>)
        for m in ddp.module.modules():
            if isinstance(m, MoELayer):
                m.background = self.background
                m.grad_ready = self.ready
        ddp.register_comm_hook(self, _hook)

    def post(self, payload: torch.Tensor, name: str, done: Callable[[torch.Tensor], None]) -> None:
        """All-reduce `payload` (already divided by the world size) as a background task; traced
        as `name` on the link row; done(result) once it has completed."""
        tracer, span = trace.active("backward"), [0.0]

        def start():
            span[0] = time.perf_counter()
            return Done(payload) if self.topology.world == 1 else self.algorithm.start(payload)

        def finish(result: torch.Tensor) -> None:
            if tracer is not None:  # the end is when the queue noticed it (an upper bound)
                tracer.record(trace.Mark(name, "net"), span[0], time.perf_counter())
            done(result)

        self.background.submit(start, finish)

    def payload(self, flat: torch.Tensor, *, keep: bool) -> torch.Tensor:
        """What goes on the wire: (cast,) divided by the world size, torch's hooks' arithmetic;
        in place in `flat` (fp32) unless `keep`."""
        out = (
            flat
            if self.dtype is None and not keep
            else flat.to(self.dtype or flat.dtype, copy=keep)
        )
        return out.div_(self.topology.world)

    def ready(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Dense gradients of a scheduled stack, final before its backward returns: all-reduce
        them now, in the background. The bucket hook uses the result only where the
        bucket's gradients are exactly what was sent (else it reduces the bucket as usual), so
        a parameter that gets more gradient after the stack costs bytes, never correctness."""
        if not self.ddp.require_backward_grad_sync:  # inside no_sync(): nothing is synced
            return
        for p, g in zip(params, grads):
            if id(p) in self._managed:
                # What autograd will leave in p.grad: the stack's sum added to what is there.
                self._pending.append((p, (g if p.grad is None else p.grad + g).reshape(-1)))
        # Weights go out together until they fill a DDP bucket (each all-reduce pays its
        # latency once); what is left goes with the first bucket DDP hands over.
        if sum(t.numel() * t.element_size() for _, t in self._pending) >= self.early_bytes:
            self.post_pending()

    def post_pending(self) -> None:
        """All-reduce the gradients handed over and not yet sent, as one early transfer."""
        if not self._pending:
            return
        local = torch.cat([t for _, t in self._pending])
        entry, off = _Early(local), 0
        for p, t in self._pending:
            self._early[id(p)] = (entry, off, t.numel())
            off += t.numel()
        self._pending = []
        self.early_posts += 1
        self.post(self.payload(local, keep=True), f"AR.e{self.early_posts}", entry.finish)


class _Early:
    """One early all-reduce: the local gradients sent, then the result; callbacks on completion."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local, self.result = local, None
        self.waiters: list[Callable[[], None]] = []

    def finish(self, result: torch.Tensor) -> None:
        self.result = result
        for w in self.waiters:
            w()

    def then(self, fn: Callable[[], None]) -> None:
        if self.result is not None:
            fn()
        else:
            self.waiters.append(fn)


def _split(sync: GradSync, bucket) -> tuple[list, list]:
    """The bucket's parameters as (early, rest): early (at, n, entry, offset) where an early
    all-reduce sent exactly the gradient DDP put at buffer[at : at + n]; rest (at, n)."""
    buf, early, rest, at = bucket.buffer(), [], [], 0
    for p in bucket.parameters():
        n, got = p.numel(), sync._early.get(id(p))
        if got is not None and torch.equal(buf[at : at + n], got[0].local[got[1] : got[1] + n]):
            early.append((at, n, got[0], got[1]))
        else:
            rest.append((at, n))
        at += n
    if at != buf.numel():  # not the layout assumed: reduce the whole bucket
        return [], [(0, buf.numel())]
    return early, rest


def _hook(sync: GradSync, bucket):  # DDP checks real annotations: bucket is a dist.GradBucket
    sync.post_pending()  # the stack has returned: its last blocks go now
    buf, fut = bucket.buffer(), torch.futures.Future()
    early, rest = _split(sync, bucket)
    sync.early_params += len(early)
    sync.bucket_params += len(rest)
    left = [len(early) + bool(rest)]

    def part_done() -> None:
        left[0] -= 1
        if left[0] == 0:
            fut.set_result(buf)

    def fill(at: int, n: int, entry: _Early, off: int) -> None:
        buf[at : at + n].copy_(entry.result[off : off + n])
        part_done()

    for part in early:
        part[2].then(functools.partial(fill, *part))
    if rest:  # what no early all-reduce sent: reduced here, the same arithmetic
        whole = not early  # the bucket itself goes (in place when fp32), as without a stack
        flat = buf if whole else torch.cat([buf[at : at + n] for at, n in rest])

        def done(result: torch.Tensor) -> None:
            if whole:
                if result is not buf:
                    buf.copy_(result)
            else:
                at2 = 0
                for at, n in rest:
                    buf[at : at + n].copy_(result[at2 : at2 + n])
                    at2 += n
            part_done()

        sync.post(sync.payload(flat, keep=False), f"AR.{bucket.index()}", done)
    if bucket.is_last():  # every bucket is ready: post the rest, all done before the optimizer
        sync.background.flush()
        sync._early.clear()
        sync.early_posts = 0
    return fut


SYNCS = ("ddp", "scheduled")
# Buffers (the experts' balancing bias and load) have their own all-reduce: DDP must not overwrite
# them from rank 0 each forward. Newer torch spells it forward_sync_buffers (and warns about the
# old name); it still syncs at construction, where every rank's buffers are equal (zeros).
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def data_parallel(
    model: nn.Module,
    *,
    sync: str = "ddp",
    compress: str = "none",
    algorithm: str = "flat",
    bucket_mb: float = 25.0,
    window: int = 1,
    ranks_per_node: int | None = None,
    find_unused_parameters: bool = False,
    device_ids: list | None = None,
) -> tuple[nn.parallel.DistributedDataParallel, GradSync | None]:
    """`model` (experts already excluded, see `ddp_ignore_experts`) under DDP, its dense gradients
    synchronised by `sync`: "ddp" (DDP's own all-reduce, or with compress bf16/fp16 exactly
    torch's bf16_compress_hook / fp16_compress_hook; algorithm must be "flat") or "scheduled"
    (a GradSync). Collective (DDP broadcasts the parameters; groups are created)."""
    if sync not in SYNCS:
        raise ValueError(f"grad sync must be one of {SYNCS}, got {sync!r}")
    if compress not in COMPRESS:
        raise ValueError(f"grad compress must be one of {sorted(COMPRESS)}, got {compress!r}")
    GRAD_SYNCS.get(algorithm)
    if sync == "ddp" and algorithm != "flat":
        raise ValueError(
            f"grad sync 'ddp' all-reduces flat; algorithm {algorithm!r} needs 'scheduled'"
        )
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    ddp = nn.parallel.DistributedDataParallel(
        model,
        bucket_cap_mb=bucket_mb,
        find_unused_parameters=find_unused_parameters,
        device_ids=device_ids,
        **_NO_BUFFER_SYNC,
    )
    if sync == "scheduled":
        return ddp, GradSync(
            ddp,
            algorithm=algorithm,
            compress=compress,
            window=window,
            ranks_per_node=ranks_per_node,
        )
    if compress != "none":
        hook = {"bf16": _torch_bf16_hook, "fp16": default_hooks.fp16_compress_hook}
        ddp.register_comm_hook(None, hook[compress])
    return ddp, None


def _torch_bf16_hook(state, bucket):
    """torch's own bf16_compress_hook, unchanged. DDP refuses that hook by name unless NCCL runs
    it, but gloo all-reduces bf16 too; calling it through this wrapper runs it on gloo."""
    return default_hooks.bf16_compress_hook(state, bucket)
