"""The MoE layer: router + dispatcher + scheduled region (moe.py), the shared experts and their
scheduled task (shared.py), the expert x data parallel groups and gradient helpers (parallel.py),
the single-process reference it is tested against (reference.py), the load metrics of a
model's layers (metrics.py), and activation checkpointing that keeps the all-to-alls
(recompute.py)."""

from .metrics import LoadMetrics, load_metrics, load_summary, record_load
from .moe import MoELayer
from .recompute import checkpoint_block, moe_checkpoint_context

__all__ = [
    "LoadMetrics",
    "MoELayer",
    "checkpoint_block",
    "load_metrics",
    "load_summary",
    "moe_checkpoint_context",
    "record_load",
]
