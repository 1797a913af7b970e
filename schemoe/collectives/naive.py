"""`naive`: one all_to_all_single over the whole group (what NCCL/gloo do by default).

It runs on a communicator of its own (tag "naive"), never the default group, so its all-to-alls
do not queue behind DDP's all-reduce on one communicator."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..dist.topology import Topology
from .base import ALGORITHMS, Done, check_splits

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
class Naive:
    name = "naive"
    links = ("net",)

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        world = tuple(range(topology.world))
        self.group = topology.subgroup(world, tag="naive") if topology.world > 1 else None

    def start(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        link: str | None = None,
        out: torch.Tensor | None = None,
    ):
        if link not in (None, "net"):
            raise ValueError(f"naive uses the link 'net' only, got link={link!r}")
        check_splits(x, send_splits, recv_splits, self.topo.world)
        if out is None:
            out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        if self.topo.world == 1:
            out.copy_(x)
            return Done(out)
        x = x.contiguous()
        work = dist.all_to_all_single(
            out, x, list(recv_splits), list(send_splits), group=self.group, async_op=True
        )
        return Work(work, out, x)
