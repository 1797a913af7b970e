"""Expert x data parallelism: the process groups, expert vs dense parameters, gradients, clipping.

Legend: W world size, P expert-parallel size (ep), D = W / P expert-data-parallel size (dp).

Ranks form D expert-parallel groups of P consecutive ranks ({0..P-1}, {P..2P-1}, ...); each holds
all E experts, E / P per rank. The ranks holding the same experts (same position in their EP
group: {j, j+P, j+2P, ...}) form an expert-data-parallel group. Every rank calls

    ep = init_expert_parallel(ep_size)          # creates every group, same order on all ranks
    layer = MoELayer(cfg, group=ep.ep_group)
    model = DDP(ddp_ignore_experts(model))      # DDP averages the dense gradients over W
    loss.backward()
    average_expert_gradients(model, ep)         # expert gradients: the same mean over W
    norm = clip_grad_norm_(model, 1.0, ep)      # global norm over dense and sharded experts

Gradient of an expert weight: the all-to-all backward sums the P ranks of its EP group;
`average_expert_gradients` all-reduces that sum over the D replicas and divides by W, so it is
the gradient of the mean loss over all W ranks, exactly as DDP's dense gradients are.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..dist.devices import comm_device, control_zeros
from ..dist.topology import Topology, per_world, register_family
from .moe import MoELayer

__all__ = [
    "ExpertParallel",
    "average_expert_gradients",
    "clip_grad_norm_",
    "ddp_ignore_experts",
    "dense_parameters",
    "expert_parameters",
    "init_expert_parallel",
    "is_expert_param",
]


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's expert-parallel group (ep_group, its ep_rank of ep_size) and
    expert-data-parallel group (dp_group, its dp_rank of dp_size). None groups: one process."""

    ep_size: int
    dp_size: int
    ep_rank: int
    dp_rank: int
    ep_group: Any = field(default=None, compare=False)
    dp_group: Any = field(default=None, compare=False)


def init_expert_parallel(ep_size: int) -> ExpertParallel:
    """Create every expert-parallel group (size `ep_size`) and every expert-data-parallel group
    on every rank, in the same order (torch's requirement for new_group), and return this
    rank's pair. Collective over the world; cached per process-group initialisation.

    Raises TypeError unless ep_size is an int, ValueError unless it divides the world size."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool):
        raise TypeError(f"ep_size must be an int, got {ep_size!r}")
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} must be >= 1 and divide the world size {world}")
    if not initialised:
        return ExpertParallel(ep_size=1, dp_size=1, ep_rank=0, dp_rank=0)
    return per_world(("expert-parallel", ep_size), lambda: _create(ep_size, world))


def _create(ep: int, world: int) -> ExpertParallel:
    rank, dp = dist.get_rank(), world // ep
    timeout = Topology.from_group(None, 1).timeout()
    ep_members = [tuple(range(i * ep, (i + 1) * ep)) for i in range(dp)]
    dp_members = [tuple(range(j, world, ep)) for j in range(ep)]
    # new_group is collective over the world: all EP groups, then all DP groups, same order.
    ep_groups = [dist.new_group(list(m), timeout=timeout) for m in ep_members]
    dp_groups = [dist.new_group(list(m), timeout=timeout) for m in dp_members]
    register_family(ep_groups, ep_members)
    register_family(dp_groups, dp_members)
    return ExpertParallel(
        ep_size=ep,
        dp_size=dp,
        ep_rank=rank % ep,
        dp_rank=rank // ep,
        ep_group=ep_groups[rank // ep],
        dp_group=dp_groups[rank % ep],
    )


def is_expert_param(p: nn.Parameter) -> bool:
    return bool(getattr(p, "schemoe_expert", False))


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    return (p for p in model.parameters() if is_expert_param(p))


def dense_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    return (p for p in model.parameters() if not is_expert_param(p))


def ddp_ignore_experts(model: nn.Module) -> nn.Module:
    """Tell DistributedDataParallel (constructed afterwards) to skip the expert parameters."""
    names = [n for n, p in model.named_parameters() if is_expert_param(p)]
    # The documented-by-use hook DDP offers for parameters it must not synchronise.
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    return model


def _bare(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _layout(model: nn.Module, ep: ExpertParallel | None) -> ExpertParallel:
    """`ep`, or the layout of the model's MoE layers (their group, no data parallelism)."""
    if ep is not None:
        return ep
    layer = next((m for m in _bare(model).modules() if isinstance(m, MoELayer)), None)
    size = layer.topology.world if layer is not None else 1
    group = layer.topology.group if layer is not None else None
    rank = layer.topology.rank if layer is not None else 0
    return ExpertParallel(ep_size=size, dp_size=1, ep_rank=rank, dp_rank=0, ep_group=group)


