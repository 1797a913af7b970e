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

Asynchrony: every phase runs on the instance's comm thread (`_common.CommThread`), so `start`
returns before anything is sent and the caller computes while the thread does the split exchange,
both all-to-alls and the permutes; `wait()` only joins. Running the later phases in `wait()`
would keep the link idle during the caller's compute. The groups (tags "hier2d.intra" and
"hier2d.inter") belong to this instance, so ops from its thread never interleave with ops other
code posts on shared groups from another thread.
"""

from __future__ import annotations

import torch

from ._common import Hierarchical, exchange, gather_splits, permute_blocks
from .base import ALGORITHMS

__all__ = ["Hier2D"]


@ALGORITHMS.register("hier2d")
class Hier2D(Hierarchical):
    """2D hierarchical all-to-all: node exchange, permute, exchange among same-local-rank peers."""

    name = "hier2d"

    def _run(self, x: torch.Tensor, send: list[int], recv: list[int], out: torch.Tensor):
        rpn, nodes, me = self.topo.ranks_per_node, self.topo.nodes, self.topo.local_rank
        # 0. cnt[l][d]: rows local rank l sends to rank d (host sync when the node has peers).
        cnt = gather_splits(send, self.node_group, rpn)
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
