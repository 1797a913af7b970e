"""Whole-step plans, priced: what the step runs (the layers' policy and r, the micro-chunk count
m, the dense gradients' sync and compressor) and its predicted step, by one function for every
caller (`schemoe simulate --step`, `schemoe validate` of bench step rows, `bench step
--auto-step`, `tuning.stepplan.choose_step`).

    plans = plan_grid(("sequential", "schemoe"), (1, 4), (1, 2), ("ddp", "scheduled"),
                      ("none",), world=4, batch=8)
    rank_plans(hw, StepShape(...), plans, algorithm="naive") -> [(StepPlan, StepPrediction)]

m = 1 is `step.predict_step`; m > 1 the wavefront stack, `stack.predict_stack_step`. The
options (all-to-all algorithm, the scheduled sync's algorithm, DDP's bucket bytes) are the run's,
the same for every plan; `grad_algorithm` applies to scheduled plans only (DDP's all-reduce is
flat).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from ..routing.layout import Partition
from ..scheduling import POLICIES
from .hardware import Hardware
from .stack import predict_stack_step
from .step import StepPrediction, StepShape, predict_step

__all__ = ["StepPlan", "plan_grid", "predict_plan", "rank_plans"]


@dataclass(frozen=True)
class StepPlan:
    """One candidate of a whole step (the names are `schemoe train`'s flags)."""

    policy: str = "schemoe"
    chunks: int = 1
    micro_chunks: int = 1
    grad_sync: str = "ddp"
    grad_compress: str = "none"

    @property
    def name(self) -> str:
        """`bench step`'s row name: policy/rR[/mM]/sync/compressor."""
        m = f"/m{self.micro_chunks}" if self.micro_chunks > 1 else ""
        return f"{self.policy}/r{self.chunks}{m}/{self.grad_sync}/{self.grad_compress}"

    def row(self) -> dict:
        """The plan as bench step's row columns."""
        return asdict(self)


def plan_grid(
    policies: Iterable[str],
    chunks: Iterable[int],
    micro_chunks: Iterable[int],
    grad_syncs: Iterable[str],
    grad_compressors: Iterable[str],
    *,
    world: int,
    batch: int,
) -> list[StepPlan]:
    """Every combination the step can run, in the order given: plans whose policy cannot split
    into r peer groups on `world` ranks, or whose m does not divide the batch, are left out."""
    out = []
    combos = itertools.product(policies, chunks, micro_chunks, grad_syncs, grad_compressors)
    for pol, r, m, sync, comp in combos:
        if POLICIES.get(pol).partition == Partition.PEERS and r > world:
            continue
        if m < 1 or batch % m:
            continue
        out.append(StepPlan(pol, r, m, sync, comp))
    return out


def predict_plan(
    hw: Hardware,
    shape: StepShape,
    plan: StepPlan,
    *,
    algorithm: str = "naive",
    grad_algorithm: str = "flat",
    bucket_bytes: float | Mapping[str, float] = 1 << 20,
) -> StepPrediction:
    """The predicted step of `plan` (module docstring). `bucket_bytes`: one size for every
    plan, or one per gradient sync (`schemoe train`'s defaults differ: {"ddp": 25 MiB,
    "scheduled": 1 MiB})."""
    if isinstance(bucket_bytes, Mapping):
        bucket_bytes = bucket_bytes[plan.grad_sync]
    options = {
        "grad_sync": plan.grad_sync,
        "grad_compress": plan.grad_compress,
        "grad_algorithm": grad_algorithm if plan.grad_sync == "scheduled" else "flat",
        "bucket_bytes": bucket_bytes,
    }
    if plan.micro_chunks > 1:
        return predict_stack_step(
            hw, shape, plan.policy, algorithm, plan.chunks, micro=plan.micro_chunks, **options
        )
    return predict_step(hw, shape, plan.policy, algorithm, plan.chunks, **options)


def rank_plans(
    hw: Hardware, shape: StepShape, plans: Iterable[StepPlan], **options
) -> list[tuple[StepPlan, StepPrediction]]:
    """Every plan with its prediction, fastest first (ties keep the order given); `options` are
    `predict_plan`'s."""
    preds = [(plan, predict_plan(hw, shape, plan, **options)) for plan in plans]
    return sorted(preds, key=lambda pp: pp[1].step_s)
