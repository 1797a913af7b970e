"""`schemoe validate BENCH.txt[=PROFILE.json] ... [--profile FILE] [--png F]`: every row of saved
`schemoe bench layer` / `bench step` outputs predicted on the profile of the run's key, with the
error per row and one JSON line {"configurations", "median_abs_error", "worst_abs_error",
"points"}; for a `bench step` output also auto's step choice made again on this profile
(`--auto-step`'s rule: the plan of the smallest predicted step) and its measured time against
the best row's ("auto").

A bench output names its run's profile key ("profile_key" in its JSON line; older outputs: from
world_size, ranks_per_node and link_rate_gbps, intra unshaped). A profile file without a record
under that key is refused, naming both keys: a profile of other links predicts another run.
"""

from __future__ import annotations

import argparse
import json
import statistics

from .. import config as c
from ..bench.autostep import against_best, plan_of
from ..bench.tables import config_line
from ..costmodel import profiles
from ..costmodel.model import A2A_MODELS
from ..costmodel.prediction import predict_config
from ..dist.links import Links
from ..tuning.measure import UNCALIBRATED
from . import steps

__all__ = ["run"]


def _run_key(summary: dict, path: str) -> str:
    """The profile key of the run a bench output records ("profile_key"; outputs older than it:
    from its world size, ranks per node and link rate, intra unshaped)."""
    if "profile_key" in summary:
        return summary["profile_key"]
    world, rpn = summary.get("world_size"), summary.get("ranks_per_node")
    if not (world and rpn):
        raise ValueError(f"{path} records no profile key nor world_size / ranks_per_node")
    rate = summary.get("link_rate_gbps")
    return profiles.cache_key(world // rpn, rpn, Links(rate * 1e9 if rate else None))


def _bench_rows(path: str) -> tuple[dict, list[dict]]:
    """(config, measured rows) of a saved `schemoe bench layer` output: its '# config:' header
    line (plus the run's profile key as config["profile_key"]) and its last JSON line (rows
    with a modelled algorithm, auto's row left out)."""
    with open(path) as f:
        text = f.read()
    config = config_line(text)
    summary = next((json.loads(line) for line in reversed(text.splitlines()) if line.startswith("{")), None)  # fmt: skip
    if summary is None or not config:
        raise ValueError(f"{path} holds no `schemoe bench layer` header and JSON line")
    config["profile_key"] = _run_key(summary, path)

    # An "auto:<policy>" row repeats one of the fixed candidates; validate those.
    rows = summary["results"]
    if any("grad_sync" in row for row in rows):  # a `schemoe bench step` output
        return config, [row for row in rows if steps.is_step_row(row)]
    return config, [
        row
        for row in rows
        if row["algorithm"] in A2A_MODELS and not row["policy"].startswith("auto")
    ]


def run(args: argparse.Namespace) -> int:
    """Predict every row of saved bench outputs; print errors; optional predicted-vs-measured PNG."""

    points, choices = [], []
    for spec in args.runs:
        bench, _, prof = spec.partition("=")
        cfg, rows = _bench_rows(bench)
        prof, key = prof or args.profile, cfg["profile_key"]
        hw = profiles.load(key, prof)
        if hw is None:  # a profile of other links or another topology predicts another run
            raise ValueError(
                f"{bench} ran as {key!r}, but {prof or profiles.DEFAULT_PATH} holds "
                f"{profiles.keys(prof) or 'no profile'}: profile under the run's links "
                "(`schemoe profile` on the same testbed / --link-rate, --intra-rate)"
            )
        if UNCALIBRATED in hw.notes:
            print(f"# {key}: a quick profile ({hw.notes}); `schemoe profile` fits a full one")
        step_points = []  # (the row's plan or None, its point) of a bench step output
        for row in rows:
            if steps.is_step_row(row):
                step_points.append((plan_of(row), steps.point(cfg, row, hw)))
                points.append(step_points[-1][1])
                continue
            fwd, _, bwd = row["compressor"].partition("/")
            M, H = steps.dims(cfg)
            moe = c.MoEConfig(
                gate=c.GateConfig(
                    num_experts=int(cfg["experts"]),
                    top_k=int(cfg["top_k"]),
                    capacity_factor=float(cfg["f"]),
                ),
                experts=c.ExpertConfig(model_dim=M, hidden_dim=H),
                schedule=c.ScheduleConfig(policy=row["policy"], chunks=int(row["chunks"])),
                collective=c.CollectiveConfig(algorithm=row["algorithm"]),
                compression=c.CompressionConfig(forward=fwd, backward=bwd or fwd),
            )
            pred = predict_config(moe, int(cfg["tokens"]), hw).step_s * 1e3
            err = (pred - row["median_ms"]) / row["median_ms"]
            points.append(
                {
                    **{k: row[k] for k in ("policy", "algorithm", "compressor", "chunks")},
                    "tokens": int(cfg["tokens"]),
                    "model_dim": M,
                    "hidden": H,
                    "measured_ms": round(row["median_ms"], 2),
                    "predicted_ms": round(pred, 2),
                    "error": round(err, 4),
                }
            )
        if choice := _auto(step_points):
            choices.append({"run": bench, **choice})
    errs = sorted(abs(p["error"]) for p in points)
    if not errs:
        raise ValueError("no rows with a modelled algorithm in the given bench outputs")
    for p in points:
        micro = f"m={p['micro_chunks']} " if p.get("micro_chunks", 1) > 1 else ""
        print(
            f"{p['policy']:>10} {p['algorithm']:>6} {p['compressor']:>5} r={p['chunks']} {micro}"
            f"T={p['tokens']} D={p['model_dim']} H={p['hidden']}: measured "
            f"{p['measured_ms']:8.1f} ms, predicted {p['predicted_ms']:8.1f} ms "
            f"({p['error'] * 100:+.1f}%)"
        )
    for a in choices:
        print(
            f"# auto step on this profile ({a['run']}): {a['chosen']}, measured "
            f"{a['measured_ms']:.1f} ms, {a['vs_best']:.3f}x the best row {a['best']} "
            f"({a['best_ms']:.1f} ms)"
        )
    med, worst = statistics.median(errs), errs[-1]
    summary = {
        "configurations": len(points),
        "median_abs_error": round(med, 4),
        "worst_abs_error": round(worst, 4),
        "points": points,
    }
    if choices:
        summary["auto"] = choices
    if args.png:
        _scatter(points, args.png, f"median |error| {med * 100:.1f}%, worst {worst * 100:.1f}%")
        print(f"wrote {args.png}")
    print(json.dumps(summary))
    return 0


def _auto(step_points: list) -> dict | None:
    """`bench step --auto-step`'s decision re-made on this profile: the plan of the smallest
    predicted step among the rows the model prices (`autostep.plan_of`), its measured median
    against the fastest such row's. None for a bench layer output."""
    cands = [(plan, p) for plan, p in step_points if plan is not None]
    if not cands:
        return None
    chosen, p = min(cands, key=lambda c: c[1]["predicted_ms"])
    measured = {plan.name: point["measured_ms"] for plan, point in cands}
    return {
        "chosen": chosen.name,
        "predicted_ms": p["predicted_ms"],
        **against_best(chosen.name, measured),
    }


def _scatter(points: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for pol in sorted({p["policy"] for p in points}):
        ps = [p for p in points if p["policy"] == pol]
        ax.scatter([p["measured_ms"] for p in ps], [p["predicted_ms"] for p in ps], s=14, label=pol)
    lo = min(min(p["measured_ms"], p["predicted_ms"]) for p in points) * 0.9
    hi = max(max(p["measured_ms"], p["predicted_ms"]) for p in points) * 1.1
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between(
        [lo, hi],
        [lo * 0.85, hi * 0.85],
        [lo * 1.15, hi * 1.15],
        color="gray",
        alpha=0.15,
        label="±15%",
    )
    ax.set(
        xlim=(lo, hi),
        ylim=(lo, hi),
        xlabel="measured step (ms)",
        ylabel="simulated step (ms)",
        title=title,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
