"""The two index ops under encode and decode, each the other's adjoint, with hand-written backward.

Legend: T tokens, M model dim, k choices, N buffer rows.

    scatter:  rows[n] = w_N[n] * x[token_N[n]]                  (unfilled rows: 0)
    gather:   y[t]    = sum_j w_TK[t, j] * rows[slot_TK[t, j]]  (dropped choices: 0)

The backward of one is the other (plus the weights' gradient, a row-wise dot product), so neither
direction zero-fills an [N, M] buffer to scatter-add into it: every op is a row gather
(index_select) of [T, M] or [N, M] rows, then elementwise work in place on its fresh result.

The gather sums the k choices left to right, y = (w_0 r_0 + w_1 r_1) + ..., each r_j a [T, M]
gather (no [N, M] intermediate): one fixed order on every device (no atomics), deterministic.
Masks are None where nothing is dropped or unfilled (dropless routing): no masking pass then.
Dropped choices and unfilled rows give exact zeros (masked_fill, so a non-finite row never leaks).

`acc` is the gather's accumulation dtype: fp32 in decode; in encode's backward the gradient's
dtype (x's), the dtype autograd sums x's gradient in.
"""

from __future__ import annotations

import torch

__all__ = ["gather_sum", "scatter_rows"]


def _gather(rows_NM, slot_TK, w_TK, kept_TK, acc, gw_TK=None, other_TM=None, sum_=True):
    """y [T, M] in `acc`: sum_j w[:, j] rows[slot[:, j]] (None where not `sum_`); also, where
    gw_TK is given, fills gw_TK[:, j] = <rows[slot[:, j]], other[t]> (the weights' gradient)."""
    y_TM = None
    for j in range(slot_TK.shape[1]):
        r_TM = rows_NM.index_select(0, slot_TK[:, j]).to(acc)  # a fresh tensor: in place below
        if kept_TK is not None:
            r_TM.masked_fill_(~kept_TK[:, j, None], 0)
        if gw_TK is not None:
            # r times other in place where r is not summed after: no [T, M] temporary.
            gw_TK[:, j] = (r_TM.mul_(other_TM) if not sum_ else r_TM * other_TM).sum(-1)
        if not sum_:
            continue
        if w_TK is not None:
            r_TM.mul_(w_TK[:, j, None])
        y_TM = r_TM if y_TM is None else y_TM.add_(r_TM)
    return y_TM


def _scatter(x_TM, token_N, w_N, filled_N, dtype):
    """rows [N, M] in `dtype`: w_N[n] x[token_N[n]], unfilled rows zero."""
    rows_NM = x_TM.index_select(0, token_N)
    if w_N is not None:
        rows_NM.mul_(w_N[:, None])
    if filled_N is not None:
        rows_NM.masked_fill_(~filled_N[:, None], 0)
    return rows_NM.to(dtype)


def _row_weights(w_TK, choice_N):
    return None if w_TK is None else w_TK.reshape(-1).index_select(0, choice_N)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TM, w_TK, slot_TK, kept_TK, choice_N, filled_N):
        k = slot_TK.shape[1]
        w_N = _row_weights(w_TK, choice_N)
        rows_NM = _scatter(x_TM, choice_N // k, w_N, filled_N, x_TM.dtype)
        ctx.save_for_backward(x_TM if w_TK is not None else None, w_TK, slot_TK, kept_TK)
        return rows_NM

    @staticmethod
    def backward(ctx, g_NM):
        x_TM, w_TK, slot_TK, kept_TK = ctx.saved_tensors
        gw_TK = None
        if w_TK is not None and ctx.needs_input_grad[1]:
            gw_TK = torch.empty_like(w_TK)
        g_TM = _gather(g_NM, slot_TK, w_TK, kept_TK, g_NM.dtype, gw_TK, x_TM)
        return g_TM, gw_TK, None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_NM, w_TK, slot_TK, kept_TK, choice_N, filled_N):
        ctx.save_for_backward(rows_NM, w_TK, slot_TK, kept_TK, choice_N, filled_N)
        return _gather(rows_NM, slot_TK, w_TK, kept_TK, torch.float32)

    @staticmethod
    def backward(ctx, g_TM):
        rows_NM, w_TK, slot_TK, kept_TK, choice_N, filled_N = ctx.saved_tensors
        g_TM = g_TM.float()
        gw_TK = None
        if w_TK is not None and ctx.needs_input_grad[1]:
            # <g[t], rows[slot[t, j]]>, as the product's backward in fp32; dropped choices 0.
            gw_TK = torch.empty_like(w_TK)
            _gather(rows_NM, slot_TK, None, kept_TK, torch.float32, gw_TK, g_TM, sum_=False)
        k = slot_TK.shape[1]
        w_N = _row_weights(w_TK, choice_N)
        g_NM = _scatter(g_TM, choice_N // k, w_N, filled_N, rows_NM.dtype)
        return g_NM, gw_TK, None, None, None, None


def scatter_rows(
    x_TM: torch.Tensor,
    w_TK: torch.Tensor | None,
    slot_TK: torch.Tensor,
    kept_TK: torch.Tensor | None,
    choice_N: torch.Tensor,
    filled_N: torch.Tensor | None,
) -> torch.Tensor:
    """rows [N, M], x's dtype: rows[n] = w[c] x[c // k] for the choice c = choice_N[n] (flat
    t k + j) that fills row n, 0 where ~filled_N. Differentiable in x and w_TK (x's dtype).

    slot_TK: long, the row of each choice, in [0, N) (dropped: any row, masked by ~kept_TK).
    """
    return _Scatter.apply(x_TM, w_TK, slot_TK, kept_TK, choice_N, filled_N)


def gather_sum(
    rows_NM: torch.Tensor,
    w_TK: torch.Tensor | None,
    slot_TK: torch.Tensor,
    kept_TK: torch.Tensor | None,
    choice_N: torch.Tensor,
    filled_N: torch.Tensor | None,
) -> torch.Tensor:
    """y [T, M] fp32: y[t] = sum_j w[t, j] rows[slot[t, j]] over kept choices, accumulated in
    fp32 in choice order. Differentiable in rows and w_TK (fp32). Arguments as `scatter_rows`'s;
    choice_N and filled_N serve the backward (the adjoint scatter)."""
    return _Gather.apply(rows_NM, w_TK, slot_TK, kept_TK, choice_N, filled_N)
