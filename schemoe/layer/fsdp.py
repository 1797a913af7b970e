"""FSDP2 with expert parallelism: dense weights sharded by torch's `fully_shard`, experts left to
their expert-parallel groups.

Legend: W world size, P expert-parallel size (ep), D = W / P expert-data-parallel size (dp).

    ep = init_expert_parallel(P)                  # every EP and expert-DP group, every rank
    model = GPT(..., group=ep.ep_group)           # MoE layers: all-to-alls on the EP groups
    fully_shard_dense(model, units=model.blocks)  # dense weights: DTensors sharded over W
    opt = torch.optim.AdamW(model.parameters())   # after sharding: the parameters are new
    loss.backward()                               # FSDP reduce-scatters dense grads (mean, W)
    average_expert_gradients(model, ep)           # experts: the same mean, over the D replicas
    norm = clip_grad_norm_(model, 1.0, ep)        # dense shards' squares summed over the mesh

Who talks on which group: FSDP's all-gathers (forward, backward) and reduce-scatters (backward)
run on the dense mesh, the default (world) group, as DDP's all-reduce does; the MoE layers'
all-to-alls on their EP groups; the expert-gradient all-reduce on the expert-DP groups. No group
is created here: `init_expert_parallel` creates the EP and expert-DP groups on every rank in the
same order, and the dense mesh wraps the default group.

Expert parameters (marked `schemoe_expert`) are passed to `fully_shard` as ignored parameters:
they stay plain tensors of this rank's E / P experts, already sharded over the EP group, and
their gradients are averaged over the expert-DP group as with DDP. Every other parameter (router,
attention, norms, dense FFNs, embeddings) is a DTensor sharded on dim 0 over W; its gradient is
the mean over W ranks, as DDP's, so an FSDP run and a DDP run of the same model and seed take
the same steps up to the summation order of the reductions.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from .parallel import expert_parameters

__all__ = ["dense_mesh", "fully_shard_dense", "is_fully_sharded"]


def dense_mesh(device: torch.device | str) -> DeviceMesh:
    """The 1-D mesh FSDP shards dense weights over: the default group (every rank), on
    `device`'s type ("cpu" with gloo, "cuda" with NCCL). Creates no process group.

    Raises ValueError unless torch.distributed is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("dense_mesh needs torch.distributed initialised (one rank: no FSDP)")
    kind = torch.device(device).type
    return DeviceMesh.from_group(dist.group.WORLD, kind)


def fully_shard_dense(
    model: nn.Module,
    *,
    units: Iterable[nn.Module] = (),
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `model`'s dense parameters with FSDP2 (`fully_shard`), experts excluded.

    Each module of `units` (e.g. the transformer blocks) becomes its own FSDP unit (one
    all-gather before its forward, one reduce-scatter after its backward), then `model` is the
    root unit holding what is left (embeddings, final norm). Expert parameters of every unit are
    ignored by FSDP (see the module docstring). Build the optimizer after this call: the dense
    parameters are replaced by DTensors. Collective over the mesh's ranks (every rank calls it
    with the same model).

    Args:
        model: the model; sharded in place (it becomes an FSDPModule) and returned.
        units: submodules of `model` to shard as separate units (an inner one before the
            unit holding it).
        mesh: the dense mesh (default: `dense_mesh` on the device of the model's parameters).
        reshard_after_forward: free the gathered weights after each unit's forward (ZeRO-3);
            False keeps them to the backward (ZeRO-2: less traffic, more memory).

    Raises:
        TypeError: `model` is not an nn.Module, or a unit is not a submodule of it.
        ValueError: `model` is already sharded.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if is_fully_sharded(model):
        raise ValueError("model is already sharded by fully_shard")
    units = list(units)
    inside = {id(m) for m in model.modules()}
    for u in units:
        if not isinstance(u, nn.Module) or id(u) not in inside or u is model:
            raise TypeError(f"every unit must be a submodule of the model, got {type(u).__name__}")
    if mesh is None:
        mesh = dense_mesh(next(model.parameters()).device)
    for u in units:
        fully_shard(u, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    ignored_params=set(expert_parameters(u)))  # fmt: skip
    # The root keeps its weights to the backward, which starts right after its forward.
    fully_shard(model, mesh=mesh, ignored_params=set(expert_parameters(model)))
    return model


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2 (`fully_shard`)."""
    return isinstance(model, FSDPModule)
