"""Which ranks share a node, and the process groups the all-to-all algorithms need.

The launcher's LOCAL_WORLD_SIZE (torchrun, or `schemoe._dist.spawn`) gives ranks per node;
`ParallelConfig.ranks_per_node` overrides it so a test can treat 4 local ranks as 2 nodes x 2.
Ranks are laid out node-major: rank = node * ranks_per_node + local_rank.

Sub-groups are created once per (parent group, member ranks) and cached. `dist.new_group` is
collective over the parent group, so every rank must ask for the same sub-groups in the same order;
`node_groups()` and `peer_groups()` create all of their groups on every rank for that reason.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["Topology", "per_world"]

# Objects tied to the process groups of one initialisation of torch.distributed (sub-groups,
# all-to-all algorithms that own sub-groups and comm threads). Keys hold the groups themselves
# (never their id(), which a later group may reuse); entries made under an earlier default
# group (before destroy_process_group / a new init_process_group) are dropped, not reused.
_PER_WORLD: dict[tuple, Any] = {}


def _world() -> Any:
    return c10d._get_default_group() if dist.is_initialized() else None


def per_world(key: tuple, make: Callable[[], Any]) -> Any:
    """`make()` once per `key` within the current process-group initialisation (cached)."""
    world = _world()
    for k in [k for k in _PER_WORLD if k[0] is not world]:
        del _PER_WORLD[k]
    full = (world, *key)
    if full not in _PER_WORLD:
        _PER_WORLD[full] = make()
    return _PER_WORLD[full]


@dataclass(frozen=True)
class Topology:
    """nodes x ranks_per_node ranks of `group` (None = the default group)."""

    world: int
    rank: int
    ranks_per_node: int
    group: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} must divide the world size {self.world}"
            )

    @classmethod
    def from_group(cls, group: Any = None, ranks_per_node: int | None = None) -> Topology:
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if ranks_per_node is None:
            # Only launcher variables are read, never behaviour switches.
            env = os.environ.get("LOCAL_WORLD_SIZE")
            ranks_per_node = int(env) if env and world % int(env) == 0 else world
        return cls(world=world, rank=rank, ranks_per_node=ranks_per_node, group=group)

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_of(self, q: int) -> int:
        return q // self.ranks_per_node

    def same_node(self, q: int) -> bool:
        return self.node_of(q) == self.node

    def global_rank(self, q: int) -> int:
        """Rank `q` of this topology's group as a rank of the default group."""
        return q if self.group is None else dist.get_global_rank(self.group, q)

    def subgroup(self, ranks: tuple[int, ...], tag: str = "") -> Any:
        """The cached process group of `ranks` (ranks of this topology's group). Collective.

        Different tags give different communicators over the same ranks, so two transfers can
        run at the same time (each process group has its own worker and ordering)."""
        return per_world(
            ("subgroup", self.group, tuple(ranks), tag),
            lambda: dist.new_group([self.global_rank(q) for q in ranks], timeout=self.timeout()),
        )

    def timeout(self) -> datetime.timedelta | None:
        """The parent group's collective timeout, so sub-groups raise as soon as it would
        (new_group's own default is 30 minutes). When the parent's backend does not say, the
        default group's; when neither says, None (torch's default) with a RuntimeWarning."""
        for pg in (self.group, None):
            t = _group_timeout(pg)
            if t is not None:
                return t
        warnings.warn(
            "schemoe: cannot read the process group's timeout from its backend; sub-groups get "
            "torch's default (30 minutes for gloo, 10 for NCCL), so a lost peer may take that "
            "long to be reported",
            RuntimeWarning,
            stacklevel=2,
        )
        return None

    def node_groups(self) -> list[Any]:
        """One group per node (its local ranks); created on every rank in node order."""
        rpn = self.ranks_per_node
        return [self.subgroup(tuple(range(n * rpn, (n + 1) * rpn))) for n in range(self.nodes)]

    def peer_groups(self) -> list[Any]:
        """One group per local rank (the same-local-rank peers on every node)."""
        rpn = self.ranks_per_node
        return [self.subgroup(tuple(range(lr, self.world, rpn))) for lr in range(rpn)]


def _group_timeout(group: Any) -> datetime.timedelta | None:
    """`group`'s (None: the default group's) backend timeout, or None where it cannot be read
    (torch keeps it on the backend's options, which not every backend exposes)."""
    try:
        pg = group if group is not None else c10d._get_default_group()
        device = torch.device("cpu" if dist.get_backend(pg) == "gloo" else "cuda")
        t = pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return None
    return t if isinstance(t, datetime.timedelta) else None
