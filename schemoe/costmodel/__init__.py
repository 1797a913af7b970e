"""Cost model, simulator and tuner: predict a layer's step from a cluster's constants, find the
best task order (`search` policy) and configuration (`tune.choose`), and plan at scale.

    hardware   Hardware records: fitted (`schemoe profile`) or presets (paper-32gpu, h100-64gpu)
    model      per-task cost functions and CostModel (a layer on a cluster -> task durations)
    simulator  run(schedule, graph, costs) -> (makespan, trace events), the executor's rules
    search     the "search" policy (registered on import)
    prediction predict, predict_config: one configuration's simulated step
    tune       explore, shortlist, choose, resolve (ScheduleConfig(policy="auto"))
    online     Trials: "auto"'s first calls time the model's shortlist and keep the fastest
    profile    fit and cache the constants on the running ranks (calibrate: on real layer steps)
"""

from . import search
from .hardware import PRESETS, Hardware, Link, preset
from .model import A2A_MODELS, CostModel, LayerShape, TaskCosts
from .prediction import predict, predict_config
from .simulator import run
from .tune import choose, explore, resolve

__all__ = [
    "A2A_MODELS",
    "PRESETS",
    "CostModel",
    "Hardware",
    "LayerShape",
    "Link",
    "TaskCosts",
    "choose",
    "explore",
    "predict",
    "predict_config",
    "preset",
    "resolve",
    "run",
    "search",
]