@torch.no_grad()
def average_expert_gradients(model: nn.Module, ep: ExpertParallel | None = None) -> None:
    """Make every expert gradient the gradient of the mean loss over all W = ep x dp ranks:
    all-reduce (sum) over the expert-data-parallel group, then divide by W. Call it after
    backward and before clipping / the optimizer step. Collective over `ep.dp_group` (every
    rank calls it). `ep=None`: the model's MoE layers' group, no data-parallel replicas."""
    ep = _layout(model, ep)
    params = list(expert_parameters(_bare(model)))
    if ep.dp_size > 1:
        # Every replica must hand the all-reduce the same tensors: an expert that got no token
        # here (no gradient) contributes zeros.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    scale = 1.0 / (ep.ep_size * ep.dp_size)
    if ep.dp_size > 1:
        # One flat all-reduce for all experts, on the backend's device.
        dev = comm_device(ep.dp_group)
        flat = torch.cat([g.reshape(-1).to(dev) for g in grads])
        dist.all_reduce(flat, group=ep.dp_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    for g in grads:
        g.mul_(scale)


def clip_grad_norm_(model: nn.Module, max_norm: float, ep: ExpertParallel | Any = None) -> float:
    """Clip all gradients by their global norm; returns the norm before clipping.

    norm = sqrt(|dense|^2 + all_reduce_sum over the EP group(|local experts|^2)): dense
    gradients are identical on every rank after DDP's all-reduce, and expert gradients on every
    replica of an EP group after `average_expert_gradients`, so each counts once. Dense
    gradients sharded by FSDP2 (DTensors, see schemoe.layer.fsdp) count their local shards'
    squares, all-reduced over their mesh. max_norm <= 0 only measures. Collective over the
    expert-parallel group (and the dense mesh when sharded): `ep` is an ExpertParallel, a
    process group (the EP group), or None (the model's MoE layers' group). HOST SYNC (the norm).
    """
    group = ep.ep_group if isinstance(ep, ExpertParallel) else ep
    if ep is None:
        group = _layout(model, None).ep_group
    model = _bare(model)
    dense = [p.grad for p in dense_parameters(model) if p.grad is not None]
    experts = [p.grad for p in expert_parameters(model) if p.grad is not None]
    distributed = dist.is_available() and dist.is_initialized()
    dev = comm_device(group)  # CPU without torch.distributed

    def sq(gs: list[torch.Tensor], on: Any = group) -> torch.Tensor:
        zero = control_zeros((), dtype=torch.float32, group=on)
        return sum((g.detach().float().pow(2).sum().to(comm_device(on)) for g in gs), zero)

    expert_sq = sq(experts)
    if distributed and dist.get_world_size(group) > 1:
        dist.all_reduce(expert_sq, group=group)
    dense_sq = sq([g for g in dense if not _is_dtensor(g)])
    for mesh, shards in _by_mesh([g for g in dense if _is_dtensor(g)]):
        # Each rank holds a disjoint shard (FSDP2: Shard(0)): the sum over the mesh counts
        # every element once.
        part = sq(shards, mesh.get_group())
        dist.all_reduce(part, group=mesh.get_group())
        dense_sq += part.to(dev)
    norm = float((dense_sq + expert_sq).sqrt())  # host sync
    if max_norm > 0 and norm > max_norm:
        for g in dense + experts:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (FSDP2's sharded gradient), without importing
    torch.distributed.tensor here (seconds at `import schemoe`): a DTensor exists only once
    that module is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _by_mesh(grads: list[torch.Tensor]) -> list[tuple[Any, list[torch.Tensor]]]:
    """Sharded gradients' local shards, grouped by their 1-D mesh (in first-seen order)."""
    out: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for g in grads:
        mesh = g.device_mesh
        assert mesh.ndim == 1 and all(p.is_shard() for p in g.placements), g.placements
        out.setdefault(id(mesh), (mesh, []))[1].append(g.to_local())
    return list(out.values())
