"""The all-to-all algorithms' link times: pure functions of a `Hardware` record and `sends`.

An all-to-all is described by `sends`: sends[o] bytes go from every rank r to rank (r + o) % P
(the same on every rank; o = 0 is the rank's own rows, a local copy). Node-major ranks: rank
q = n * R + l talks to its node when (l + o) % P < R (counted on node 0, the same on every node
by symmetry). P ranks, R ranks per node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .hardware import Hardware

__all__ = [
    "A2A_MODELS",
    "a2a_hier2d",
    "a2a_leader",
    "a2a_naive",
    "a2a_pairwise",
    "a2a_pipe",
    "split_bytes",
]


def split_bytes(sends: Sequence[float], R: int) -> tuple[list[float], float]:
    """(intra bytes leaving each local rank l, bytes leaving the node over its NIC)."""
    P = len(sends)
    intra = [sum(s for o, s in enumerate(sends) if o and (l + o) % P < R) for l in range(R)]
    nic = sum(s for l in range(R) for o, s in enumerate(sends) if (l + o) % P >= R)
    return intra, nic


def a2a_naive(hw: Hardware, sends: Sequence[float]) -> float:
    """One all_to_all_single over all P ranks.

    NCCL runs the P pairs as one group on one stream, so intra and inter pairs share its time
    (ScheMoE section 2): t = t_intra + t_inter. gloo posts every pair on its own socket at once,
    so the node's loopback and NIC move bytes together: t = max(t_intra, t_inter) (on the
    testbed a plain all-to-all takes what its inter-node part alone takes: docs/costmodel.md). With
    t_intra = intra.alpha + max_l B_l / intra.beta and t_inter = inter.alpha + B_nic / inter.beta.
    """
    intra, nic = split_bytes(sends, hw.ranks_per_node)
    t1, t2 = hw.intra.time(max(intra)), hw.inter.time(nic)
    return t1 + t2 if hw.backend == "nccl" else max(t1, t2)


def a2a_pipe(hw: Hardware, sends: Sequence[float]) -> dict[str, float]:
    """Pipe-A2A (ScheMoE section 2): the intra pairs on one communicator, the inter pairs on
    another, at once: one task per link, t_link = alpha + bytes / beta; the layer's A task takes
    max(t_intra, t_inter) when both links are free."""
    intra, nic = split_bytes(sends, hw.ranks_per_node)
    return {"intra": hw.intra.time(max(intra)), "inter": hw.inter.time(nic)}


def a2a_hier2d(hw: Hardware, sends: Sequence[float]) -> float:
    """Tutel's 2DH, in phases (collectives/hier2d.py): a split all-gather in the node (alpha),
    an intra-node all-to-all that hands local rank j every row for (any node, j), a local
    permute of all S bytes, an inter-node all-to-all among same-local-rank peers (the NIC moves
    naive's bytes in P / R - 1 larger messages):

        t = intra.alpha + intra(S_j) + S / memory + inter(B_nic),  S_j = rows to other locals
    """
    P, R = len(sends), hw.ranks_per_node
    total = sum(sends)
    to_other_local = max(
        sum(s for o, s in enumerate(sends) if (l + o) % P % R != l) for l in range(R)
    )
    _, nic = split_bytes(sends, R)
    split_gather = hw.intra.alpha if R > 1 else 0.0
    return split_gather + hw.intra.time(to_other_local) + total / hw.memory + hw.inter.time(nic)


def a2a_leader(hw: Hardware, sends: Sequence[float]) -> float:
    """1D hierarchical (collectives/leader.py): a split all-gather, gather to the node leader
    ((R - 1) S bytes into one rank), two permutes of the node's R S bytes at the leader, one
    exchange among leaders (naive's NIC bytes), scatter back ((R - 1) S out of the leader):

        t = intra.alpha + 2 intra((R - 1) S) + 2 R S / memory + inter(B_nic)
    """
    R = hw.ranks_per_node
    total = sum(sends)
    _, nic = split_bytes(sends, R)
    local = hw.intra.time((R - 1) * total)
    split_gather = hw.intra.alpha if R > 1 else 0.0
    return split_gather + 2 * local + 2 * R * total / hw.memory + hw.inter.time(nic)


def a2a_pairwise(hw: Hardware, sends: Sequence[float]) -> float:
    """P - 1 steps, one peer pair at a time (collectives/pairwise.py); step o sends sends[o] to
    rank + o. A step is as slow as its slowest local rank; the k_o local ranks whose step-o peer
    is on another node share the NIC:

        t = sum_o max_l (intra(sends[o]) if (l + o) % P < R else inter(k_o sends[o]))
    """
    P, R = len(sends), hw.ranks_per_node
    t = 0.0
    for o in range(1, P):
        k = sum(1 for l in range(R) if (l + o) % P >= R)
        step = [
            hw.intra.time(sends[o]) if (l + o) % P < R else hw.inter.time(k * sends[o])
            for l in range(R)
        ]
        t += max(step)
    return t


# name -> (links it occupies, f(hw, sends) -> seconds per link). Algorithms without an entry
# cannot be simulated (tune skips them and says so).
A2A_MODELS: dict[str, tuple[tuple[str, ...], Callable[[Hardware, Sequence[float]], dict]]] = {
    "naive": (("net",), lambda hw, s: {"net": a2a_naive(hw, s)}),
    "pipe": (("intra", "inter"), a2a_pipe),
    "hier2d": (("net",), lambda hw, s: {"net": a2a_hier2d(hw, s)}),
    "leader": (("net",), lambda hw, s: {"net": a2a_leader(hw, s)}),
    "pairwise": (("net",), lambda hw, s: {"net": a2a_pairwise(hw, s)}),
}
