"""What a run plans on, decided on rank 0 and shared: the Hardware record under the run's key and
the cost model's decisions on it. `AutoTuner` (autotune.py) and `--micro-chunks auto`
(automicro.py) both plan through here.

    from_rank0(make, topology)           # make() on rank 0 of the group, broadcast to every rank
    plan_record(topo, links, path, ...)  # the stored record of the run's key, else a quick profile
    resolve(config, tokens, topo, hw, n) # "auto": the cost model's shortlist of n configurations
    cost_model_for(config, tokens, ...)  # "search": the CostModel of this layer call

The record is never another topology's or link rate's: `profiles.cache_key` of the topology and
the run's `Links` names it; without a stored one, every rank of the group measures a quick
profile together (`schemoe.tuning.measure(quick=True, calibrated=False)` at the layer's shape),
rank 0's fit is stored under that key and every rank plans on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..costmodel import profiles
from ..costmodel.hardware import Hardware
from ..costmodel.model import A2A_MODELS, CostModel, LayerShape
from ..costmodel.prediction import topology_of
from ..dist.links import Links
from ..dist.topology import Topology
from . import measure
from .choose import choose_shortlist

__all__ = ["cost_model_for", "from_rank0", "plan_record", "resolve"]

log = logging.getLogger("schemoe.tuning.auto")


def from_rank0(make: Callable[[], Any], topology: Topology | tuple[int, int]) -> Any:
    """make() on rank 0 of `topology.group`, broadcast to every rank (collective when the group
    has several ranks; otherwise, or for a plain (nodes, ranks_per_node), just make())."""
    if isinstance(topology, tuple) or topology.world == 1 or not dist.is_initialized():
        return make()
    box = [make() if topology.rank == 0 else None]
    dist.broadcast_object_list(box, src=topology.global_rank(0), group=topology.group)
    return box[0]


def resolve(
    config: MoEConfig,
    tokens: int,
    topology: Topology | tuple[int, int],
    hardware: Hardware,
    n: int = 1,
) -> list[MoEConfig]:
    """[config] unless its policy is "auto"; else the cost model's shortlist of up to n
    configurations (fastest predicted first) on `hardware`.

    Collective when the group has several ranks: rank 0 of `topology.group` decides and
    broadcasts, so every rank runs the same configuration. Call it on every rank with the same
    `tokens`. The budget is the config's accuracy_budget."""
    if config.schedule.policy != "auto":
        return [config]
    topo = topology_of(topology)
    budget = config.schedule.accuracy_budget
    return from_rank0(lambda: choose_shortlist(config, tokens, topo, hardware, budget, n), topology)


def cost_model_for(
    config: MoEConfig,
    tokens: int,
    topology: Topology | tuple[int, int],
    hardware: Hardware,
    dtype_bytes: int = 4,
) -> CostModel | None:
    """The CostModel of this layer call for the search policy on `hardware` (give every rank
    the same record: every rank's search must build the same schedule, since transfers are
    collectives); None when the algorithm has no cost model."""
    if config.collective.algorithm not in A2A_MODELS:
        return None
    return CostModel(
        hardware.with_topology(*topology_of(topology)),
        LayerShape.of(config, tokens, dtype_bytes),
        config.collective.algorithm,
        (config.compression.forward, config.compression.backward),
    )


def plan_record(
    topo: Topology,
    links: Links,
    path: str | None,
    *,
    model_dim: int,
    hidden: int,
    tokens: int,
    experts: int,
) -> tuple[Hardware, dict | None]:
    """The record to plan on under the key of `topo` and `links`: the one stored (rank 0 reads
    it, every rank gets it), else a quick profile every rank measures at the given shape, rank 0's
    fit stored and shared. (record, the measurement's summary or None). Collective over
    topo.group. The measurement draws random inputs and runs backward: the caller's RNG stream
    is kept and grad is on whatever mode the caller is in."""
    key = profiles.cache_key(topo.nodes, topo.ranks_per_node, links)
    hw = from_rank0(lambda: profiles.load(key, path), topo)
    if hw is not None:
        return hw, None
    t0 = time.perf_counter()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        mine, _ = measure.measure(
            topo, model_dim=model_dim, hidden=hidden, tokens=tokens, experts=experts,
            links=links, quick=True, calibrated=False, name=f"quick {key}",
        )  # fmt: skip
    seconds = time.perf_counter() - t0
    hw, seconds = from_rank0(lambda: (mine, seconds), topo)  # every rank plans on rank 0's
    if topo.rank == 0:
        profiles.save(hw, path)
    row = {
        "key": key,
        "seconds": round(seconds, 3),
        "inter_gbps": round(hw.inter.beta * 8 / 1e9, 3),
        "intra_gbps": round(hw.intra.beta * 8 / 1e9, 3),
        "gflops": round(hw.flops / 1e9, 2),
    }
    log.info(
        "autotune: no profile %r in %s; measured a quick one in %.2f s (inter %.3g Gbit/s, "
        "intra %.3g Gbit/s, experts %.3g GFLOP/s) and stored it",
        key, path or profiles.DEFAULT_PATH, seconds, row["inter_gbps"], row["intra_gbps"],
        row["gflops"],
    )  # fmt: skip
    return hw, row
