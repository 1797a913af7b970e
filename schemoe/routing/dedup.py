"""Token deduplication per destination rank: a token goes once to every rank that holds one of its
chosen experts, not once per chosen expert, and that rank copies it to those experts. Index math
only; the dispatcher (schemoe.layer.dispatcher) runs the exchanges, the region (region.py) the
copies and sums.

Legend: T tokens, k choices, E experts, P ranks, El = E / P, r chunks, Q = r P (chunk, rank)
pairs, N = T k expanded rows (dropless: every choice one row), U unique rows (one per token and
(chunk, rank) pair its choices reach), R a chunk's received expanded rows.

What moves: every all-to-all carries unique rows, U instead of N, both ways, forward and
backward. The dispatch sends a token once per (chunk, rank); the receiver copies it to its chosen
experts there, applies the combine weights (sent once per call with the row indices, fp32) and
sums the copies' outputs in fp32, so the combine sends one row back per unique row; the sender
sums a token's unique rows. Backward: the output gradient goes out once per unique row, the
receiver forms each copy's (w g) and the weights' gradients (<g, expert output>, sent back once
per call), and sums the copies' input gradients before sending them back. At E=64 k=6 on 2 ranks
a token reaches 1.98 ranks on average: a third of the rows.

Sender, before the counts read (device ops, no host sync):
    q of a choice  = chunk i * P + destination rank d; the chunk is the one the plan
                     (layout.build_plan) puts the choice's row in, from its place among its
                     expert's rows (capacity partition) or from d (peers partition)
    unique buffer  = q-major, each q's rows in token order: a token once per q
    uloc_N         = each expanded row's unique row within its (chunk, destination) segment,
                     sent to the destination with the row layout of the expanded rows
Receiver, per chunk (`receive`): `expand` maps each expanded row, in expert order, to a row of
the chunk's received unique rows (stacked by source rank); `sum_copies` sums every unique row's
copies in expert order. The sums are index_add_: in row order on CPU; on CUDA atomic unless
torch.use_deterministic_algorithms(True), which gives torch's deterministic kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import Partition, chunk_part, peer_ranks
from .router import Routing

__all__ = [
    "UniqueLayout",
    "decode_unique",
    "encode_unique",
    "receive",
    "sum_copies",
    "unique_layout",
]


def _chunk_of(position: torch.Tensor, size: torch.Tensor, chunks: int) -> torch.Tensor:
    """The chunk i whose `chunk_part(size, i, chunks)` holds `position`: ceil(r (p+1) / n) - 1."""
    return (chunks * (position + 1) + size - 1) // size - 1


@dataclass(frozen=True)
class UniqueLayout:
    """The sender's side of one call (device tensors): `counts_Q` unique rows per (chunk, rank);
    `uloc_N` every expanded row's unique row within its (chunk, rank) segment; `present_QT` which
    (q, t) pairs have a unique row, `pos_QT` its row where present."""

    counts_Q: torch.Tensor
    uloc_N: torch.Tensor
    present_QT: torch.Tensor
    pos_QT: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """T, the tokens routed."""
        return self.present_QT.numel() // self.counts_Q.numel()

    def token_of(self, rows: int) -> torch.Tensor:
        """token_U [U] (U = `rows`, read with the counts): the token each unique row holds."""
        T = self.num_tokens
        dest = torch.where(self.present_QT, self.pos_QT, rows)  # absent pairs: a spare row
        t = torch.arange(T, device=dest.device).repeat(self.counts_Q.numel())
        return t.new_zeros(rows + 1).scatter_(0, dest, t)[:rows]


def encode_unique(x_TM: torch.Tensor, token_U: torch.Tensor) -> torch.Tensor:
    """The unique buffer [U, M]: row u holds token token_U[u]. Differentiable in x (autograd's
    index_add_ sums each token's rows: in row order on CPU; on CUDA deterministic under
    torch.use_deterministic_algorithms, as every index_add_ here)."""
    return x_TM.index_select(0, token_U)


def decode_unique(out_UM: torch.Tensor, token_U: torch.Tensor, tokens: int, dtype) -> torch.Tensor:
    """y [T, M] in `dtype`: each token's unique rows summed in fp32, in row order (the receivers
    weighted and summed its experts' outputs already). Differentiable in the rows."""
    y_TM = out_UM.new_zeros((tokens, out_UM.shape[1]), dtype=torch.float32)
    return y_TM.index_add(0, token_U, out_UM.float()).to(dtype)


