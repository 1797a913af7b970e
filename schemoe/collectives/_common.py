"""Helpers the all-to-all algorithms share: split offsets, link and output-buffer checks, the
comm thread that drives multi-phase transfers, blocking exchange primitives, the one `start` of
the built-in algorithms, the `_start` of those that run on such a thread, and the groups of the
two-level ones.

Issue rule (NCCL): no collective from a worker thread. `Threaded.start` drives the phases on the
instance's `CommThread` only where `devices.issues_from_worker_thread(group)` (gloo); on NCCL it
enqueues every phase from the calling thread on a side stream that first waits for the caller's
stream (an event), records an event when the last phase is enqueued, and `Job.wait` makes the
caller's stream (on the tensor's device) wait for that event. Every buffer the phases read or
write is `record_stream`ed on the side stream, so the caching allocator cannot reuse it before
the transfer's event completes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..dist.devices import backend_name, control_tensor, issues_from_worker_thread
from ..dist.topology import Topology
from .base import Done, Pending, check_splits

__all__ = [
    "Algorithm",
    "CommThread",
    "Hierarchical",
    "Job",
    "Threaded",
    "check_link",
    "exchange",
    "gather_splits",
    "node_group",
    "offsets",
    "output_buffer",
    "peer_group",
    "permute_blocks",
    "start_exchange",
    "world_group",
]


def offsets(splits: Sequence[int]) -> list[int]:
    """Row offsets of each block: [0, s0, s0 + s1, ..., sum(splits)] (len(splits) + 1 entries)."""
    out = [0]
    for s in splits:
        out.append(out[-1] + int(s))
    return out


def check_link(name: str, link: str | None, links: tuple[str, ...]) -> None:
    """Raise ValueError unless `link` is None or one of the algorithm's `links`."""
    if link is not None and link not in links:
        raise ValueError(f"{name} uses the links {links}, got link={link!r}")


def output_buffer(
    x: torch.Tensor, recv_splits: Sequence[int], out: torch.Tensor | None
) -> torch.Tensor:
    """`out` checked against the expected result [sum(recv_splits), *x.shape[1:]], or a new one.

    The buffer must be contiguous: every part of the transfer writes straight into a row slice
    of it, and only a contiguous tensor's row slices are contiguous."""
    shape = (sum(recv_splits), *x.shape[1:])
    if out is None:
        return x.new_empty(shape)
    if (
        tuple(out.shape) != shape
        or out.dtype != x.dtype
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device}, got "
            f"{'a contiguous' if out.is_contiguous() else 'a non-contiguous'} {out.dtype} "
            f"tensor of shape {tuple(out.shape)} on {out.device}"
        )
    return out


def node_group(topology: Topology, tag: str):
    """This node's group of ranks (tag `tag`), or None with one rank per node. Collective.

    new_group is collective: every rank creates every node's group, in node order."""
    rpn = topology.ranks_per_node
    if rpn == 1:
        return None
    groups = [
        topology.subgroup(tuple(range(n * rpn, (n + 1) * rpn)), tag=tag)
        for n in range(topology.nodes)
    ]
    return groups[topology.node]


def peer_group(topology: Topology, tag: str, local_ranks: Sequence[int] | None = None):
    """The group of this rank's peers, the ranks of its local rank on every node (tag `tag`);
    None with one node, or when this rank's local rank is not among `local_ranks` (default all).

    new_group is collective: every rank creates the group of every local rank in `local_ranks`,
    in that order, members or not."""
    if topology.nodes == 1:
        return None
    rpn, world = topology.ranks_per_node, topology.world
    lrs = range(rpn) if local_ranks is None else local_ranks
    groups = {lr: topology.subgroup(tuple(range(lr, world, rpn)), tag=tag) for lr in lrs}
    return groups.get(topology.local_rank)


def world_group(topology: Topology, tag: str):
    """A communicator of the algorithm's own over all ranks (tag `tag`), or None with one rank.
    Collective: every rank creates it."""
    return topology.subgroup(tuple(range(topology.world)), tag=tag) if topology.world > 1 else None


