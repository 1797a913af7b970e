"""The cost model (planning): predict a layer's step from a cluster's constants, and choose a
configuration by simulation. Pure functions and data; nothing here measures or runs a layer.

    hardware    Hardware records: fitted (`schemoe profile`) or presets (presets/*.json)
    model       per-task cost functions and CostModel (a layer on a cluster -> task durations)
    prediction  predict, predict_config: one configuration's simulated step
    tune        explore, shortlist, choose: the fastest configurations by simulation
    profiles    the fits of measured samples, and the JSON store of records by key (topology
                and the link rates measured under: `cache_key`)

The simulator and the `search` policy that consume a CostModel are `schemoe.scheduling`'s;
measuring is `schemoe.probe`'s (run by `schemoe profile` and the auto tuner); deciding for running layers is `schemoe.autotune`'s.
"""

from .hardware import PRESETS, Hardware, Link, preset
from .model import A2A_MODELS, CostModel, LayerShape
from .prediction import predict, predict_config
from .tune import choose, choose_shortlist, explore

__all__ = [
    "A2A_MODELS",
    "PRESETS",
    "CostModel",
    "Hardware",
    "LayerShape",
    "Link",
    "choose",
    "choose_shortlist",
    "explore",
    "predict",
    "predict_config",
    "preset",
]
