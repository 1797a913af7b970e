"""Expert vs dense parameters, and how an MoE model sits under DDP.

Expert weights are sharded over the expert-parallel group: each rank holds different experts, and
the all-to-all backward already sums every rank's contribution into them. They must not be
averaged by data-parallel all-reduce; dense weights (attention, embeddings, the router) must be.

    model = DDP(ddp_ignore_experts(model))     # DDP all-reduces only the dense parameters
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["ddp_ignore_experts", "dense_parameters", "expert_parameters", "is_expert_param"]


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
