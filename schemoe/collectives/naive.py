"""`naive`: one all_to_all_single over the whole group (what NCCL/gloo do by default).

It runs on a communicator of its own (tag "naive"), never the default group, so its all-to-alls
do not queue behind DDP's all-reduce on one communicator. On gloo the same exchange goes as
point-to-point pairs, receives posted first (`_common.start_exchange` says why)."""

from __future__ import annotations

import torch

from ..dist.topology import Topology
from ._common import Algorithm, start_exchange, world_group
from .base import ALGORITHMS, Done, Works

__all__ = ["Naive"]


@ALGORITHMS.register("naive")
class Naive(Algorithm):
    name = "naive"
    links = ("net",)

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        self.group = world_group(topology, "naive")

    def _start(
        self, x: torch.Tensor, send: list[int], recv: list[int], link: str | None, out: torch.Tensor
    ) -> Done | Works:
        if self.topo.world == 1:
            return Done(out.copy_(x))
        return Works(start_exchange(x, send, recv, self.group, out), out, x)
