"""One decision for the whole step: which plan (the layers' policy and r, micro-chunks m, the
dense gradients' sync and compressor) a training step runs, chosen by the step's cost model
(`costmodel.plans`) on the record the run plans on, with the reason.

    choice = choose_step(StepShape(...), plan_grid(...), topology)
    choice.plan            # StepPlan: what to build the model and its DDP wrapper with
    choice.reason          # "schemoe/r4/scheduled/bf16: predicted 205.1 ms; next ..."

The record is the one `--policy auto` plans on (`plan.plan_record`: the profile stored under
the run's key, else a quick profile measured by every rank of the group together). Rank 0
decides and broadcasts, so every rank builds the same step. The candidates are the caller's:
leave lossy gradient compressors out unless the run accepts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..costmodel.hardware import Hardware
from ..costmodel.plans import StepPlan, rank_plans
from ..costmodel.step import StepShape
from ..dist.links import Links
from ..dist.topology import Topology
from .plan import from_rank0, plan_record

__all__ = ["StepChoice", "choose_step", "decide", "step_record"]


@dataclass(frozen=True)
class StepChoice:
    """The chosen plan, every candidate's predicted ms (fastest first) and why."""

    plan: StepPlan
    predicted_ms: float
    ranked: tuple[tuple[StepPlan, float], ...]

    @property
    def reason(self) -> str:
        """The choice against the runner-up and the slowest candidate, in predicted ms."""
        head = f"{self.plan.name}: predicted {self.predicted_ms:.1f} ms"
        if len(self.ranked) == 1:
            return head + " (the only candidate)"
        (nxt, nxt_ms), (last, last_ms) = self.ranked[1], self.ranked[-1]
        return (
            f"{head}; next {nxt.name} {nxt_ms:.1f} ms (+{nxt_ms / self.predicted_ms - 1:.1%}); "
            f"slowest {last.name} {last_ms:.1f} ms, of {len(self.ranked)} candidates"
        )


def decide(hw: Hardware, shape: StepShape, plans: Sequence[StepPlan], **options) -> StepChoice:
    """The fastest predicted plan on `hw` (no collective); `options` are `predict_plan`'s."""
    if not plans:
        raise ValueError("choose_step needs at least one candidate plan, got none")
    ranked = tuple(
        (p, round(pred.step_s * 1e3, 3)) for p, pred in rank_plans(hw, shape, plans, **options)
    )
    return StepChoice(ranked[0][0], ranked[0][1], ranked)


def step_record(
    shape: StepShape,
    topo: Topology,
    *,
    hardware: Hardware | None = None,
    links: Links | None = None,
    path: str | None = None,
) -> Hardware:
    """`hardware`, else the record the run plans on at the step's MoE shape (`plan.plan_record`:
    collective over topo.group), on `topo`'s nodes and ranks per node."""
    if hardware is None:
        hardware, _ = plan_record(
            topo, links if links is not None else Links.of_run(), path,
            model_dim=shape.model_dim, hidden=shape.hidden, tokens=shape.tokens,
            experts=shape.experts,
        )  # fmt: skip
    return hardware.with_topology(topo.nodes, topo.ranks_per_node)


def choose_step(
    shape: StepShape,
    plans: Sequence[StepPlan],
    topo: Topology,
    *,
    hardware: Hardware | None = None,
    links: Links | None = None,
    path: str | None = None,
    **options,
) -> StepChoice:
    """`decide` on the run's record (`step_record`), the same on every rank (collective over
    topo.group)."""
    hw = step_record(shape, topo, hardware=hardware, links=links, path=path)
    return from_rank0(lambda: decide(hw, shape, plans, **options), topo)
