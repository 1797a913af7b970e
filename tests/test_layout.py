"""Token layout and chunk plans against indices computed by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from schemoe.routing.layout import Partition, build_plan, decode, encode
from schemoe.routing.router import Routing

# Rank 0 of P = 2, E = 4 (El = 2). Its buffer: e0 rows 0-2, e1 row 3, e2 rows 4-5, e3 rows 6-7.
COUNTS = (3, 1, 2, 2)
RECV = ((3, 1), (2, 2))  # from rank 0 (its own e0, e1) and from rank 1


def _plain(plan):
    return [
        {
            "send_idx": None if c.send_idx is None else c.send_idx.tolist(),
            "send": c.send_splits,
            "recv": c.recv_splits,
            "perm": None if c.perm is None else c.perm.tolist(),
            "inv": None if c.inv_perm is None else c.inv_perm.tolist(),
            "experts": c.expert_counts,
        }
        for c in plan
    ]


def test_capacity_chunks_take_the_floor_split_of_every_experts_rows():
    got = _plain(build_plan(COUNTS, RECV, 0, 2, Partition.CAPACITY))
    assert got == [
        # chunk 0: rows [0, n // 2) of each expert: e0 row 0, e1 none, e2 row 4, e3 row 6
        {"send_idx": [0, 4, 6], "send": (1, 2), "recv": (1, 2), "perm": [0, 1, 2],
         "inv": [0, 1, 2], "experts": (2, 1)},
        # chunk 1: e0 rows 1-2, e1 row 3, e2 row 5, e3 row 7; received (s0: el0 x2, el1 x1;
        # s1: el0, el1) reordered to el0 (s0, s0, s1), el1 (s0, s1)
        {"send_idx": [1, 2, 3, 5, 7], "send": (3, 2), "recv": (3, 2), "perm": [0, 1, 3, 2, 4],
         "inv": [0, 1, 3, 2, 4], "experts": (3, 2)},
    ]  # fmt: skip


def test_peers_chunks_exchange_whole_experts_with_one_peer_group_each():
    got = _plain(build_plan(COUNTS, RECV, 0, 2, "peers"))
    assert got == [
        # offset 0: this rank's own experts e0, e1 (a local copy)
        {"send_idx": [0, 1, 2, 3], "send": (4, 0), "recv": (4, 0), "perm": [0, 1, 2, 3],
         "inv": [0, 1, 2, 3], "experts": (3, 1)},
        # offset 1: rank 1's experts e2, e3, and what rank 1 sends to e0, e1
        {"send_idx": [4, 5, 6, 7], "send": (0, 4), "recv": (0, 4), "perm": [0, 1, 2, 3],
         "inv": [0, 1, 2, 3], "experts": (2, 2)},
    ]  # fmt: skip


def test_one_chunk_sends_the_whole_buffer_without_an_index():
    (c,) = build_plan(COUNTS, RECV, 0, 1)
    assert c.send_idx is None and (c.send_splits, c.recv_splits) == ((4, 4), (4, 4))
    assert c.perm.tolist() == [0, 1, 2, 4, 5, 3, 6, 7] and c.expert_counts == (5, 3)


def test_one_rank_or_one_local_expert_needs_no_permutation():
    (c,) = build_plan((2, 1), ((2, 1),), 0, 1)
    assert c.perm is None and c.inv_perm is None and c.expert_counts == (2, 1)
    plan = build_plan((2, 2), ((2,), (1,)), 1, 2)
    assert all(ch.perm is None for ch in plan)


@pytest.mark.parametrize(
    "counts,recv,chunks,partition,match",
    [
        ((1, 1, 1), ((1,), (1,)), 1, "capacity", "cannot be split"),
        (COUNTS, RECV, 3, "peers", "chunks <= ranks"),
        (COUNTS, RECV, 1, "rows", "partition must be"),
    ],
)
def test_build_plan_names_what_is_wrong(counts, recv, chunks, partition, match):
    with pytest.raises(ValueError, match=match):
        build_plan(counts, recv, 0, chunks, partition)


def _routing() -> Routing:
    # T = 3 tokens, k = 2, E = 2 experts of 2 rows: token 0 -> rows 0 (e0) and 2 (e1); token 1
    # -> row 1 (e0), its second choice dropped; token 2 -> row 3 (e1), its second dropped.
    slot = torch.tensor([[0, 2], [1, -1], [3, -1]])
    weight = torch.tensor([[0.75, 0.25], [1.0, 0.0], [0.5, 0.0]])
    expert = torch.tensor([[0, 1], [0, 1], [1, 0]])
    z = torch.zeros(3, 2)
    return Routing(z, z, expert, weight, slot, (2, 2))


def test_encode_puts_each_kept_choice_in_its_row():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    rows = encode(x, _routing())
    assert rows.tolist() == [[1.0, 2.0], [3.0, 4.0], [1.0, 2.0], [5.0, 6.0]]


def test_decode_sums_each_tokens_rows_with_its_weights_in_its_dtype():
    rows = torch.tensor([[1.0, 0.0], [2.0, 2.0], [0.0, 4.0], [8.0, 8.0]])
    y = decode(rows, _routing(), torch.float64)
    assert y.dtype == torch.float64
    assert y.tolist() == [[0.75, 1.0], [2.0, 2.0], [4.0, 4.0]]


def _dropless() -> Routing:
    # T = 3, k = 2, E = 2, every choice kept. Choice-major priority: e0 takes token 1 (first
    # choice), then tokens 0 and 2 (second choices): rows 0-2; e1 takes tokens 0 and 2, then 1:
    # rows 3-5.
    slot = torch.tensor([[3, 1], [0, 5], [4, 2]])
    weight = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]])
    expert = torch.tensor([[1, 0], [0, 1], [1, 0]])
    z = torch.zeros(3, 2)
    return Routing(z, z, expert, weight, slot, None, counts_E=torch.tensor([3, 3]))


def test_a_dropless_encode_fills_every_row_with_its_choices_token():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    rows = encode(x, _dropless())
    assert rows.tolist() == [[3.0, 4.0], [1.0, 2.0], [5.0, 6.0], [1.0, 2.0], [5.0, 6.0], [3.0, 4.0]]


def test_a_dropless_decode_sums_each_tokens_rows_with_its_weights():
    rows = torch.tensor([[1.0, 0.0], [2.0, 2.0], [0.0, 4.0], [8.0, 8.0], [4.0, 0.0], [0.0, 8.0]])
    y = decode(rows, _dropless(), torch.float32)
    assert y.tolist() == [[6.5, 6.5], [0.5, 4.0], [0.5, 3.5]]


def _naive(x_TM, w_TK, r: Routing, on_input: bool):
    """encode, a fixed affine 'expert', decode: one (token, choice) at a time."""
    T, k = r.slot_TK.shape
    rows = [x_TM.new_zeros(x_TM.shape[1]) for _ in range(r.rows)]
    for t in range(T):
        for j in range(k):
            if r.slot_TK[t, j] >= 0:
                rows[r.slot_TK[t, j]] = x_TM[t] * w_TK[t, j] if on_input else x_TM[t]
    out = torch.stack(rows) * 1.5 + 0.25
    y = [x_TM.new_zeros(x_TM.shape[1]) for _ in range(T)]
    for t in range(T):
        for j in range(k):
            if r.slot_TK[t, j] >= 0:
                y[t] = y[t] + (
                    out[r.slot_TK[t, j]] if on_input else out[r.slot_TK[t, j]] * w_TK[t, j]
                )
    return torch.stack(y)


@pytest.mark.parametrize("on_input", [False, True], ids=["weights-on-output", "weights-on-input"])
@pytest.mark.parametrize("make", [_routing, _dropless], ids=["capacity", "dropless"])
def test_encode_and_decode_gradients_match_the_choice_by_choice_formula(make, on_input):
    r0 = make()
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    g = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    grads = []
    for fast in (True, False):
        xx = x.clone().requires_grad_()
        w = r0.weight_TK.clone().requires_grad_()
        r = dataclasses.replace(r0, weight_TK=w, weights_on_input=on_input)
        y = (
            decode(encode(xx, r) * 1.5 + 0.25, r, torch.float32)
            if fast
            else _naive(xx, w, r, on_input)
        )
        grads.append((y, *torch.autograd.grad(y, [xx, w], g)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_an_unfilled_rows_infinity_reaches_neither_the_output_nor_a_gradient():
    # Row 3 is filled by no choice (token 2's choices are both dropped).
    slot = torch.tensor([[0, 2], [1, -1], [-1, -1]])
    weight = torch.tensor([[0.75, 0.25], [1.0, 0.0], [0.0, 0.0]], requires_grad=True)
    z = torch.zeros(3, 2)
    r = Routing(z, z, torch.zeros(3, 2, dtype=torch.long), weight, slot, (2, 2))
    rows = torch.tensor(
        [[1.0, 0.0], [2.0, 2.0], [0.0, 4.0], [float("inf"), 1.0]], requires_grad=True
    )
    y = decode(rows, r, torch.float32)
    g_rows, g_w = torch.autograd.grad(y.sum(), [rows, weight])
    assert y.tolist() == [[0.75, 1.0], [2.0, 2.0], [0.0, 0.0]]
    assert g_rows[3].tolist() == [0.0, 0.0] and torch.isfinite(g_w).all()
