"""Chunk plans: which rows each chunk sends, receives and hands to which local expert.

Legend: P ranks, E experts, El = E / P local experts, r chunks.

The dispatch buffer of a rank is expert-major (expert e owns rows [off_e, off_e + n_e)), and the
experts of rank d are e in [d*El, (d+1)*El), so rows for lower ranks come first, as
all_to_all_single wants. A chunk receives rows stacked by source rank, then local expert; the
expert wants them by local expert, then source: `perm` reorders, `inv_perm` restores.

Partitions:
    capacity  chunk i takes rows [n*i//r, n*(i+1)//r) of every expert's n rows (near-equal, no
              padding); the receiver knows the sizes from the exchanged counts.
    peers     chunk i exchanges whole experts with the ranks at offsets o in [P*i//r, P*(i+1)//r):
              it sends to rank+o and receives from rank-o (FasterMoE's peer-group pipelining).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Chunk", "build_plan"]


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
    partition: str = "capacity",
    device: torch.device | str = "cpu",
) -> list[Chunk]:
    """Plan r chunks of one layer call.

    Args:
        counts: E rows per expert in this rank's dispatch buffer.
        recv_counts: [P][El], rows source rank s holds for each of this rank's local experts.
        rank: this rank.
        chunks: r.
        partition: "capacity" or "peers".
    """
    P = len(recv_counts)
    E = len(counts)
    if P == 0 or E % P:
        raise ValueError(f"{E} experts cannot be split over {P} ranks")
    El = E // P
    if partition == "peers" and chunks > P:
        raise ValueError(f"the peers partition needs chunks <= ranks, got chunks={chunks}, P={P}")
    if partition not in ("capacity", "peers"):
        raise ValueError(f"partition must be 'capacity' or 'peers', got {partition!r}")
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    plan = []
    for i in range(chunks):
        if partition == "capacity":
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
