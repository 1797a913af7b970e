"""The MoE layer: router + dispatcher + scheduled region (moe.py), the shared experts and their
scheduled task (shared.py), the expert x data parallel groups and gradient helpers (parallel.py),
and the single-process reference it is tested against (reference.py)."""

from .moe import MoELayer

__all__ = ["MoELayer"]
