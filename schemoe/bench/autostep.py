"""`bench step --auto-step`: the step's cost model on this run's stored profile, beside the
measured rows. Every row the model prices gets its `predicted_ms`; auto's one decision for the
step (`tuning.stepplan.decide` over the rows' plans: policy, r, m, gradient sync and compressor)
is printed with its reason, and its row's measured median against the fastest measured row's.

The profile is the one `schemoe profile` stored under this run's key (`--profile` PATH, default
the user cache), checked before any rank starts. Rows the model does not price: the DeepSpeed
peer and scheduled rows with a window > 1 (`predicted_ms` null, not candidates).
"""

from __future__ import annotations

import argparse

from ..costmodel import profiles
from ..costmodel.hardware import Hardware
from ..costmodel.plans import StepPlan
from ..profile.steps import shape_of
from ..tuning.auto import TUNED
from ..tuning.stepplan import decide

__all__ = ["add_arguments", "against_best", "annotate", "check_world", "plan_of", "validate"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auto-step", action="store_true",
                   help="price every row by the step's cost model on this run's stored profile "
                   "(`schemoe profile` first) and print auto's one choice for the step, its "
                   "reason and its measured time against the best row's")  # fmt: skip
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="profile store for --auto-step (default ~/.cache/schemoe/profiles.json)")  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    if not args.auto_step:
        return
    if tuned := [name for name in args.policies if name in TUNED]:
        raise ValueError(
            f"--auto-step with --policies {','.join(tuned)}: auto's step choice ranks plans of "
            "fixed policies; list those"
        )
    if args.grad_accum != 1:
        raise ValueError(
            f"--auto-step with --grad-accum {args.grad_accum}: the step's cost model prices one "
            "micro-batch per step; use --grad-accum 1"
        )


def check_world(args: argparse.Namespace, key: str) -> None:
    """--auto-step needs a profile stored under this run's key (ValueError naming both)."""
    if args.auto_step and profiles.load(key, args.profile) is None:
        where = args.profile or profiles.DEFAULT_PATH
        held = ", ".join(profiles.keys(args.profile)) or "none"
        raise ValueError(
            f"--auto-step: no profile {key!r} in --profile {where} (it holds: {held}); run "
            "`schemoe profile` on this topology first, or drop --auto-step"
        )


def plan_of(row: dict) -> StepPlan | None:
    """The plan of a bench step row, None for what the model does not price."""
    if row["policy"] in ("deepspeed", *TUNED) or row.get("grad_window", 1) != 1:
        return None
    return StepPlan(
        row["policy"], row["chunks"], row["micro_chunks"], row["grad_sync"], row["grad_compress"]
    )


def annotate(
    args: argparse.Namespace, config: dict, rows: list[dict], key: str
) -> tuple[dict, str]:
    """Each row's predicted_ms; (the decision's summary, its header line)."""
    hw: Hardware = profiles.load(key, args.profile)
    plans = {row["_n"]: p for row in rows if (p := plan_of(row)) is not None}
    choice = decide(
        hw, shape_of(config), list(plans.values()), algorithm=args.algorithm,
        grad_algorithm=args.grad_algorithm, bucket_bytes=args.bucket_mb * 2**20,
    )  # fmt: skip
    predicted = {p: ms for p, ms in choice.ranked}
    for row in rows:
        row["predicted_ms"] = predicted.get(plans.get(row["_n"]))
    measured = {row["_n"]: row["median_ms"] for row in rows if row["_n"] in plans}
    chosen = choice.plan.name
    vs = against_best(chosen, measured)
    summary = {
        "chosen": chosen,
        "plan": choice.plan.row(),
        "reason": choice.reason,
        "predicted_ms": choice.predicted_ms,
        **vs,
        "profile_key": key,
    }
    line = (
        f"# auto step (one plan for the step, profile {key!r}): {choice.reason}; measured "
        f"{vs['measured_ms']:.1f} ms, {vs['measured_ms'] / vs['best_ms']:.3f}x the best row "
        f"{vs['best']} ({vs['best_ms']:.1f} ms)"
    )
    return summary, line


def against_best(chosen: str, measured: dict[str, float]) -> dict:
    """The chosen plan's measured median against the fastest plan's (the first on a tie), by
    plan name: {"measured_ms", "best", "best_ms", "vs_best"}."""
    best = min(measured, key=measured.get)
    return {
        "measured_ms": measured[chosen],
        "best": best,
        "best_ms": measured[best],
        "vs_best": round(measured[chosen] / measured[best], 4),
    }
