"""`pairwise`: P-1 point-to-point steps, one peer pair at a time (MPI's large-message all-to-all).

Step s = 1..P-1 sends to (r + s) % P and receives from (r - s) % P, then waits before the next
step; the rows a rank keeps are a local copy. Only one pair is on the wire per rank at a time, so
this is the serialising baseline Pipe-A2A and the hierarchical algorithms are measured against.

The steps run on a comm thread owned by the instance (see `_common.CommThread`): `start` returns
at once and the caller computes while the thread drives the steps; a host loop is unavoidable
because each step must finish before the next one is posted. The thread issues every op of the
instance, in `start` order, on the instance's own communicator, so two transfers in flight never
mismatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dist.topology import Topology
from ._common import Threaded, offsets, world_group
from .base import ALGORITHMS

__all__ = ["Pairwise"]


@ALGORITHMS.register("pairwise")
class Pairwise(Threaded):
    """Serialised pairwise exchange over a communicator of its own (tag "pairwise")."""

    name = "pairwise"

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        # Its own communicator: ops issued from the comm thread never interleave with ops that
        # other code issues on the default group from the main thread.
        self.group = world_group(topology, "pairwise")

    def _run(self, x: torch.Tensor, send: list[int], recv: list[int], out: torch.Tensor):
        world, rank = self.topo.world, self.topo.rank
        so, ro = offsets(send), offsets(recv)
        # 0. The rows this rank keeps.
        out.narrow(0, ro[rank], recv[rank]).copy_(x.narrow(0, so[rank], send[rank]))
        # 1..P-1. One pair per step. Empty messages are still sent: every rank then posts the same
        # ops whatever the splits, which NCCL needs for its first p2p call on a communicator.
        for step in range(1, world):
            dst, src = (rank + step) % world, (rank - step) % world
            # The receive first (`_common.start_exchange` says why).
            ops = [
                dist.P2POp(
                    dist.irecv,
                    out.narrow(0, ro[src], recv[src]),
                    self.topo.global_rank(src),
                    self.group,
                ),
                dist.P2POp(
                    dist.isend,
                    x.narrow(0, so[dst], send[dst]),
                    self.topo.global_rank(dst),
                    self.group,
                ),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return out
