"""Expert vs dense parameters, and how an MoE model sits under DDP.

Expert weights are sharded over the expert-parallel group: each rank holds different experts, and
the all-to-all backward already sums every rank's contribution into them. They must not be
averaged by data-parallel all-reduce; dense weights (attention, embeddings, the router) must be.

    model = DDP(ddp_ignore_experts(model))     # DDP all-reduces only the dense parameters
    norm = clip_grad_norm_(model, 1.0)          # global norm over dense and sharded experts
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "clip_grad_norm_",
    "ddp_ignore_experts",
    "dense_parameters",
    "expert_parameters",
    "is_expert_param",
]


def is_expert_param(p: nn.Parameter) -> bool:
    return bool(getattr(p, "schemoe_expert", False))


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    return (p for p in model.parameters() if is_expert_param(p))


def dense_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    return (p for p in model.parameters() if not is_expert_param(p))


def ddp_ignore_experts(model: nn.Module) -> nn.Module:
    """Tell DistributedDataParallel (constructed afterwards) to skip the expert parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = [n for n, p in model.named_parameters() if is_expert_param(p)]
    # The documented-by-use hook DDP offers for parameters it must not synchronise.
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    return model


def clip_grad_norm_(model: nn.Module, max_norm: float, group=None) -> float:
    """Clip all gradients by their global norm; returns the norm before clipping.

    norm = sqrt(|dense|^2 + all_reduce_sum(|local experts|^2)): dense gradients are identical on
    every rank after DDP's all-reduce, so they count once; each rank holds different experts.
    max_norm <= 0 only measures. Collective over `group` (the expert-parallel group).
    """
    dense = [p.grad for p in dense_parameters(model) if p.grad is not None]
    experts = [p.grad for p in expert_parameters(model) if p.grad is not None]

    def sq(gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((g.detach().float().pow(2).sum() for g in gs), torch.zeros(()))

    expert_sq = sq(experts)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(expert_sq, group=group)
    norm = float((sq(dense) + expert_sq).sqrt())  # host sync
    if max_norm > 0 and norm > max_norm:
        for g in dense + experts:
            g.mul_(max_norm / (norm + 1e-6))
    return norm
