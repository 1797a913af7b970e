"""schemoe: Mixture-of-Experts training with scheduled, overlapped expert-parallel communication.

`import schemoe` loads the library (layers, scheduling, plug-ins); the planning and tuning tiers
(costmodel, tuning), training (train, checkpoint) and the tools (bench, profile, testbed, cli)
load when imported. The tier order is schemoe/tiers.py."""

from . import collectives, compression, scheduling, trace
from .config import (
    CollectiveConfig,
    CompressionConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
    SharedExpertConfig,
)
from .dist.topology import Topology
from .layer.moe import MoELayer
from .layer.parallel import (
    ExpertParallel,
    average_expert_gradients,
    clip_grad_norm_,
    ddp_ignore_experts,
    dense_parameters,
    expert_parameters,
    init_expert_parallel,
    is_expert_param,
)
from .layer.recompute import checkpoint_block, moe_checkpoint_context

__version__ = "0.1.0"

__all__ = [
    "CollectiveConfig",
    "CompressionConfig",
    "ExpertConfig",
    "ExpertParallel",
    "GateConfig",
    "MoEConfig",
    "MoELayer",
    "ParallelConfig",
    "ScheduleConfig",
    "SharedExpertConfig",
    "Topology",
    "average_expert_gradients",
    "checkpoint_block",
    "clip_grad_norm_",
    "collectives",
    "compression",
    "ddp_ignore_experts",
    "dense_parameters",
    "expert_parameters",
    "init_expert_parallel",
    "is_expert_param",
    "moe_checkpoint_context",
    "scheduling",
    "trace",
]