def permute_blocks(y: torch.Tensor, sizes: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Reorder the row blocks of `y` (block i has sizes[i] rows, in order) to `order`."""
    if list(order) == list(range(len(sizes))):
        return y
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    return torch.cat([y.narrow(0, starts[i], sizes[i]) for i in order])


def gather_splits(values: list[int], group, size: int) -> list[list[int]]:
    """Every member's `values` (same length on all), by group rank. Collective; HOST SYNC
    unless `size` is 1 (then [values], nothing sent).

    The ints travel on the group's backend device (gloo: CPU, NCCL: CUDA)."""
    if size == 1:
        return [list(values)]
    mine = control_tensor(values, dtype=torch.int64, group=group)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts).tolist()  # host sync: the next phase's splits depend on these


def start_exchange(
    x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group, out: torch.Tensor
) -> list:
    """Start all_to_all_single(out, x, recv, send, group) (group of two or more); its works.

    On gloo as point-to-point pairs, every receive posted before any send. gloo's alltoall
    posts each pair's send before its receive, and a send that finds no receive posted by its
    peer yet waits for the peer's notice; on a shaped link the two directions of a pair then
    move one after the other, not at once. On the testbed at 200 Mbit/s, ranks arriving up to
    30 ms apart, 1.3 MB per rank, from the last arrival: 44.0 ms with gloo's alltoall, 22.8 ms
    receives first (2 x 1 ranks; 50.4-51.9 vs 38.8-43.2 ms at 2 x 2;
    docs/results/recv_first_2026-12-07/a2a_order.txt). Peers pair their messages in posting
    order, so every rank must start a group's exchanges in the same order (as collectives)."""
    if backend_name(group) != "gloo":
        return [dist.all_to_all_single(out, x, list(recv), list(send), group=group, async_op=True)]
    x, me, size = x.contiguous(), dist.get_rank(group), dist.get_world_size(group)
    so, ro = offsets(send), offsets(recv)
    peers = [(me + step) % size for step in range(1, size)]
    ranks = {p: p if group is None else dist.get_global_rank(group, p) for p in peers}
    works = [
        dist.irecv(out.narrow(0, ro[p], recv[p]), ranks[p], group=group)
        for p in peers[::-1]  # sources in the order their sends go out: me - 1, me - 2, ...
    ]
    works += [dist.isend(x.narrow(0, so[p], send[p]), ranks[p], group=group) for p in peers]
    out.narrow(0, ro[me], recv[me]).copy_(x.narrow(0, so[me], send[me]))
    return works