def sum_copies(rows_RM: torch.Tensor, expand: torch.Tensor, n: int, w_R=None) -> torch.Tensor:
    """[n, M]: each unique row's copies (rows_RM[r] for expand[r] = u) summed in row order, each
    times w_R[r] first where given (then in fp32, returned in fp32); not differentiable."""
    if w_R is not None:
        rows_RM = rows_RM.float() * w_R[:, None]
    out = rows_RM.new_zeros((n, rows_RM.shape[1]))
    return out.index_add_(0, expand, rows_RM)


def unique_layout(
    routing: Routing,
    world: int,
    rank: int,
    chunks: int,
    partition: Partition | str = Partition.CAPACITY,
) -> UniqueLayout:
    """The sender's unique layout of a dropless routing (`routing.counts_E` set), on its device."""
    if routing.counts_E is None:
        raise ValueError("token deduplication needs dropless routing (capacity_factor=0)")
    slot_TK, expert_TK, counts_E = routing.slot_TK, routing.expert_TK, routing.counts_E
    T = slot_TK.shape[0]
    E, P, r = counts_E.numel(), world, chunks
    El, Q = E // P, chunks * world
    dest_TK = expert_TK // El
    if Partition(partition) == Partition.CAPACITY:
        offset_E = torch.cumsum(counts_E, 0) - counts_E
        n_TK = counts_E[expert_TK]
        chunk_TK = _chunk_of(slot_TK - offset_E[expert_TK], n_TK, r)
    else:  # peers: chunk i carries the ranks at offsets [P i // r, P (i + 1) // r)
        chunk_TK = _chunk_of((dest_TK - rank) % P, torch.full_like(dest_TK, P), r)
    q_TK = chunk_TK * P + dest_TK
    key_TK = q_TK * T + torch.arange(T, device=slot_TK.device)[:, None]
    present = torch.zeros(Q * T, dtype=torch.bool, device=slot_TK.device)
    present[key_TK.reshape(-1)] = True
    pos_QT = torch.cumsum(present, 0) - 1  # unique row of each present (q, t)
    counts_Q = present.view(Q, T).sum(1)
    start_Q = torch.cumsum(counts_Q, 0) - counts_Q
    uloc_TK = pos_QT[key_TK] - start_Q[q_TK]
    uloc_N = torch.empty_like(uloc_TK.reshape(-1))
    uloc_N[slot_TK.reshape(-1)] = uloc_TK.reshape(-1)
    return UniqueLayout(counts_Q, uloc_N, present, pos_QT)


def receive(
    uloc_R: torch.Tensor,
    recv_counts: Sequence[Sequence[int]],
    unique_recv: Sequence[Sequence[int]],
    chunk: int,
    chunks: int,
    rank: int,
    partition: Partition | str,
    perm: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expand, rows) of chunk `chunk` at the receiver, both over its expanded rows in expert
    order: `rows` their places among all received expanded rows (source-major, then local
    expert, each expert's rows in the sender's order; the plan's cut of them), `expand` their
    unique rows among the chunk's received ones (stacked by source): `uloc_R`, each received
    expanded row's unique row within its source's segment, shifted by the source's place.

    recv_counts: [P][El] expanded rows from each source per local expert; unique_recv: [r][P]
    unique rows from each source per chunk; perm: the chunk's received -> expert order."""
    P, El = len(recv_counts), len(recv_counts[0])
    segs, shifts = [], []
    base, shift = 0, 0
    _, sources = peer_ranks(rank, P, chunk, chunks)
    for s in range(P):
        for el in range(El):
            n = recv_counts[s][el]
            if Partition(partition) == Partition.CAPACITY:
                a, b = chunk_part(n, chunk, chunks)
            else:
                a, b = (0, n) if s in sources else (0, 0)
            if b > a:
                segs.append((base + a, b - a))
                shifts.append(shift)
            base += n
        shift += unique_recv[chunk][s]
    device = uloc_R.device
    if not segs:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty
    total = sum(n for _, n in segs)  # given: no device sync for the output sizes
    starts = torch.tensor([a for a, _ in segs], device=device)
    lengths = torch.tensor([n for _, n in segs], device=device)
    first = torch.cumsum(lengths, 0) - lengths  # each segment's first place in `rows`
    shift = torch.tensor(shifts, device=device)
    rows = torch.arange(total, device=device)
    rows += torch.repeat_interleave(starts - first, lengths, output_size=total)
    offset = torch.repeat_interleave(shift, lengths, output_size=total)
    if perm is not None:
        rows, offset = rows.index_select(0, perm), offset.index_select(0, perm)
    return uloc_R.index_select(0, rows) + offset, rows
