"""Issuing a transfer never blocks: with a peer that joins late, `start` returns at once and the
caller can compute meanwhile (the whole overlap rests on this)."""

from __future__ import annotations

import time

import pytest
import torch

from schemoe.collectives import build
from schemoe.dist.topology import Topology

LATE = 1.0  # seconds rank 1 waits before it joins the transfer


def _start_then_wait(rank, world, name):
    topo = Topology.from_group(None, ranks_per_node=2)
    algo = build(name, topo)
    x = torch.full((4 * world, 3), float(rank))
    splits = [4] * world
    for link in algo.links:  # every link of the algorithm (pipe: intra and inter)
        torch.distributed.barrier()
        if rank == 1:
            time.sleep(LATE)
        t0 = time.perf_counter()
        out = torch.empty_like(x) if len(algo.links) > 1 else None
        kw = {"link": link, "out": out} if len(algo.links) > 1 else {}
        pending = algo.start(x, splits, splits, **kw)
        issued = time.perf_counter() - t0
        y = pending.wait()
        waited = time.perf_counter() - t0
        if rank == 0:
            assert issued < 0.3 * LATE, f"{name}@{link}: start() blocked for {issued:.2f}s"
            if link != "inter":  # pipe's inter part pairs rank 0 with the other node only
                assert waited > 0.5 * LATE, f"{name}@{link}: the late peer was not waited for"
        del y
    return True


@pytest.mark.parametrize("name", ["naive", "pairwise", "pipe", "hier2d", "leader"])
def test_start_returns_at_once_while_a_peer_joins_late(ranks, name):
    assert all(ranks(4).run(_start_then_wait, name))
