"""Expert-load metrics of a model's MoE layers, for `schemoe train` and users' own loops.

    record_load(model)                  # every MoELayer tallies its routing from now on
    ... training steps ...
    per_layer = load_metrics(model)     # [LoadMetrics | None], one per MoELayer, then reset
    print(load_summary(per_layer))      # "overload 1.42 drop 0.8%"

Where the figures come from: while `record_routing` is on, each training call of a layer adds its
choices per expert and its kept choices to a small long tensor on the layer's device
(`schemoe.routing.load.tally`): no host sync and no collective per call. `load_metrics` reads
those counts (one host sync per layer, when called) and resets them. They are this rank's tokens
only (no collective): on an expert-parallel group the ranks' figures differ a little.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..routing.load import LoadMetrics
from .moe import MoELayer

__all__ = ["LoadMetrics", "load_metrics", "load_summary", "record_load"]


def _layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def record_load(model: nn.Module, on: bool = True) -> None:
    """Start (or stop, `on=False`) tallying the routing of every MoELayer of `model`."""
    for m in _layers(model):
        m.record_routing = on


def load_metrics(model: nn.Module) -> list[LoadMetrics | None]:
    """Each MoELayer's load since the last take (module order), then reset; None for a layer
    without a recorded training call. One host sync per layer; no collective."""
    return [m.take_load_metrics() for m in _layers(model)]


def load_summary(per_layer: Sequence[LoadMetrics | None]) -> str:
    """One line over the layers: the highest overload factor and the dropped fraction of all
    their choices, e.g. "overload 1.42 drop 0.8%"; "" when no layer has a choice."""
    got = [m for m in per_layer if m is not None and m.choices]
    if not got:
        return ""
    choices = sum(m.choices for m in got)
    dropped = 1.0 - sum(m.kept for m in got) / choices
    return f"overload {max(m.overload for m in got):.2f} drop {dropped:.1%}"
