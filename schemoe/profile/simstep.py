"""`schemoe simulate --step`: the whole training step of `schemoe train`'s GPT, predicted for every
(policy, r, gradient sync, gradient compressor) on a preset or a profile (costmodel/step.py),
and the configuration auto would choose for the step.

    schemoe simulate --step --preset local --nodes 2 --ranks-per-node 2 --batch 8 --seq-len 64 \\
        --layers 4 --model-dim 256 --hidden-dim 512 [--grad-compressors none,bf16]

Ends with one JSON line: {"preset", "results": [{"policy", "chunks", "grad_sync",
"grad_compress", "micro_chunks", "predicted_ms", "network_ms"}, ...] (fastest first), "chosen": {...}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..costmodel.hardware import Hardware
from ..costmodel.plans import plan_grid, rank_plans
from ..costmodel.step import StepShape

__all__ = ["add_arguments", "run", "shape_of"]


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--step: the GPT of schemoe train (its flags)").add_argument
    g("--step", action="store_true", help="predict whole training steps of schemoe train's GPT")
    g("--batch", type=int, default=8, help="--step: sequences per rank")
    g("--heads", type=int, default=4, help="--step: attention heads")
    g("--moe-every", type=int, default=2, help="--step: an MoE FFN in every n-th block")
    g("--grad-syncs", type=_csv, default=("ddp", "scheduled"), help="--step: comma list")
    g("--grad-compressors", type=_csv, default=("none",),
      help="--step: comma list of none, bf16, fp16")  # fmt: skip
    g("--grad-algorithm", choices=("flat", "hier"), default="flat",
      help="--step: the scheduled sync's algorithm")  # fmt: skip
    g("--bucket-mb", type=float, default=1.0, help="--step: DDP bucket MiB")
    g("--algorithm", default="naive", help="--step: the all-to-all algorithm")
    g("--micro-chunks", type=lambda t: [int(v) for v in _csv(t)], default=[1],
      help="--step: comma list of m (m > 1: the blocks as a wavefront stack)")  # fmt: skip


def shape_of(cls: type, args: argparse.Namespace, hw: Hardware):
    """`cls` (LayerShape or StepShape) from the `profile simulate` flags: each field from the
    flag of its name, the expert hidden dim from --hidden-dim, E from --experts (default 2 per
    rank); a field without a flag keeps its default."""
    given = {
        "hidden_dim": args.hidden,
        "hidden": args.hidden,
        "experts": args.experts or 2 * hw.world,
    }
    names = (f.name for f in dataclasses.fields(cls))
    return cls(
        **{
            n: given[n] if n in given else getattr(args, n)
            for n in names
            if n in given or hasattr(args, n)
        }
    )


def run(args: argparse.Namespace, hw: Hardware) -> int:
    if args.seq_len < 1 or args.batch < 1:
        raise ValueError(
            f"--step needs --seq-len and --batch >= 1, got {args.seq_len}, {args.batch}"
        )
    shape = shape_of(StepShape, args, hw)
    shape.layer()  # the MoE layer's shape checks its own fields
    for m in args.micro_chunks:
        if m < 1 or shape.batch % m:
            raise ValueError(f"--micro-chunks {m} must be >= 1 and divide --batch {shape.batch}")
    plans = plan_grid(
        ("sequential", "tutel", "fastermoe", "schemoe"),
        tuple(r for r in (1, 2, 4, 8, 16) if r <= args.max_chunks),
        (1, *(m for m in args.micro_chunks if m != 1)), args.grad_syncs, args.grad_compressors,
        world=hw.world, batch=shape.batch,
    )  # fmt: skip
    preds = rank_plans(
        hw, shape, plans, algorithm=args.algorithm, grad_algorithm=args.grad_algorithm,
        bucket_bytes=args.bucket_mb * 2**20,
    )  # fmt: skip
    rows = [
        {
            **plan.row(),
            "predicted_ms": round(p.step_s * 1e3, 3),
            "network_ms": round(p.network_s * 1e3, 3),
        }
        for plan, p in preds
    ]
    print(
        f"# schemoe simulate --step: preset {hw.name}, {hw.nodes} x {hw.ranks_per_node} ranks, "
        f"GPT {shape.layers} blocks (MoE every {shape.moe_every}), B={shape.batch} "
        f"L={shape.seq_len} M={shape.model_dim} H={shape.hidden} E={shape.experts} "
        f"k={shape.top_k} f={shape.capacity_factor}, all-to-all {args.algorithm}"
    )
    print(
        f"{'policy':>10} {'r':>2} {'m':>2} {'grad_sync':>9} {'grad_compress':>13} {'step ms':>10} "
        f"{'network ms':>10}"
    )
    for row in rows:
        print(
            f"{row['policy']:>10} {row['chunks']:>2} {row['micro_chunks']:>2} {row['grad_sync']:>9} "
            f"{row['grad_compress']:>13} {row['predicted_ms']:>10.3f} {row['network_ms']:>10.3f}"
        )
    out = {"preset": hw.name, "results": rows, "chosen": rows[0]}
    print(f"chosen: {rows[0]}")
    print(json.dumps(out))
    return 0
