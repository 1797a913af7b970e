"""`schemoe validate` on saved `schemoe bench step` outputs: each measured step row against
`costmodel.step.predict_step` on a profile."""

from __future__ import annotations

from ..costmodel.hardware import Hardware
from ..costmodel.step import StepShape, predict_step

__all__ = ["is_step_row", "point"]


def is_step_row(row: dict) -> bool:
    """A row of `schemoe bench step` that the step model prices: not the DeepSpeed peer, and one
    micro-chunk (predict_step models m = 1; costmodel/stack.py prices a stack's blocks at m, not
    yet a whole step)."""
    return (
        "grad_sync" in row and row["policy"] != "deepspeed" and int(row.get("micro_chunks", 1)) == 1
    )


def _dims(cfg: dict) -> tuple[int, int]:
    """(model dim, hidden dim) of a bench step header; results written before the flags were
    renamed (--dim, --hidden) carry the old keys."""
    return int(cfg.get("model_dim", cfg.get("dim"))), int(cfg.get("hidden_dim", cfg.get("hidden")))


def shape_of(cfg: dict) -> StepShape:
    M, H = _dims(cfg)
    return StepShape(
        batch=int(cfg["batch"]),
        seq_len=int(cfg["seq_len"]),
        model_dim=M,
        hidden=H,
        layers=int(cfg["layers"]),
        heads=int(cfg.get("heads", 4)),
        moe_every=int(cfg.get("moe_every", 2)),
        experts=int(cfg["experts"]),
        top_k=int(cfg["top_k"]),
        capacity_factor=float(cfg["f"]),
    )


def point(cfg: dict, row: dict, hw: Hardware) -> dict:
    """The row's measured and predicted step, ms, and the relative error."""
    pred = (
        predict_step(
            hw,
            shape_of(cfg),
            row["policy"],
            cfg["algorithm"],
            int(row["chunks"]),
            grad_sync=row["grad_sync"],
            grad_compress=row["grad_compress"],
            grad_algorithm=cfg.get("grad_algorithm", "flat")
            if row["grad_sync"] != "ddp"
            else "flat",
            bucket_bytes=float(cfg.get("bucket_mb", 1.0)) * 2**20,
        ).step_s
        * 1e3
    )
    return {
        "policy": row["policy"],
        "algorithm": cfg["algorithm"],
        "compressor": f"grad:{row['grad_sync']}/{row['grad_compress']}",
        "chunks": row["chunks"],
        "tokens": int(cfg["batch"]) * int(cfg["seq_len"]),
        "model_dim": _dims(cfg)[0],
        "hidden": _dims(cfg)[1],
        "measured_ms": round(row["median_ms"], 2),
        "predicted_ms": round(pred, 2),
        "error": round((pred - row["median_ms"]) / row["median_ms"], 4),
    }