def exchange(
    x: torch.Tensor,
    send: list[int],
    recv: list[int],
    group,
    size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocking all_to_all_single over `group` (`size` members); a copy when `size` is 1."""
    if size == 1:
        return x if out is None else out.copy_(x)
    if out is None:
        out = x.new_empty((sum(recv), *x.shape[1:]))
    for work in start_exchange(x, send, recv, group, out):
        work.wait()
    return out


class Job:
    """Pending result of work running on a `CommThread`; `wait` re-raises what the work raised."""

    def __init__(
        self,
        future: Future,
        done: torch.cuda.Event | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._future = future
        self._done = done
        self._device = device

    def wait(self) -> torch.Tensor:
        # Blocks until the thread finishes; a collective that times out raises RuntimeError there.
        out = self._future.result()
        if self._done is not None:  # the tensor's device's stream, not the current device's
            torch.cuda.current_stream(self._device).wait_event(self._done)
        return out

    def is_completed(self) -> bool:
        return self._future.done() and (self._done is None or self._done.query())


class CommThread:
    """One FIFO worker thread that runs an algorithm's multi-phase transfers in `start` order.

    Why a thread and not `wait()`: on CPU, gloo moves bytes on its own threads only while an op is
    posted; phases that depend on each other (a host split exchange, then an exchange, a permute,
    another exchange) must be driven by a host loop. Running that loop inside `wait()` would
    leave the link idle while the caller computes. One thread per instance (not per call) keeps
    every rank issuing the instance's ops in the same order. The GIL is released inside torch
    ops and `Work.wait`, so the caller's compute and the thread interleave.

    CUDA tensors on gloo: the work runs on a side stream that first waits for the caller's
    stream, and `Job.wait` makes the caller's stream (on the tensor's device) wait for it. On NCCL
    the thread is not used: `here` enqueues the same work from the calling thread (the issue
    rule in the module docstring). Neither CUDA path has run on a GPU yet (tests/test_cuda.py and
    scripts/device_check.sh are ready for the first one).
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"schemoe-{name}")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """The instance's side stream on `device` (created once)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def here(self, fn: Callable[[], torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> Job:
        """Run `fn()` on the calling thread (the NCCL path): on CUDA its ops are enqueued on a
        side stream ordered after the caller's stream by an event; returns its Pending."""
        done_future: Future = Future()
        if not x.is_cuda:
            done_future.set_result(fn())
            return Job(done_future)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
        stream = self._stream(x.device)
        done = torch.cuda.Event()
        with torch.cuda.device(x.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            x.record_stream(stream)  # the caller may drop x before the side stream is done
            out.record_stream(stream)
            done_future.set_result(fn())
            done.record(stream)
        return Job(done_future, done, x.device)

    def submit(self, fn: Callable[[], torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> Job:
        """Run `fn()` (which reads `x` and fills `out`) on the thread; return its Pending."""
        if not x.is_cuda:
            return Job(self._pool.submit(fn))
        ready = torch.cuda.Event()
        ready.record()  # on the caller's current stream
        done = torch.cuda.Event()
        stream = self._stream(x.device)

        def run() -> torch.Tensor:
            with torch.cuda.device(x.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                x.record_stream(stream)  # the caller may drop x before the side stream is done
                out.record_stream(stream)
                result = fn()
                done.record(stream)
                return result

        return Job(self._pool.submit(run), done, x.device)


class Algorithm:
    """Base of the built-in algorithms: one `start` checks the arguments alike for all of them
    and hands `_start(x, send, recv, link, out)` a contiguous `x`, the splits as ints and the
    checked (or new) result buffer `out`.

    A subclass sets `name`, `links` and `self.topo`, and implements `_start`, which returns the
    Pending that fills `out` (only the rows of `link` when one is named)."""

    name: str
    links: tuple[str, ...]
    topo: Topology

    def start(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        link: str | None = None,
        out: torch.Tensor | None = None,
    ) -> Pending:
        """Start moving `x` [N, ...] by `send_splits`; the Pending yields `out` [sum(recv_splits),
        ...].

        Args:
            link: one of `links` moves only the pairs on that link (for an algorithm with two
                links), None moves them all.
            out: the result buffer; required with `link` on a two-link algorithm, since each part
                fills only its own rows of it.
        """
        check_link(self.name, link, self.links)
        check_splits(x, send_splits, recv_splits, self.topo.world)
        if link is not None and len(self.links) > 1 and out is None:
            raise ValueError(
                f"{self.name} with link={link!r} fills only part of the result; pass the shared "
                "buffer as out="
            )
        out = output_buffer(x, recv_splits, out)
        send, recv = [int(s) for s in send_splits], [int(s) for s in recv_splits]
        return self._start(x.contiguous(), send, recv, link, out)

    def _start(
        self, x: torch.Tensor, send: list[int], recv: list[int], link: str | None, out: torch.Tensor
    ) -> Pending:
        raise NotImplementedError


class Threaded(Algorithm):
    """Base of the single-link algorithms whose whole transfer runs on their own `CommThread`.

    A subclass sets `name`, calls `Threaded.__init__(self, topology)` (which sets `self.topo`
    and the instance's thread), and implements `_run(x, send, recv, out)`, which moves the rows
    and fills `out` (called on the thread, or on the calling thread where the backend forbids
    worker threads: NCCL). Its one link is "net"."""

    links = ("net",)

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        self._thread = CommThread(self.name)

    def _start(
        self, x: torch.Tensor, send: list[int], recv: list[int], link: str | None, out: torch.Tensor
    ) -> Done | Job:
        if self.topo.world == 1:
            return Done(out.copy_(x))
        run = lambda: self._run(x, send, recv, out)
        if issues_from_worker_thread(self.topo.group):
            return self._thread.submit(run, x, out)
        return self._thread.here(run, x, out)

    def _run(
        self, x: torch.Tensor, send: list[int], recv: list[int], out: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError


class Hierarchical(Threaded):
    """Base of the two-level algorithms (hier2d, leader): a `Threaded` algorithm with this node's
    group, `node_group` (tag "NAME.intra"), and the inter-node group of this rank's peers,
    `peer_group` (tag "NAME.inter": the ranks of its local rank on every node; None with one
    node, or on a rank whose local rank is not in `peers`).

    A subclass sets `name` and, where only some local ranks exchange across nodes, `peers`.
    new_group is collective: every rank creates all of the groups, members or not, in order."""

    peers: tuple[int, ...] | None = None  # the local ranks that have an inter-node group (all)

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self.node_group = node_group(topology, f"{self.name}.intra")
        self.peer_group = peer_group(topology, f"{self.name}.inter", local_ranks=self.peers)
