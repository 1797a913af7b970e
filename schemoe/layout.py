"""Move tokens into the expert-major dispatch buffer and back. Index math only.

Legend: T tokens, M model dim, k choices, N = sum(counts) buffer rows.

    encode: x [T, M] -> rows [N, M]   row slot_TK[t, j] holds x[t]; unfilled rows are zero
    decode: rows [N, M] -> y [T, M]   y[t] = sum_j weight_TK[t, j] * rows[slot_TK[t, j]]

Both are gathers/scatters (index_copy / index_select / index_add), never a [T, E, C] one-hot
einsum, and both are differentiable in x, rows and the weights.
"""

from __future__ import annotations

import torch

from .gating.router import Routing

__all__ = ["decode", "encode"]


def _kept(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token index, buffer row, weight) of every kept choice, in choice-major order."""
    slot = routing.slot_TK.t().reshape(-1)
    T = routing.slot_TK.shape[0]
    token = torch.arange(T, device=slot.device).repeat(routing.slot_TK.shape[1])
    weight = routing.weight_TK.t().reshape(-1)
    keep = slot >= 0
    return token[keep], slot[keep], weight[keep]


def encode(x_TM: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Scatter tokens into the dispatch buffer [N, M]."""
    token, slot, _ = _kept(routing)
    rows = x_TM.new_zeros((routing.rows, x_TM.shape[1]))
    return rows.index_copy(0, slot, x_TM.index_select(0, token))


def decode(rows_NM: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, accumulated in fp32, returned as `dtype`.

    On CPU index_add_ accumulates in a fixed order, so decode is deterministic there; on CUDA it
    uses atomics and the k-way sum order can vary between runs (not yet run on CUDA).
    """
    token, slot, weight = _kept(routing)
    T = routing.slot_TK.shape[0]
    picked = rows_NM.index_select(0, slot).float() * weight[:, None]
    y = torch.zeros((T, rows_NM.shape[1]), device=rows_NM.device, dtype=torch.float32)
    return y.index_add(0, token, picked).to(dtype)
