"""`schemoe simulate --ctmoe`: a CT-MoE-like GPT (costmodel/ctmoe.py: the assumed shape) at 12,
16, 20 and 24 blocks, its whole training step predicted for sequential, tutel, schemoe (the
policy alone, and as shipped with Pipe-A2A + ZFP) and the wavefront stack, next to the ScheMoE
paper's CT-MoE step times.

    schemoe simulate --ctmoe [--preset paper-32gpu]

Ends with one JSON line: {"preset", "shape": {...}, "rows": [predict_ctmoe's row per layer count]}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..costmodel.ctmoe import ASSUMED, BUCKET_BYTES, CTMOE_LAYERS, predict_ctmoe
from ..costmodel.hardware import Hardware

__all__ = ["add_arguments", "run"]

SHAPE_FLAGS = ("model_dim", "hidden", "tokens", "seq_len", "layers", "experts", "top_k",
               "capacity_factor", "step", "batch", "heads", "moe_every", "micro_chunks")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctmoe", action="store_true", help="a CT-MoE-like GPT (assumed shape, "
                   "docs/costmodel.md) at 12-24 blocks: step per policy next to the paper's")  # fmt: skip


def _check(args: argparse.Namespace) -> None:
    given = [f for f in SHAPE_FLAGS if f in getattr(args, "explicit", ())]
    if given:
        flags = ", ".join("--" + f.replace("_", "-").replace("hidden", "hidden-dim") for f in given)
        raise ValueError(f"--ctmoe prices its own assumed shape; drop {flags}")


def _r(cell: dict) -> str:
    return f"{cell['ms']:7.1f} (r={cell['chunks']})"


def run(args: argparse.Namespace, hw: Hardware) -> int:
    _check(args)
    rows = [predict_ctmoe(hw, n) for n in CTMOE_LAYERS]
    s = ASSUMED
    print(
        f"# schemoe simulate --ctmoe: preset {hw.name}, {hw.nodes} x {hw.ranks_per_node} ranks; "
        f"ASSUMED shape (the paper gives layers and cluster only): B={s.batch} L={s.seq_len} "
        f"M={s.model_dim} H={s.hidden} heads={s.heads} E={hw.world} (one per rank) k={s.top_k} "
        f"f={s.capacity_factor} MoE in every block, vocab {s.vocab}, fp32"
    )
    print(
        f"# step = blocks + head + AdamW + dense-gradient all-reduce (DDP, "
        f"{BUCKET_BYTES / 2**20:.0f} MiB buckets); all-to-all naive unless said; paper ms are the "
        f"paper's measurements (Tutel / FasterMoE / ScheMoE)"
    )
    print(
        f"{'layers':>6} {'paper T/F/S ms':>16} {'sequential':>10} {'tutel':>15} {'schemoe':>15} "
        f"{'schemoe+pipe+zfp':>17} {'wavefront stack (region r m)':>30} {'stack m=1':>9} "
        f"{'stack, scheduled sync':>30} "
        f"{'S/T paper':>9} {'S/T pred':>8} {'S+zfp/T':>8}"
    )
    for row in rows:
        p, st = row["paper_ms"], row["stack"]
        paper = f"{p['tutel']}/{p['fastermoe']}/{p['schemoe']}" if p else "-"
        stack = f"{st['ms']:7.1f} ({st['policy']} r={st['chunks']} m={st['micro']})"
        ss = row["stack_scheduled"]
        sched = f"{ss['ms']:7.1f} ({ss['policy']} r={ss['chunks']} m={ss['micro']})"
        ratio = f"{row['ratio_paper']:.3f}" if row["ratio_paper"] else "-"
        print(
            f"{row['layers']:>6} {paper:>16} {row['sequential']['ms']:>10.1f} "
            f"{_r(row['tutel']):>15} {_r(row['schemoe']):>15} {_r(row['schemoe_shipped']):>17} "
            f"{stack:>30} {st['m1_ms']:>9.1f} {sched:>30} {ratio:>9} "
            f"{row['ratio_predicted']:>8.3f} {row['ratio_shipped']:>8.3f}"
        )
    for row in rows:
        f = row["fixed_ms"]
        print(
            f"# {row['layers']} layers, in every policy's step: head fwd+bwd {f['head']} ms, "
            f"AdamW {f['optimizer']} ms, dense all-reduce {f['allreduce']} ms if back to back"
        )
    shape = {k: v for k, v in dataclasses.asdict(s).items() if k != "layers"}
    print(json.dumps({"preset": hw.name, "shape": {**shape, "experts": hw.world}, "rows": rows}))
    return 0
