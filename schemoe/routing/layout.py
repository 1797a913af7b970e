"""Token layout: tokens into the expert-major dispatch buffer and back, and the chunk plans that
cut the buffer for the scheduled region. Index math only.

Legend: T tokens, M model dim, k choices, N = sum(counts) buffer rows, P ranks, E experts,
El = E / P local experts, r chunks.

    encode: x [T, M] -> rows [N, M]   row slot_TK[t, j] holds x[t]; unfilled rows are zero
    decode: rows [N, M] -> y [T, M]   y[t] = sum_j weight_TK[t, j] * rows[slot_TK[t, j]]

Both are gathers/scatters (index_copy / index_select / index_add), never a [T, E, C] one-hot
einsum, and both are differentiable in x, rows and the weights.

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
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .router import Routing

__all__ = ["Chunk", "Partition", "build_plan", "decode", "encode"]


class Partition(str, enum.Enum):
    """How chunks cut a layer call: token rows of every expert, or groups of peer ranks."""

    CAPACITY = "capacity"
    PEERS = "peers"

    def __str__(self) -> str:
        return self.value


def _choices(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token index, buffer row, weight, kept) of every choice, in choice-major order [k T].

    Dropped choices are not filtered out (that would be a data-dependent shape, a graph break
    under torch.compile): encode sends them to a spare row past the buffer, decode masks them."""
    slot = routing.slot_TK.t().reshape(-1)
    T, k = routing.slot_TK.shape
    token = torch.arange(T, device=slot.device).repeat(k)
    weight = routing.weight_TK.t().reshape(-1)
    return token, slot, weight, slot >= 0


def encode(x_TM: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Scatter tokens into the dispatch buffer [N, M] (each scaled by its choice's weight when
    the routing puts the weights on the experts' inputs)."""
    token, slot, weight, kept = _choices(routing)
    N = routing.rows
    picked = x_TM.index_select(0, token)
    if routing.weights_on_input:
        picked = picked * weight[:, None].to(picked.dtype)
    rows = x_TM.new_zeros((N + 1, x_TM.shape[1]))  # row N: where dropped choices land
    rows = rows.index_copy(0, torch.where(kept, slot, N), picked)
    return rows[:N]


def decode(rows_NM: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, accumulated in fp32, returned as `dtype`.

    On CPU index_add_ accumulates in a fixed order, so decode is deterministic there; on CUDA it
    uses atomics and the k-way sum order can vary between runs (not yet run on CUDA). A dropped
    choice adds an exact zero (masked, so a non-finite row cannot leak into it).
    """
    token, slot, weight, kept = _choices(routing)
    T = routing.slot_TK.shape[0]
    picked = rows_NM.index_select(0, slot.clamp(min=0)).float()
    if not routing.weights_on_input:  # else encode applied the weights
        picked = picked * weight[:, None]
    picked = torch.where(kept[:, None], picked, 0.0)
    y = torch.zeros((T, rows_NM.shape[1]), device=rows_NM.device, dtype=torch.float32)
    return y.index_add(0, token, picked).to(dtype)


@dataclass(frozen=True)
class Chunk:
    send_idx: torch.Tensor | None  # rows of the dispatch buffer, in send order; None = all rows
    send_splits: tuple[int, ...]  # rows to each rank
    recv_splits: tuple[int, ...]  # rows from each rank
    perm: torch.Tensor | None  # received order -> expert order; None = identity
    inv_perm: torch.Tensor | None
    expert_counts: tuple[int, ...]  # rows per local expert, in expert order

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


def _part(n: int, i: int, r: int) -> tuple[int, int]:
    return n * i // r, n * (i + 1) // r


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
            send = [_part(counts[e], i, chunks) for e in range(E)]
            recv = [[_part(recv_counts[s][el], i, chunks) for el in range(El)] for s in range(P)]
        else:
            lo, hi = _part(P, i, chunks)
            to = {(rank + o) % P for o in range(lo, hi)}
            frm = {(rank - o) % P for o in range(lo, hi)}
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
