"""schemoe: Mixture-of-Experts training with scheduled, overlapped expert-parallel communication."""

from . import collectives, compression, scheduling, trace
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
from .parallel import dense_parameters, ddp_ignore_experts, expert_parameters, is_expert_param
from .reference import reference_moe
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "MoELayer",
    "MoEConfig",
    "GateConfig",
    "ExpertConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "CollectiveConfig",
    "CompressionConfig",
    "Topology",
    "reference_moe",
    "expert_parameters",
    "dense_parameters",
    "ddp_ignore_experts",
    "is_expert_param",
    "collectives",
    "compression",
    "scheduling",
    "trace",
]
