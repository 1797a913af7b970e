"""The cost model (planning): predict a layer's step from a cluster's constants, and choose a
configuration by simulation. Pure functions and data; nothing here measures or runs a layer.

    hardware    Hardware records: fitted (`schemoe profile`) or presets (presets/*.json)
    model       per-task cost functions and CostModel (a layer on a cluster -> task durations)
    prediction  predict, predict_config: one configuration's simulated step
    profiles    the fits of measured samples, and the JSON store of records by key (topology
                and the link rates measured under: `cache_key`)

The simulator and the `search` policy that consume a CostModel are `schemoe.scheduling`'s;
searching configurations with it (choose.py), measuring (measure.py) and deciding for running
layers (auto.py) are `schemoe.tuning`'s.
"""

from .hardware import PRESETS, Hardware, Link, preset
from .model import A2A_MODELS, CostModel, LayerShape
from .prediction import predict, predict_config

__all__ = [
    "A2A_MODELS",
    "PRESETS",
    "CostModel",
    "Hardware",
    "LayerShape",
    "Link",
    "predict",
    "predict_config",
    "preset",
]
