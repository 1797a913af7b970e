"""`leader`: one-dimensional hierarchical all-to-all through one leader rank per node.

Every rank of a node sends all its rows to the node's leader (local rank 0); the leaders run an
all-to-all among themselves, one message per pair of nodes; each leader scatters the rows that
arrived back to its node's ranks. The network then carries N - 1 large messages per node instead
of (P - M) small ones per rank, but one rank per node drives the whole node's traffic and every
row crosses the local link twice, so it pays off only when the network's per-message cost dominates.

Uneven splits: the leader must know each local rank's send and receive splits to cut, regroup and
scatter the rows, so the node's splits are all-gathered first (a few ints per rank); reading
them on the host is a HOST SYNC (`tolist`).

Asynchrony: like `hier2d`, every phase runs on the instance's comm thread (`_common.CommThread`)
so `start` returns before anything is sent and the caller's compute overlaps the whole chain;
`wait()` only joins. The groups (tags "leader.intra", "leader.inter") belong to this instance.
"""

from __future__ import annotations

import torch

from ._common import Hierarchical, exchange, gather_splits, permute_blocks
from .base import ALGORITHMS

__all__ = ["Leader"]


@ALGORITHMS.register("leader")
class Leader(Hierarchical):
    """Gather to the node leader, all-to-all among leaders, scatter back."""

    name = "leader"
    peers = (0,)  # only the leaders (local rank 0) exchange across nodes

    def _run(self, x: torch.Tensor, send: list[int], recv: list[int], out: torch.Tensor):
        rpn, nodes, world = self.topo.ranks_per_node, self.topo.nodes, self.topo.world
        leader = self.topo.local_rank == 0
        # 0. snd[l][d] / rcv[l][s]: the splits of local rank l (host sync when there are peers).
        both = gather_splits(send + recv, self.node_group, rpn)
        snd, rcv = [b[:world] for b in both], [b[world:] for b in both]
        # 1. Gather: each rank sends all its rows to local rank 0; they arrive as blocks
        #    (source local l, dest node n, dest local j).
        to_leader = [x.shape[0]] + [0] * (rpn - 1)
        from_ranks = [sum(snd[lr]) if leader else 0 for lr in range(rpn)]
        g = exchange(x, to_leader, from_ranks, self.node_group, rpn)
        if leader:
            # 2. Regroup to (n, j, l) and send node n its block; what arrives from node n is
            #    (source node n, dest local j, source local l).
            order = [
                lr * world + n * rpn + j
                for n in range(nodes)
                for j in range(rpn)
                for lr in range(rpn)
            ]
            y = permute_blocks(g, [c for row in snd for c in row], order)
            send2 = [
                sum(snd[lr][n * rpn + j] for j in range(rpn) for lr in range(rpn))
                for n in range(nodes)
            ]
            recv2 = [
                sum(rcv[j][n * rpn + lr] for j in range(rpn) for lr in range(rpn))
                for n in range(nodes)
            ]
            h = exchange(y, send2, recv2, self.peer_group, nodes)
            # 3. Regroup to (j, n, l): local rank j's rows, in source-rank order.
            sizes = [
                rcv[j][n * rpn + lr] for n in range(nodes) for j in range(rpn) for lr in range(rpn)
            ]
            order = [
                n * rpn * rpn + j * rpn + lr
                for j in range(rpn)
                for n in range(nodes)
                for lr in range(rpn)
            ]
            z = permute_blocks(h, sizes, order)
            to_ranks = [sum(rcv[j]) for j in range(rpn)]
        else:
            z, to_ranks = x.new_empty((0, *x.shape[1:])), [0] * rpn
        # 4. Scatter from the leader.
        from_leader = [sum(recv)] + [0] * (rpn - 1)
        exchange(z, to_ranks, from_leader, self.node_group, rpn, out=out)
        return out
