"""Predicted step times: one configuration of one layer on one hardware record, by simulation.

    predict(hw, shape, "schemoe", "pipe", ("fp16", "fp16"), chunks=4) -> Prediction
    predict_config(moe_config, tokens_per_rank, hw) -> Prediction
    predict_ms(moe_config, tokens_per_rank, topology, links, path=...) -> ms on a stored profile

A layer step (forward + backward, what `schemoe bench layer` times) is predicted as

    step = makespan(forward schedule) + outside + makespan(backward schedule)

with both makespans from `simulator.run` on the Schedule the policy gives for that graph (the
`search` policy gets the CostModel) and `outside` the router, layout and counts exchange
(`CostModel.outside`). tune.py chooses among such predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MoEConfig
from ..dist.links import Links
from ..scheduling import (
    POLICIES,
    Direction,
    TaskGraph,
    make_schedule,
    place_shared,
    simulator,
)
from . import profiles
from .hardware import Hardware
from .model import A2A_MODELS, CostModel, LayerShape, sharing_scale

__all__ = ["Prediction", "predict", "predict_config", "predict_ms", "topology_of"]


@dataclass(frozen=True)
class Prediction:
    """One candidate's simulated step, seconds."""

    policy: str
    algorithm: str
    compressors: tuple[str, str]
    chunks: int
    forward_s: float
    outside_s: float
    backward_s: float

    @property
    def step_s(self) -> float:
        return self.forward_s + self.outside_s + self.backward_s

    @property
    def compressor(self) -> str:
        f, b = self.compressors
        return f if f == b else f"{f}/{b}"

    def row(self) -> dict:
        return {
            "policy": self.policy,
            "algorithm": self.algorithm,
            "compressor": self.compressor,
            "chunks": self.chunks,
            "predicted_ms": round(self.step_s * 1e3, 4),
        }


def topology_of(topology) -> tuple[int, int]:
    if isinstance(topology, tuple):
        return topology
    return topology.nodes, topology.ranks_per_node


def predict(
    hw: Hardware,
    shape: LayerShape,
    policy: str,
    algorithm: str = "naive",
    compressors: tuple[str, str] = ("none", "none"),
    chunks: int = 1,
    *,
    events: list | None = None,
    shared: str = "scheduled",
) -> Prediction:
    """Simulate one configuration; append its timeline to `events` if given (forward from 0,
    backward after forward + outside). A shape with shared experts (shape.shared_hidden) adds
    their task S, placed as `shared` says ("scheduled": where the policy puts it; "before":
    first, as `SharedExpertConfig.placement`). When CPU ranks share cores (hw.host_cores), the compute
    speed depends on how busy the ranks are (`model.sharing_scale`): three fixed-point passes.
    Every compute cost is also multiplied by `hw.compute_factor`."""
    partition = POLICIES.get(policy).partition
    scale, passes = 1.0, 3 if sharing_scale(hw, 0.0) != 1.0 else 1
    for _ in range(passes):
        cm = CostModel(hw, shape, algorithm, compressors, compute_scale=scale * hw.compute_factor)
        out, busy, comm, t0 = {}, cm.outside(), 0.0, 0.0
        evs: list = []
        for direction in Direction:
            graph = TaskGraph(chunks, cm.links, direction, partition, shape.shared_hidden > 0)
            sched = place_shared(make_schedule(policy, graph, cm), shared)
            span, ev = simulator.run(sched, graph, cm, origin=t0, record=events is not None)
            out[direction] = span
            evs += ev
            tc = cm.task_costs(graph)
            busy += sum(v + tc.overhead for t, v in tc.durations.items() if not t.is_comm)
            comm += sum(v for t, v in tc.durations.items() if t.is_comm)
            t0 += span + cm.outside()
        step = out["forward"] + out["backward"] + cm.outside()
        scale = sharing_scale(hw, busy / step, comm / step) if step else 1.0
    if events is not None:
        events.extend(evs)
    return Prediction(
        policy, algorithm, tuple(compressors), chunks, out["forward"], cm.outside(), out["backward"]
    )


def predict_config(
    config: MoEConfig,
    tokens: int,
    hw: Hardware,
    dtype_bytes: int = 4,
    *,
    events: list | None = None,
) -> Prediction:
    """The predicted step of `config` (its policy, r, algorithm, compressors) on `hw`."""
    c = config
    return predict(
        hw,
        LayerShape.of(c, tokens, dtype_bytes),
        c.schedule.policy,
        c.collective.algorithm,
        (c.compression.forward, c.compression.backward),
        c.schedule.chunks,
        events=events,
        shared=c.shared.placement if c.shared is not None else "scheduled",
    )


def predict_ms(
    config: MoEConfig,
    tokens: int,
    topology,
    links: Links,
    hardware: Hardware | None = None,
    path: str | None = None,
    dtype_bytes: int = 4,
) -> float | None:
    """Predicted step (forward + backward) of `config` in ms on `hardware`, else on the profile
    stored under the key of `topology` and `links` (the run's); None when there is no such
    profile or no model for the algorithm. What `schemoe bench layer --predict` reports as
    `predicted_ms`."""
    nodes, rpn = topology_of(topology)
    hw = hardware or profiles.load(profiles.cache_key(nodes, rpn, links), path=path)
    if hw is None or config.collective.algorithm not in A2A_MODELS:
        return None
    return predict_config(config, tokens, hw.with_topology(nodes, rpn), dtype_bytes).step_s * 1e3
