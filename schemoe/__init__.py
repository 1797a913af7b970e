"""schemoe: Mixture-of-Experts training with scheduled, overlapped expert-parallel communication."""

from . import (
    collectives,
    compression,
    costmodel,  # noqa: F401 (registers the "search" policy)
    scheduling,
    trace,
)
from .config import (
    CollectiveConfig,
    CompressionConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
)
from .layer import MoELayer
from .parallel import (
    clip_grad_norm_,
    ddp_ignore_experts,
    dense_parameters,
    expert_parameters,
    is_expert_param,
)
from .reference import reference_moe
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "CollectiveConfig",
    "CompressionConfig",
    "ExpertConfig",
    "GateConfig",
    "MoEConfig",
    "MoELayer",
    "ParallelConfig",
    "ScheduleConfig",
    "Topology",
    "clip_grad_norm_",
    "collectives",
    "compression",
    "ddp_ignore_experts",
    "dense_parameters",
    "expert_parameters",
    "is_expert_param",
    "reference_moe",
    "scheduling",
    "trace",
]
