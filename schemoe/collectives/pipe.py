"""`pipe` (Pipe-A2A, ScheMoE section 2): intra-node and inter-node pairs move at the same time.

A plain all-to-all posts all P pairs on one communicator, so a node's local pairs (M of them) and
its network pairs (P - M) share one queue: t = M*t1 + (P - M)*t2. Pipe-A2A splits the pairs by
link and drives each link on its own communicator, so t = max(M*t1, (P - M)*t2). The bytes are
exactly naive's: every (source, destination) pair is moved once, by one of the two parts.

Which communicators, and why:
- intra: one group per node (tag "pipe.intra"), one all-to-all over the node's ranks.
  A node's ranks are contiguous (node-major layout), so the rows it sends to them are one slice
  of `x` and the rows it receives from them one slice of `out`: the op writes straight into the
  shared buffer, and it never waits on a rank of another node (a world-wide op with the remote
  splits zeroed would still exchange an empty message with every remote rank).
- inter: one world-spanning group (tag "pipe.inter") carrying isend/irecv pairs to every rank of
  the other nodes. The remote sources are not contiguous in `out` (they sit before and after
  this node's block), so a collective would need a staging buffer and a copy; point-to-point
  receives land in their slots of `out` directly. Empty pairs are still posted so every rank
  posts the same ops (NCCL wants all ranks in a communicator's first batched p2p call), and
  every receive is posted before any send (on gloo a send posted first moves the pair's two
  directions one after the other: `_common.start_exchange`).

Both parts are issued from the calling thread with async ops, so `start` never blocks, and there
is no host sync. The scheduler may start the parts separately: `start(..., link="intra", out=buf)`
and `start(..., link="inter", out=buf)` fill disjoint rows of one buffer, in either order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dist.topology import Topology
from ._common import Algorithm, node_group, offsets, start_exchange, world_group
from .base import ALGORITHMS, Done, Works

__all__ = ["Pipe"]


@ALGORITHMS.register("pipe")
class Pipe(Algorithm):
    """Pipe-A2A: node groups for the local link, one world group for the network link."""

    name = "pipe"
    links = ("intra", "inter")

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        # new_group is collective: every rank creates every node's group, in node order.
        self.node_group = node_group(topology, "pipe.intra")
        self.world_group = world_group(topology, "pipe.inter") if topology.nodes > 1 else None

    def _start(
        self, x: torch.Tensor, send: list[int], recv: list[int], link: str | None, out: torch.Tensor
    ) -> Done | Works:
        """Both parts when `link` is None, else only the "intra" pairs (within this node, this
        rank's own rows included) or the "inter" pairs (across nodes)."""
        works = []
        if link in (None, "intra"):
            works += self._intra(x, send, recv, out)
        if link in (None, "inter"):
            works += self._inter(x, send, recv, out)
        return Works(works, out, x) if works else Done(out)

    def _intra(self, x: torch.Tensor, send: list[int], recv: list[int], out: torch.Tensor):
        rpn = self.topo.ranks_per_node
        lo, hi = self.topo.node * rpn, (self.topo.node + 1) * rpn
        so, ro = offsets(send), offsets(recv)
        src = x.narrow(0, so[lo], so[hi] - so[lo])
        dst = out.narrow(0, ro[lo], ro[hi] - ro[lo])
        if self.node_group is None:  # one rank per node: only its own rows stay local
            dst.copy_(src)
            return []
        return start_exchange(src, send[lo:hi], recv[lo:hi], self.node_group, dst)

    def _inter(self, x: torch.Tensor, send: list[int], recv: list[int], out: torch.Tensor):
        if self.world_group is None:  # one node: nothing crosses the network
            return []
        so, ro = offsets(send), offsets(recv)
        peers = [p for p in range(self.topo.world) if not self.topo.same_node(p)]
        # Every receive before any send (`_common.start_exchange` says why).
        ops = [
            dist.P2POp(
                dist.irecv,
                out.narrow(0, ro[p], recv[p]),
                self.topo.global_rank(p),
                self.world_group,
            )
            for p in peers
        ]
        ops += [
            dist.P2POp(
                dist.isend, x.narrow(0, so[p], send[p]), self.topo.global_rank(p), self.world_group
            )
            for p in peers
        ]
        return dist.batch_isend_irecv(ops)
