"""`schemoe validate` on saved `schemoe bench step` outputs: each measured step row against
`costmodel.step.predict_step` on a profile."""

from __future__ import annotations

from ..costmodel.hardware import Hardware
from ..costmodel.plans import StepPlan, predict_plan
from ..costmodel.step import StepShape

__all__ = ["dims", "is_step_row", "point"]


def is_step_row(row: dict) -> bool:
    """A row of `schemoe bench step` (not its DeepSpeed peer, which the model does not price)."""
    return "grad_sync" in row and row["policy"] != "deepspeed"


def dims(cfg: dict) -> tuple[int, int]:
    """(model dim, hidden dim) of a bench layer or step header; results written before the flags
    were renamed (--dim, --hidden) carry the old keys."""
    return int(cfg.get("model_dim", cfg.get("dim"))), int(cfg.get("hidden_dim", cfg.get("hidden")))


def shape_of(cfg: dict) -> StepShape:
    M, H = dims(cfg)
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
    """The row's measured and predicted step, ms, and the relative error (`costmodel.plans`:
    micro-chunk rows by the stack model)."""
    m = int(row.get("micro_chunks", 1))
    plan = StepPlan(row["policy"], int(row["chunks"]), m, row["grad_sync"], row["grad_compress"])
    pred = predict_plan(
        hw, shape_of(cfg), plan, algorithm=cfg["algorithm"],
        grad_algorithm=cfg.get("grad_algorithm", "flat"),
        bucket_bytes=float(cfg.get("bucket_mb", 1.0)) * 2**20,
    )  # fmt: skip
    pred = pred.step_s * 1e3
    return {
        "policy": row["policy"],
        "algorithm": cfg["algorithm"],
        "compressor": f"grad:{row['grad_sync']}/{row['grad_compress']}",
        "chunks": row["chunks"],
        "micro_chunks": m,
        "tokens": int(cfg["batch"]) * int(cfg["seq_len"]),
        "model_dim": dims(cfg)[0],
        "hidden": dims(cfg)[1],
        "measured_ms": round(row["median_ms"], 2),
        "predicted_ms": round(pred, 2),
        "error": round((pred - row["median_ms"]) / row["median_ms"], 4),
    }
