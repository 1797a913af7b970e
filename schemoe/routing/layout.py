"""Token layout: tokens into the expert-major dispatch buffer and back, and the chunk plans that
cut the buffer for the scheduled region. Index math only.

Legend: T tokens, M model dim, k choices, N = sum(counts) buffer rows, P ranks, E experts,
El = E / P local experts, r chunks.

    encode: x [T, M] -> rows [N, M]   row slot_TK[t, j] holds x[t]; unfilled rows are zero
    decode: rows [N, M] -> y [T, M]   y[t] = sum_j weight_TK[t, j] * rows[slot_TK[t, j]]

Both are row gathers (rowmap.py), never a [T, E, C] one-hot einsum, each the other's backward,
and both are differentiable in x, rows and the weights.

Chunk plans (`build_plan`): the dispatch buffer of a rank is expert-major (expert e owns rows
[off_e, off_e + n_e)), and the experts of rank d are e in [d*El, (d+1)*El), so rows for lower
ranks come first, as all_to_all_single wants. A chunk receives rows stacked by source rank, then
local expert; the expert wants them by local expert, then source: `perm` reorders, `inv_perm`
restores.

Partitions:
    capacity  chunk i takes rows [n*i//r, n*(i+1)//r) of every expert's n rows (near-equal, no
              padding); the receiver knows the sizes from the exchanged counts.
    peers     chunk i exchanges whole experts with the ranks at offsets o in [P*i//r, P*(i+1)//r):
              it sends to rank+o and receives from rank-o (FasterMoE's peer-group pipelining).

With token deduplication a chunk also carries a `Unique` plan (built by the dispatcher from
routing/dedup.py's index math): the unique rows its transfers move instead of the expanded ones.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .router import Routing
from .rowmap import gather_sum, scatter_rows

__all__ = [
    "Chunk",
    "Partition",
    "Unique",
    "build_plan",
    "chunk_part",
    "decode",
    "encode",
    "peer_ranks",
]


class Partition(str, enum.Enum):
    """How chunks cut a layer call: token rows of every expert, or groups of peer ranks."""

    CAPACITY = "capacity"
    PEERS = "peers"

    def __str__(self) -> str:
        return self.value


def _index(routing: Routing):
    """(slot_TK, kept_TK, choice_N, filled_N), the arguments of the row ops (rowmap.py).

    slot_TK: every choice's row (dropped: 0, masked). choice_N: the flat choice t k + j that fills
    buffer row n (unfilled: 0, masked). Dropless routing (`counts_E` set) keeps every choice and
    fills every row (slot is a permutation of [0, T k)): both masks are None, nothing is masked.
    Dropped choices are not filtered out (that would be a data-dependent shape, a graph break
    under torch.compile): they scatter their choice index to a spare row past the buffer."""
    slot_TK = routing.slot_TK
    T, k = slot_TK.shape
    N = routing.rows
    choice_C = torch.arange(T * k, device=slot_TK.device)
    if routing.counts_E is not None:
        choice_N = torch.empty_like(choice_C).scatter_(0, slot_TK.reshape(-1), choice_C)
        return slot_TK, None, choice_N, None
    kept_TK = slot_TK >= 0
    dest_C = torch.where(kept_TK, slot_TK, N).reshape(-1)  # row N: where dropped choices go
    choice_N = slot_TK.new_zeros(N + 1).scatter_(0, dest_C, choice_C)[:N]
    filled_N = torch.zeros(N + 1, dtype=torch.bool, device=slot_TK.device)
    filled_N = filled_N.scatter_(0, dest_C, True)[:N]
    return slot_TK.clamp(min=0), kept_TK, choice_N, filled_N


def encode(x_TM: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Scatter tokens into the dispatch buffer [N, M] (each scaled by its choice's weight when
    the routing puts the weights on the experts' inputs, in x's dtype). One row gather; its
    backward is decode's gather (no weights: a plain k-way sum), in x's dtype."""
    w_TK = routing.weight_TK.to(x_TM.dtype) if routing.weights_on_input else None
    return scatter_rows(x_TM, w_TK, *_index(routing))


def decode(rows_NM: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, accumulated in fp32, returned as `dtype`.

    The k choices are summed one at a time in choice order, on CPU and CUDA alike (no atomics):
    deterministic. A dropped choice adds an exact zero (masked, so a non-finite row cannot leak
    into it). The backward is encode's scatter of the weighted gradient (rowmap.py)."""
    w_TK = None if routing.weights_on_input else routing.weight_TK  # else encode applied them
    return gather_sum(rows_NM, w_TK, *_index(routing)).to(dtype)


@dataclass(frozen=True)
class Unique:
    """One chunk's unique rows (routing/dedup.py). Sender: rows [lo, hi) of its unique buffer,
    `send_splits` to each rank. Receiver: `recv_splits` from each rank; over the chunk's expanded
    rows in expert order, `expand` [R] their received unique rows, `rows` their places among all
    the call's received expanded rows and `weights` their combine weights (fp32, no gradient)."""

    lo: int
    hi: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    expand: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True)
