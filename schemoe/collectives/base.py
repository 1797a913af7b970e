"""The all-to-all extension point.

An algorithm moves rows of a 2-D tensor between the ranks of a group: rank r sends
`x[sum(send_splits[:d]) : sum(send_splits[:d+1])]` to rank d and receives `recv_splits[s]` rows from
each rank s, stacked in source order. Every algorithm must return bitwise what `naive`
(one `all_to_all_single`) returns.

An algorithm names the links it occupies (`links`): ("net",) for a single-link algorithm, or
("intra", "inter") for one that drives a node's local link and its network link at the same time
(Pipe-A2A). The scheduler treats each link as a resource and may start the parts separately:
`start(..., link="inter", out=buf)` moves only the pairs that cross that link, writing into the
shared output buffer. `start(...)` without `link` moves everything.

`start` must be asynchronous: it returns before bytes move (or at least before they are all
waited on), and `Pending.wait()` blocks until done, raising RuntimeError within the process group's
timeout if a peer never arrives. A collective never compresses; compression is the scheduler's job.

Issue rules every algorithm follows (DESIGN.md, "Devices and scale-out rules"):
  * devices: every tensor handed to torch.distributed lives on the backend's device; control
    tensors (splits, counts) are made by `schemoe.dist.devices.control_tensor`;
  * communicators: an algorithm moves rows on sub-groups of its own (`Topology.subgroup` with a
    tag), never on the default group that DDP/FSDP all-reduce on; sub-groups of an
    expert-parallel group are created for every sibling group on every rank, in the same order;
  * threads: on NCCL no collective is issued from a worker thread (`devices.
    issues_from_worker_thread`): a multi-phase algorithm enqueues its phases from the calling
    thread on a side stream ordered by CUDA events (`_common.CommThread.here`); on gloo the
    phases run on the instance's comm thread so `start` returns at once;
  * lifetimes: every buffer a transfer reads or writes is kept alive by its Pending (or
    `record_stream`ed on the side stream) until the transfer completes.

To add an algorithm:

    from schemoe.collectives import ALGORITHMS

    @ALGORITHMS.register("mine")
    class Mine:
        links = ("net",)
        def __init__(self, topology): ...
        def start(self, x, send_splits, recv_splits, *, link=None, out=None) -> Pending: ...

and select it with `MoEConfig(collective=CollectiveConfig(algorithm="mine"))`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ..registry import Registry

__all__ = ["ALGORITHMS", "AllToAll", "Done", "Pending", "check_splits"]


@runtime_checkable
class Pending(Protocol):
    def wait(self) -> torch.Tensor: ...

    def is_completed(self) -> bool: ...  # non-blocking; used by the tracer for true end times


@runtime_checkable
class AllToAll(Protocol):
    name: str
    links: tuple[str, ...]

    def start(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        link: str | None = None,
        out: torch.Tensor | None = None,
    ) -> Pending: ...


class Done:
    """A Pending that is already complete (for empty or local-only transfers)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def wait(self) -> torch.Tensor:
        return self._t

    def is_completed(self) -> bool:
        return True


class Works:
    """Pending result of async torch.distributed ops that all write into `out`."""

    def __init__(self, works: Sequence[Any], out: torch.Tensor, keep: torch.Tensor) -> None:
        self._works = list(works)
        self._out = out
        self._keep = keep  # the (possibly copied) input must outlive the ops reading it

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works = []
        return self._out

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


# name -> class taking a Topology; built once per (algorithm, topology).
ALGORITHMS: Registry[type] = Registry("all-to-all algorithm")


def check_splits(
    x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], world: int
) -> None:
    """Validate the arguments every algorithm receives."""
    if x.dim() < 1:
        raise ValueError(f"all-to-all input must have at least 1 dim, got shape {tuple(x.shape)}")
    if len(send_splits) != world or len(recv_splits) != world:
        raise ValueError(
            f"send_splits and recv_splits need {world} entries, got "
            f"{len(send_splits)} and {len(recv_splits)}"
        )
    if any(s < 0 for s in send_splits) or any(s < 0 for s in recv_splits):
        raise ValueError(f"splits must be >= 0, got {list(send_splits)} / {list(recv_splits)}")
    if sum(send_splits) != x.shape[0]:
        raise ValueError(
            f"send_splits sum to {sum(send_splits)} but the input has {x.shape[0]} rows"
        )
