"""A CT-MoE-like GPT on a cluster, predicted per policy, next to the ScheMoE paper's CT-MoE
step times (PAPER.md: 8 nodes x 4 RTX 2080Ti, E = P = 32; 12-24 layers).

    predict_ctmoe(preset("paper-32gpu"), 12) -> {"layers": 12, "sequential": {...}, "tutel": {...},
        "schemoe": {...}, "stack": {...}, "paper_ms": {...}, ...}

The paper gives CT-MoE's layer counts and cluster, not its shape. ASSUMED is the shape priced
here, each value from what PAPER.md does say (docs/costmodel.md, "CT-MoE on the paper's
cluster (simulated)"):
  * E = P: one expert per GPU (the paper's E = P = 32);
  * k = 1, f = 1.2: the one layer shape PAPER.md gives exactly (the ablation: its 645 MB
    all-to-all input is f k B L M 4 bytes with k = 1, f = 1.2);
  * B = 4, L = 512, M = 1024, H = 4096 (heads 16 of 64): the middle of the paper's synthetic
    ranges (B in {2,4,8}, L in {512..2048}, M, H in {512..8192}) with H = 4M as in a
    transformer; at this shape the plain all-to-alls are about half of a sequential MoE block
    (PAPER.md: 51-59% of Tutel's step), which the larger B L = 4096 of the layer-level CT-MoE
    section (about 3x the paper's times) is not;
  * an MoE FFN in every block (the paper counts MoE layers); vocab 50257 (GPT-2's BPE: the
    paper's language model reports perplexity; the vocab sets only the head's cost).
ScheMoE is priced twice: the policy alone (uncompressed, plain all-to-all: Theorem 1 makes it
Tutel's order) and as the paper ships it (Pipe-A2A, ZFP at 4x). Every row is priced by the step model (step.py: blocks, head, AdamW, the dense gradients'
all-reduce in DDP's 25 MiB buckets posted as DDP posts them); the stack (stack.py) at its best
(region policy, r, m), under DDP its buckets after its backward, under the scheduled sync
(gradsync.py) each block's gradients all-reduced inside it (lossless, flat). PAPER.md does not say whether the paper's
step includes the head, the optimizer or the all-reduce; `fixed_ms` gives their share.
"""

from __future__ import annotations

from dataclasses import replace

from .hardware import Hardware
from .stack import predict_stack_step
from .step import (
    StepShape,
    _buckets,
    allreduce_time,
    gradient_bytes,
    head_time,
    optimizer_time,
    predict_step,
)

__all__ = ["ASSUMED", "CTMOE_LAYERS", "PAPER_MS", "ctmoe_shape", "predict_ctmoe"]

CTMOE_LAYERS = (12, 16, 20, 24)
# PAPER.md, CT-MoE step time in ms: layers -> Tutel, FasterMoE, ScheMoE.
PAPER_MS = {
    12: {"tutel": 497, "fastermoe": 506, "schemoe": 454},
    16: {"tutel": 623, "fastermoe": 640, "schemoe": 552},
    20: {"tutel": 769, "fastermoe": 845, "schemoe": 658},
    24: {"tutel": 864, "fastermoe": 1003, "schemoe": 774},
}
ASSUMED = StepShape(
    batch=4,
    seq_len=512,
    model_dim=1024,
    hidden=4096,
    layers=12,
    heads=16,
    moe_every=1,
    experts=32,
    top_k=1,
    capacity_factor=1.2,
    vocab=50257,
)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
REGION_POLICIES = ("sequential", "tutel", "schemoe")
# (row, policy, all-to-all, compressor): the policies alone on a plain all-to-all, and ScheMoE
# as the paper ships it (Pipe-A2A, ZFP on both all-to-alls).
SYSTEMS = (
    ("tutel", "tutel", "naive", "none"),
    ("schemoe", "schemoe", "naive", "none"),
    ("schemoe_shipped", "schemoe", "pipe", "zfp"),
)


def ctmoe_shape(layers: int, world: int) -> StepShape:
    """ASSUMED at `layers` blocks, one expert per rank of a `world`-rank cluster."""
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an int >= 1, got {layers!r}")
    return replace(ASSUMED, layers=layers, experts=world)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def predict_ctmoe(
    hw: Hardware,
    layers: int,
    *,
    chunks: tuple[int, ...] = (1, 2, 4, 8),
    micro: tuple[int, ...] = (1, 2, 4),
) -> dict:
    """One row of the CT-MoE table: sequential at r = 1, tutel, schemoe and schemoe as shipped
    (Pipe-A2A + ZFP) at their best r (DDP gradient sync), the wavefront stack at its best (region policy, r, m) with its m = 1 twin,
    the paper's numbers and the schemoe / tutel ratios (module docstring)."""
    shape = ctmoe_shape(layers, hw.world)
    row: dict = {"layers": layers}
    row["sequential"] = {"chunks": 1, "ms": _ms(_step(hw, shape, "sequential", 1))}
    for name, pol, alg, comp in SYSTEMS:
        r = min(chunks, key=lambda c, p=pol, a=alg, z=comp: (_step(hw, shape, p, c, a, z), c))
        row[name] = {"chunks": r, "ms": _ms(_step(hw, shape, pol, r, alg, comp))}
    for name, sync in (("stack", "ddp"), ("stack_scheduled", "scheduled")):
        stacks = {
            (pol, r, m): predict_stack_step(
                hw, shape, pol, "naive", r, micro=m, grad_sync=sync, bucket_bytes=BUCKET_BYTES
            ).step_s
            for pol in REGION_POLICIES
            for r in (chunks if pol != "sequential" else (1,))
            for m in micro
            if shape.batch % m == 0
        }
        pol, r, m = min(stacks, key=lambda k: (stacks[k], k[2]))
        row[name] = {"policy": pol, "chunks": r, "micro": m, "ms": _ms(stacks[pol, r, m]),
                     "m1_ms": _ms(stacks[pol, r, 1])}  # fmt: skip
    buckets = sum(allreduce_time(hw, b) for _, b in _buckets([gradient_bytes(shape)], BUCKET_BYTES))
    row["fixed_ms"] = {
        "head": _ms(3 * head_time(hw, shape)),
        "optimizer": _ms(optimizer_time(hw, shape)),
        "allreduce": _ms(buckets),
    }
    paper = PAPER_MS.get(layers)
    row["paper_ms"] = paper
    row["ratio_predicted"] = round(row["schemoe"]["ms"] / row["tutel"]["ms"], 3)
    row["ratio_shipped"] = round(row["schemoe_shipped"]["ms"] / row["tutel"]["ms"], 3)
    row["ratio_paper"] = round(paper["schemoe"] / paper["tutel"], 3) if paper else None
    return row


def _step(hw, shape, policy: str, chunks: int, alg: str = "naive", comp: str = "none") -> float:
    return predict_step(
        hw, shape, policy, alg, chunks, grad_sync="ddp", bucket_bytes=BUCKET_BYTES,
        compressors=(comp, comp),
    ).step_s  # fmt: skip
