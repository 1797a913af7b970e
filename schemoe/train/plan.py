"""What `schemoe train` decides before it builds the model, by the cost model on the record the
run plans on (the stored profile of the run's key, else a quick profile; rank 0 decides and
every rank gets the same):

  * `--auto-step`: one plan for the whole step (`tuning.stepplan.choose_step`): the layers'
    policy and r, the micro-chunk count m and the gradient sync, among what this run can run
    (`candidates`); --grad-compressor stays as given (a lossy one is the user's call);
  * `--micro-chunks auto`: m alone under the given policy and r (`tuning.micro`).

Both price the step on the expert-parallel group's topology (with --ep-size < the ranks, the
replicas' gradient all-reduce across groups is priced as within one group).
"""

from __future__ import annotations

import dataclasses

from ..costmodel.plans import StepPlan, plan_grid
from ..costmodel.step import StepShape
from ..dist.topology import Topology
from ..tuning.micro import choose_micro_chunks
from ..tuning.stepplan import choose_step
from .checks import check_chunk_rows
from .config import TrainConfig

__all__ = ["POLICIES", "auto_micro", "auto_step", "candidates", "step_shape"]

POLICIES = ("sequential", "tutel", "fastermoe", "schemoe")  # what --auto-step chooses among
CHUNKS = (1, 2, 4, 8)
MICRO = (1, 2, 4, 8)


def step_shape(cfg: TrainConfig, world: int) -> StepShape:
    """The step's shape for the cost model (capacity factor 0, dropless, priced as f = 1)."""
    return StepShape(
        batch=cfg.batch, seq_len=cfg.seq_len, model_dim=cfg.model_dim, hidden=cfg.hidden_dim,
        layers=cfg.layers, heads=cfg.heads, moe_every=cfg.moe_every,
        experts=cfg.num_experts(world), top_k=cfg.top_k,
        capacity_factor=cfg.capacity_factor or 1.0, dedup=cfg.dedup,
    )  # fmt: skip


def _fits(cfg: TrainConfig, world: int, ep: int, policy: str, r: int, m: int) -> bool:
    """r chunks of a layer call of the batch cut into m micro-chunks are none of them empty."""
    gate = cfg.moe_config(world).gate
    try:
        check_chunk_rows(r, policy, gate, cfg.batch * cfg.seq_len // m, ep, "")
    except ValueError:
        return False
    return True


def candidates(cfg: TrainConfig, world: int, ep: int) -> list[StepPlan]:
    """The plans --auto-step chooses among: every policy and r whose chunks are not empty, m
    dividing --batch (1 only where the micro-chunk stack cannot run: --shared-experts, --replan,
    --activation-checkpointing, --fsdp), DDP's or the scheduled sync (DDP's only under --fsdp or
    without data parallelism), the run's --grad-compressor."""
    stack = not (cfg.shared_experts or cfg.replan or cfg.activation_checkpointing or cfg.fsdp)
    syncs = ("ddp", "scheduled") if world > 1 and not cfg.fsdp else ("ddp",)
    plans = plan_grid(POLICIES, CHUNKS, MICRO if stack else (1,), syncs, (cfg.grad_compressor,),
                      world=ep, batch=cfg.batch)  # fmt: skip
    return [p for p in plans if _fits(cfg, world, ep, p.policy, p.chunks, p.micro_chunks)]


def auto_step(cfg: TrainConfig, world: int, ep_group, rank: int) -> tuple[TrainConfig, dict]:
    """--auto-step: (cfg with the chosen policy, chunks, micro_chunks, grad_sync and, under DDP,
    the flat all-reduce; the record of the choice). Collective over the expert-parallel group;
    rank 0 prints the choice and its reason."""
    topo = Topology.from_group(ep_group, cfg.ranks_per_node)
    buckets = {s: (cfg.bucket_mb or d) * 2**20 for s, d in (("ddp", 25.0), ("scheduled", 1.0))}
    choice = choose_step(
        step_shape(cfg, world), candidates(cfg, world, topo.world), topo,
        algorithm=cfg.algorithm, grad_algorithm=cfg.grad_algorithm, bucket_bytes=buckets,
    )  # fmt: skip
    plan = choice.plan
    if rank == 0:
        print(f"auto step: {choice.reason}", flush=True)
    cfg = dataclasses.replace(
        cfg, policy=plan.policy, chunks=plan.chunks, micro_chunks=plan.micro_chunks,
        grad_sync=plan.grad_sync,
        grad_algorithm=cfg.grad_algorithm if plan.grad_sync == "scheduled" else "flat",
    )  # fmt: skip
    record = {
        "chosen": plan.name,
        "plan": plan.row(),
        "reason": choice.reason,
        "predicted_ms": {p.name: ms for p, ms in choice.ranked},
    }
    return cfg, record


def auto_micro(cfg: TrainConfig, world: int, ep_group, rank: int) -> tuple[int, dict]:
    """--micro-chunks auto: (m from the stack's cost model (tuning/micro.py), the same on every
    rank; the record of the choice with each candidate's prediction). Rank 0 logs it."""
    topo = Topology.from_group(ep_group, cfg.ranks_per_node)
    shape = step_shape(cfg, world)
    m, preds = choose_micro_chunks(shape, cfg.policy, cfg.algorithm, cfg.chunks, topo)
    if rank == 0:
        shown = ", ".join(f"m={k}: {v:.3f} ms" for k, v in preds.items())
        print(f"micro-chunks auto: m = {m} (predicted blocks' step: {shown})", flush=True)
    return m, {"chosen": m, "predicted_ms": {str(k): v for k, v in preds.items()}}
