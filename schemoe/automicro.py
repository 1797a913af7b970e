"""`schemoe train --micro-chunks auto`: the micro-chunk count m, chosen before the model is built
by the stack's cost model (`costmodel.stack.choose_micro`) on the record `--policy auto` plans
on: the profile stored under the run's key (`profiles.cache_key` of the expert-parallel
topology and `Links.of_run()`), else a quick profile at the run's MoE shape (measured by every
rank of the group together, rank 0's fit stored and used).

    m, predicted_ms = choose_micro_chunks(StepShape(...), "schemoe", "naive", 2, topology)

Rank 0 decides and broadcasts (m, the predicted blocks' step per candidate m), so every rank
builds the same stack. Candidates: 1, 2, 4, 8 among the divisors of the batch; the fastest
predicted wins, ties to the smaller m (m = 1 when the model says so). The regions are priced
uncompressed under the run's policy, r and all-to-all algorithm.
"""

from __future__ import annotations

import logging

from .autotune import _from_rank0
from .costmodel import profiles
from .costmodel.hardware import Hardware
from .costmodel.stack import choose_micro
from .costmodel.step import StepShape
from .links import Links
from .probe import measure
from .topology import Topology

__all__ = ["CANDIDATES", "choose_micro_chunks", "plan_record"]

log = logging.getLogger("schemoe.automicro")

CANDIDATES = (1, 2, 4, 8)


def plan_record(
    topo: Topology, shape: StepShape, links: Links | None = None, path: str | None = None
) -> Hardware:
    """The Hardware record for the run's key (collective over `topo.group`; module docstring)."""
    links = links if links is not None else Links.of_run()
    key = profiles.cache_key(topo.nodes, topo.ranks_per_node, links)
    hw = _from_rank0(lambda: profiles.load(key, path), topo)
    if hw is not None:
        return hw
    mine, _ = measure.measure(
        topo, model_dim=shape.model_dim, hidden=shape.hidden, tokens=shape.tokens,
        experts=shape.experts, links=links, quick=True, calibrated=False, name=f"quick {key}",
    )  # fmt: skip
    hw = _from_rank0(lambda: mine, topo)
    if topo.rank == 0:
        profiles.save(hw, path)
    log.info("automicro: no profile %r; measured a quick one and stored it", key)
    return hw


def choose_micro_chunks(
    shape: StepShape,
    policy: str,
    algorithm: str,
    chunks: int,
    topo: Topology,
    *,
    hardware: Hardware | None = None,
    links: Links | None = None,
    path: str | None = None,
) -> tuple[int, dict[int, float]]:
    """(m, {candidate m: predicted blocks' forward + backward ms}); collective over topo.group."""
    hw = hardware if hardware is not None else plan_record(topo, shape, links, path)
    hw = hw.with_topology(topo.nodes, topo.ranks_per_node)

    def decide() -> tuple[int, dict[int, float]]:
        best, preds = choose_micro(hw, shape, policy, algorithm, chunks, candidates=CANDIDATES)
        return best, {m: round(p.step_s * 1e3, 3) for m, p in preds.items()}

    return _from_rank0(decide, topo)
