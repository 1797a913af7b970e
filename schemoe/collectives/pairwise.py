"""`pairwise`: P-1 point-to-point steps, one peer pair at a time (MPI's large-message all-to-all).

Step s = 1..P-1 sends to (r + s) % P and receives from (r - s) % P, then waits before the next
step; the rows a rank keeps are a local copy. Only one pair is on the wire per rank at a time, so
this is the serialising baseline Pipe-A2A and the hierarchical algorithms are measured against.

The steps run on a comm thread owned by the instance (see `CommThread`): `start` returns at once
and the caller computes while the thread drives the steps; a host loop is unavoidable because each
step must finish before the next one is posted. The thread issues every op of the instance, in
`start` order, on the instance's own communicator, so two transfers in flight never mismatch.

This module also holds the small helpers the other algorithms share (offsets, output buffer
checks, the comm thread); they sit here because this file was the first to need them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..topology import Topology
from .base import ALGORITHMS, Done, check_splits

__all__ = ["CommThread", "Job", "Pairwise", "check_link", "offsets", "output_buffer"]


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


class Job:
    """Pending result of work running on a `CommThread`; `wait` re-raises what the work raised."""

    def __init__(self, future: Future, done: torch.cuda.Event | None = None) -> None:
        self._future = future
        self._done = done

    def wait(self) -> torch.Tensor:
        # Blocks until the thread finishes; a collective that times out raises RuntimeError there.
        out = self._future.result()
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
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

    On CUDA (untested here: no multi-GPU machine) the work runs on a side stream that first waits
    for the caller's stream, and `Job.wait` makes the caller's stream wait for the side stream.
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"schemoe-{name}")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def submit(self, fn: Callable[[], torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> Job:
        """Run `fn()` (which reads `x` and fills `out`) on the thread; return its Pending."""
        if not x.is_cuda:
            return Job(self._pool.submit(fn))
        ready = torch.cuda.Event()
        ready.record()  # on the caller's current stream
        done = torch.cuda.Event()
        stream = self._streams.setdefault(x.device, torch.cuda.Stream(x.device))

        def run() -> torch.Tensor:
            with torch.cuda.device(x.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                x.record_stream(stream)  # the caller may drop x before the side stream is done
                out.record_stream(stream)
                result = fn()
                done.record(stream)
                return result

        return Job(self._pool.submit(run), done)


@ALGORITHMS.register("pairwise")
class Pairwise:
    """Serialised pairwise exchange over a communicator of its own (tag "pairwise")."""

    name = "pairwise"
    links = ("net",)

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        world = tuple(range(topology.world))
        # Its own communicator: ops issued from the comm thread never interleave with ops that
        # other code issues on the default group from the main thread.
        self.group = topology.subgroup(world, tag="pairwise") if topology.world > 1 else None
        self._thread = CommThread("pairwise")

    def start(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        link: str | None = None,
        out: torch.Tensor | None = None,
    ) -> Done | Job:
        """Start moving `x` [N, ...] by `send_splits`; the Pending yields [sum(recv_splits), ...]."""
        check_link(self.name, link, self.links)
        check_splits(x, send_splits, recv_splits, self.topo.world)
        out = output_buffer(x, recv_splits, out)
        if self.topo.world == 1:
            return Done(out.copy_(x))
        x = x.contiguous()
        send, recv = [int(s) for s in send_splits], [int(s) for s in recv_splits]
        return self._thread.submit(lambda: self._run(x, send, recv, out), x, out)

    def _run(self, x: torch.Tensor, send: list[int], recv: list[int], out: torch.Tensor):
        world, rank = self.topo.world, self.topo.rank
        so, ro = offsets(send), offsets(recv)
        # 0. The rows this rank keeps.
        out.narrow(0, ro[rank], recv[rank]).copy_(x.narrow(0, so[rank], send[rank]))
        # 1..P-1. One pair per step. Empty messages are still sent: every rank then posts the same
        # ops whatever the splits, which NCCL needs for its first p2p call on a communicator.
        for step in range(1, world):
            dst, src = (rank + step) % world, (rank - step) % world
            ops = [
                dist.P2POp(
                    dist.isend,
                    x.narrow(0, so[dst], send[dst]),
                    self.topo.global_rank(dst),
                    self.group,
                ),
                dist.P2POp(
                    dist.irecv,
                    out.narrow(0, ro[src], recv[src]),
                    self.topo.global_rank(src),
                    self.group,
                ),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return out
