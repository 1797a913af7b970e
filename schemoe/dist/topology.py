"""Which ranks share a node, and the process groups the all-to-all algorithms need.

The launcher's LOCAL_WORLD_SIZE (torchrun, or `schemoe.dist.launch.spawn`) gives ranks per node;
`ParallelConfig.ranks_per_node` overrides it so a test can treat 4 local ranks as 2 nodes x 2.
Ranks are laid out node-major: rank = node * ranks_per_node + local_rank.

Sub-groups are created once per (group family, member ranks, tag) and cached. `dist.new_group` is
collective over the WHOLE world (torch requires every rank to call it for every group, in the same
order), so a sub-group of an expert-parallel group smaller than the world is created for every
sibling group of its family (`family()`: the member lists of all the expert-parallel groups, as
`schemoe.layer.parallel.init_expert_parallel` registers them), on every rank, in family order; the
caller gets its own. `node_groups()` and `peer_groups()` create all of their groups likewise.
"""

from __future__ import annotations

import atexit
import datetime
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "Topology",
    "launcher_local_rank",
    "layer_topology",
    "per_world",
    "register_family",
    "release",
]

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


def release() -> None:
    """Drop everything `per_world` cached (sub-groups, algorithm instances and their comm threads).

    Call it before destroy_process_group (`schemoe.dist.launch.shutdown` does): a group still referenced
    when the interpreter exits is destroyed during finalisation, and a gloo worker thread that then
    frees a tensor needs the GIL, which aborts the process ("terminate called without an active
    exception", SIGABRT) after all its work is done. Also run at exit (atexit, before
    finalisation), for a user's script that calls destroy_process_group itself."""
    _PER_WORLD.clear()


atexit.register(release)


def launcher_local_rank(default: int = 0) -> int:
    """This process's LOCAL_RANK as the launcher set it (torchrun, `srun torchrun`,
    `schemoe.dist.launch.spawn`), or `default` without a launcher. Picks the rank's GPU."""
    env = os.environ.get("LOCAL_RANK")
    if env is None:
        return default
    if not env.isdigit():
        raise ValueError(f"LOCAL_RANK must be a non-negative int, got {env!r}")
    return int(env)


def register_family(groups: list[Any], members: list[tuple[int, ...]]) -> None:
    """Declare that `groups` (global ranks `members`, same length each, same order on every rank)
    partition the world; sub-groups of any of them are then created for all of them."""
    family = tuple(tuple(m) for m in members)
    for g in groups:
        if g is not None:
            per_world(("family", g), lambda: family)


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
        elif ranks_per_node > world and ranks_per_node % world == 0:
            # An expert-parallel group smaller than a node (consecutive ranks, as
            # init_expert_parallel makes them) lies within one node.
            ranks_per_node = world
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

    def members(self) -> tuple[int, ...]:
        """This topology's ranks as global ranks, in group-rank order."""
        return tuple(self.global_rank(q) for q in range(self.world))

    def family(self) -> tuple[tuple[int, ...], ...]:
        """The member lists (global ranks) of this group and its sibling groups, the same tuple
        on every rank. The default group is its own family; a group registered by
        `register_family` has its registered one; any other group's family is learnt by one
        all_gather_object over the world (collective over the world, like new_group itself)."""
        if self.group is None or not dist.is_initialized():
            return (tuple(range(self.world)),)
        known = _PER_WORLD.get((_world(), "family", self.group))
        if known is not None:
            return known

        def learn() -> tuple[tuple[int, ...], ...]:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, self.members())
            family = tuple(dict.fromkeys(tuple(m) for m in everyone))
            if len({len(m) for m in family}) != 1:
                raise ValueError(
                    f"expert-parallel groups must all have the same size, got {list(family)}"
                )
            return family

        return per_world(("learnt-family", self.group), learn)

    def subgroup(self, ranks: tuple[int, ...], tag: str = "") -> Any:
        """The cached process group of `ranks` (ranks of this topology's group). Collective over
        the world: the same sub-group of every sibling group is created on every rank, in
        family order, and this rank gets its own group's.

        Different tags give different communicators over the same ranks, so two transfers can
        run at the same time (each process group has its own worker and ordering)."""
        family, mine = self.family(), self.members()

        def make() -> Any:
            timeout = self.timeout()
            made = [dist.new_group([m[q] for q in ranks], timeout=timeout) for m in family]
            return made[family.index(mine)]

        # Keyed by this rank's group too: a full-world EP group and the default group have the
        # same members but are different parents (their algorithms must not share a thread's
        # communicator).
        return per_world(("subgroup", self.group, family, tuple(ranks), tag), make)

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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def layer_topology(group: Any, ranks_per_node: int | None) -> Topology:
    """An MoE layer's expert-parallel topology over `group` (None: the default group, or one
    process when torch.distributed is not initialised); refuses the two ways a launched job silently runs
    one full copy of every expert per rank."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    if _distributed():
        return Topology.from_group(group, ranks_per_node)
    if group is not None:
        raise ValueError("a group was given but torch.distributed is not initialised")
    launched = os.environ.get("WORLD_SIZE", "1")  # read to detect a mistake, never to configure
    if launched.isdigit() and int(launched) > 1:
        raise RuntimeError(
            f"this process was launched as one of WORLD_SIZE={launched} ranks, but "
            "torch.distributed is not initialised: the layer would run every expert on every "
            "rank, unshared. Call torch.distributed.init_process_group (or "
            "schemoe.init_expert_parallel) before building MoE layers"
        )
    return Topology(world=1, rank=0, ranks_per_node=1)
