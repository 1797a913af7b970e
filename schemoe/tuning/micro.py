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

from ..costmodel.hardware import Hardware
from ..costmodel.stack import choose_micro
from ..costmodel.step import StepShape
from ..dist.links import Links
from ..dist.topology import Topology
from .plan import from_rank0
from .stepplan import step_record

__all__ = ["CANDIDATES", "choose_micro_chunks"]

CANDIDATES = (1, 2, 4, 8)


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
    hw = step_record(shape, topo, hardware=hardware, links=links, path=path)

    def decide() -> tuple[int, dict[int, float]]:
        best, preds = choose_micro(hw, shape, policy, algorithm, chunks, candidates=CANDIDATES)
        return best, {m: round(p.step_s * 1e3, 3) for m, p in preds.items()}

    return from_rank0(decide, topo)
