"""Routing (top-k, capacity, dropless) and router losses."""

from .losses import load_balancing_loss, router_z_loss, update_balance_bias
from .router import Routing, capacity, route

__all__ = [
    "Routing",
    "capacity",
    "load_balancing_loss",
    "route",
    "router_z_loss",
    "update_balance_bias",
]
