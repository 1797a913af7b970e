"""The MoE layer: router + dispatcher + scheduled region (moe.py), the shared experts and their
scheduled task (shared.py), the expert x data parallel groups and gradient helpers (parallel.py),
the single-process reference it is tested against (reference.py), and the load metrics of a
model's layers (metrics.py)."""

from .metrics import LoadMetrics, load_metrics, load_summary, record_load
from .moe import MoELayer

__all__ = ["LoadMetrics", "MoELayer", "load_metrics", "load_summary", "record_load"]
