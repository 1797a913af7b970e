"""`hier2d`: two-dimensional hierarchical all-to-all (the 2DH idea of Tutel).

Ranks are (node n, local rank l). Instead of P small network messages per rank, it does
  1. an intra-node all-to-all that hands local rank j every row bound for (any node, local j),
  2. a local permute that groups those rows by destination node,
  3. an inter-node all-to-all among the same-local-rank peers (one per node),
so each rank sends N - 1 larger network messages instead of P - M, at the price of moving every
row once more over the node's local link. With the block order used here the rows arrive from
step 3 already in source-rank order, so the final "permute back" is the identity.

Uneven splits: step 1 needs to know how many rows each local peer sends for each destination,
which only that peer knows. The node's send splits are therefore all-gathered first (a few ints),
and reading them on the host is a HOST SYNC (`tolist`). Step 3's receive sizes follow from this
rank's own `recv_splits`.

Asynchrony: every phase runs on the instance's comm thread (`pairwise.CommThread`), so `start`
returns before anything is sent and the caller computes while the thread does the split exchange,
both all-to-alls and the permutes; `wait()` only joins. Running the later phases in `wait()`
would keep the link idle during the caller's compute. The groups (tags "hier2d.intra" and
"hier2d.inter") belong to this instance, so ops from its thread never interleave with ops other
code posts on shared groups from another thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..topology import Topology
from .base import ALGORITHMS, Done, check_splits
from .pairwise import CommThread, Job, check_link, output_buffer

__all__ = ["Hier2D", "exchange", "gather_splits", "permute_blocks"]


def permute_blocks(y: torch.Tensor, sizes: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Reorder the row blocks of `y` (block i has sizes[i] rows, in order) to `order`."""
    if list(order) == list(range(len(sizes))):
        return y
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    return torch.cat([y.narrow(0, starts[i], sizes[i]) for i in order])


def gather_splits(values: list[int], group, size: int, device: torch.device) -> list[list[int]]:
    """Every member's `values` (same length on all), by group rank. Collective; HOST SYNC.

    The ints travel on `device` so that the group's backend (gloo: CPU, NCCL: CUDA) accepts them.
    """
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts).tolist()  # host sync: the next phase's splits depend on these


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
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


@ALGORITHMS.register("hier2d")
class Hier2D:
    """2D hierarchical all-to-all: node exchange, permute, exchange among same-local-rank peers."""

    name = "hier2d"
    links = ("net",)

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        rpn, world = topology.ranks_per_node, topology.world
        # new_group is collective: every rank creates all of them, in the same order.
        self.node_group = self.peer_group = None
        if rpn > 1:
            nodes = [
                topology.subgroup(tuple(range(n * rpn, (n + 1) * rpn)), tag="hier2d.intra")
                for n in range(topology.nodes)
            ]
            self.node_group = nodes[topology.node]
        if topology.nodes > 1:
            peers = [
                topology.subgroup(tuple(range(lr, world, rpn)), tag="hier2d.inter")
                for lr in range(rpn)
            ]
            self.peer_group = peers[topology.local_rank]
        self._thread = CommThread("hier2d")

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
        rpn, nodes, me = self.topo.ranks_per_node, self.topo.nodes, self.topo.local_rank
        # 0. cnt[l][d]: rows local rank l sends to rank d (host sync when the node has peers).
        if rpn > 1:
            cnt = gather_splits(send, self.node_group, rpn, x.device)
        else:
            cnt = [send]
        # 1. Blocks (dest node n, dest local j) -> (j, n); local rank j gets all its column.
        y = permute_blocks(x, send, [n * rpn + j for j in range(rpn) for n in range(nodes)])
        send1 = [sum(send[n * rpn + j] for n in range(nodes)) for j in range(rpn)]
        recv1 = [sum(cnt[lr][n * rpn + me] for n in range(nodes)) for lr in range(rpn)]
        z = exchange(y, send1, recv1, self.node_group, rpn)
        # 2. Received blocks (source local l, dest node n) -> (n, l), grouped by destination node.
        sizes = [cnt[lr][n * rpn + me] for lr in range(rpn) for n in range(nodes)]
        w = permute_blocks(z, sizes, [lr * nodes + n for n in range(nodes) for lr in range(rpn)])
        # 3. Exchange with the peer of local rank `me` on every node. What arrives from node n is
        #    its ranks' rows for this rank in local-rank order: the result, in source-rank order.
        send3 = [sum(cnt[lr][n * rpn + me] for lr in range(rpn)) for n in range(nodes)]
        recv3 = [sum(recv[n * rpn + lr] for lr in range(rpn)) for n in range(nodes)]
        exchange(w, send3, recv3, self.peer_group, nodes, out=out)
        return out
