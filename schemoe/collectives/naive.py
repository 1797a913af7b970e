"""`naive`: one all_to_all_single over the whole group (what NCCL/gloo do by default).

It runs on a communicator of its own (tag "naive"), never the default group, so its all-to-alls
do not queue behind DDP's all-reduce on one communicator."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dist.topology import Topology
from ._common import Algorithm, world_group
from .base import ALGORITHMS, Done

__all__ = ["Naive", "Work"]


class Work:
    """Pending result of an async torch.distributed call."""

    def __init__(self, work, out: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        self._work = work
        self._out = out
        self._keep = keep  # the input must outlive the op reading it

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._out

    def is_completed(self) -> bool:
        return self._work.is_completed()


@ALGORITHMS.register("naive")
class Naive(Algorithm):
    name = "naive"
    links = ("net",)

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        self.group = world_group(topology, "naive")

    def _start(
        self, x: torch.Tensor, send: list[int], recv: list[int], link: str | None, out: torch.Tensor
    ) -> Done | Work:
        if self.topo.world == 1:
            return Done(out.copy_(x))
        work = dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True)
        return Work(work, out, x)