class Chunk:
    send_idx: torch.Tensor | None  # rows of the dispatch buffer, in send order; None = all rows
    send_splits: tuple[int, ...]  # rows to each rank
    recv_splits: tuple[int, ...]  # rows from each rank
    perm: torch.Tensor | None  # received order -> expert order; None = identity
    inv_perm: torch.Tensor | None
    expert_counts: tuple[int, ...]  # rows per local expert, in expert order
    unique: Unique | None = None  # token deduplication (dedup.py): the unique rows' plan

    @property
    def send_rows(self) -> int:
        return sum(self.send_splits)

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_splits)


def _segments_index(segs: list[tuple[int, int]], device) -> torch.Tensor:
    """The row indices of the (start, length) segments, in order."""
    parts = [torch.arange(a, a + n, device=device) for a, n in segs if n]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


def chunk_part(n: int, i: int, r: int) -> tuple[int, int]:
    """Rows [lo, hi) of n that chunk i of r takes (near-equal parts, no padding)."""
    return n * i // r, n * (i + 1) // r


def peer_ranks(rank: int, world: int, chunk: int, chunks: int) -> tuple[set[int], set[int]]:
    """The peers partition's chunk `chunk`: the ranks this rank sends to (rank + o) and receives
    from (rank - o), for the offsets o in [P i // r, P (i + 1) // r)."""
    lo, hi = chunk_part(world, chunk, chunks)
    offsets = range(lo, hi)
    return {(rank + o) % world for o in offsets}, {(rank - o) % world for o in offsets}


def build_plan(
    counts: Sequence[int],
    recv_counts: Sequence[Sequence[int]],
    rank: int,
    chunks: int,
    partition: Partition | str = Partition.CAPACITY,
    device: torch.device | str = "cpu",
) -> list[Chunk]:
    """Plan r chunks of one layer call.

    Args:
        counts: E rows per expert in this rank's dispatch buffer.
        recv_counts: [P][El], rows source rank s holds for each of this rank's local experts.
        rank: this rank.
        chunks: r.
        partition: Partition.CAPACITY or Partition.PEERS.
    """
    P = len(recv_counts)
    E = len(counts)
    if P == 0 or E % P:
        raise ValueError(f"{E} experts cannot be split over {P} ranks")
    El = E // P
    if partition not in tuple(Partition):
        raise ValueError(f"partition must be 'capacity' or 'peers', got {partition!r}")
    if partition == Partition.PEERS and chunks > P:
        raise ValueError(f"the peers partition needs chunks <= ranks, got chunks={chunks}, P={P}")
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    plan = []
    for i in range(chunks):
        if partition == Partition.CAPACITY:
            send = [chunk_part(counts[e], i, chunks) for e in range(E)]
            recv = [
                [chunk_part(recv_counts[s][el], i, chunks) for el in range(El)] for s in range(P)
            ]
        else:
            to, frm = peer_ranks(rank, P, i, chunks)
            send = [(0, counts[e]) if e // El in to else (0, 0) for e in range(E)]
            recv = [
                [(0, recv_counts[s][el]) if s in frm else (0, 0) for el in range(El)]
                for s in range(P)
            ]
        segs = [(offs[e] + a, b - a) for e, (a, b) in enumerate(send)]
        send_splits = tuple(sum(b - a for a, b in send[d * El : (d + 1) * El]) for d in range(P))
        full = chunks == 1 or all(n == counts[e] for e, (_, n) in enumerate(segs))
        send_idx = None if full else _segments_index(segs, device)
        sizes = [[b - a for a, b in recv[s]] for s in range(P)]
        recv_splits = tuple(sum(row) for row in sizes)
        # received order: (s, el); expert order: (el, s)
        start, pos = 0, {}
        for s in range(P):
            for el in range(El):
                pos[(s, el)] = start
                start += sizes[s][el]
        order = [(pos[(s, el)], sizes[s][el]) for el in range(El) for s in range(P)]
        identity = P == 1 or El == 1
        perm = None if identity else _segments_index(order, device)
        inv = None
        if perm is not None:
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=device)
        expert_counts = tuple(sum(sizes[s][el] for s in range(P)) for el in range(El))
        plan.append(Chunk(send_idx, send_splits, recv_splits, perm, inv, expert_counts))
    return plan
