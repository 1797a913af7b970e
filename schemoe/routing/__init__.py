"""Routing (scores, group-limited top-k, capacity, dropless), router losses, load metrics."""

from .load import LoadMetrics, tally
from .losses import load_balancing_loss, router_z_loss, update_balance_bias
from .router import Routing, capacity, route

__all__ = [
    "LoadMetrics",
    "Routing",
    "capacity",
    "load_balancing_loss",
    "route",
    "router_z_loss",
    "tally",
    "update_balance_bias",
]
