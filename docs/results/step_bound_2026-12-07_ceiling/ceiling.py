"""How far this box's noise lets the #32 figures go: every committed pair of step-bound report
runs (the same figures run twice in one session), read back, nothing re-measured.

For each pair and grid (one shape, one topology):
- the oracle: the one plan whose worse ratio to its run's best row, over the two runs, is the
  smallest. A chooser that picks one plan per shape (as auto does from a profile) can do no
  better in both runs; "within 5% in both" counts the plans that would meet auto's criterion;
- auto's ratio to the best row in each run (as printed by bench step --auto-step).
Then, per grid, the best row's ratio to its measured bound in every run (the 1.10x criterion).

    python docs/results/step_bound_2026-12-07_ceiling/ceiling.py > docs/results/step_bound_2026-12-07_ceiling/ceiling.txt
"""

import glob
import os

from schemoe.bench.tables import last_json

RUNS = "docs/results/step_bound_2026-12-*"
PAIRS = [  # (run 1, run 2): the pairs each session reported, oldest first
    ("step_bound_2026-12-05_run1", "step_bound_2026-12-05_run2"),
    ("step_bound_2026-12-07_kept", "step_bound_2026-12-07_kept_run2"),
    ("step_bound_2026-12-07_heads", "step_bound_2026-12-07_heads_run2"),
    ("step_bound_2026-12-07_weights", "step_bound_2026-12-07_weights_run2"),
    ("step_bound_2026-12-07_recvfirst", "step_bound_2026-12-07_recvfirst_run2"),
    ("step_bound_2026-12-07_overlap", "step_bound_2026-12-07_overlap_run2"),
    ("step_bound_2026-12-07_lead", "step_bound_2026-12-07_lead_run2"),
]


def grids(run: str) -> dict[str, dict]:
    """grid file name -> its bench step JSON, for every grid of a run folder."""
    out = {}
    for path in sorted(glob.glob(f"docs/results/{run}/step_*_2x?.txt")):
        with open(path) as f:
            out[os.path.basename(path)[:-4]] = last_json(f.read())
    return out


def plans(js: dict) -> dict[tuple, float]:
    """plan -> median ms of the grid's own rows (the DeepSpeed peer left out)."""
    keys = ("policy", "chunks", "micro_chunks", "grad_sync", "grad_compress", "grad_window")
    return {tuple(r[k] for k in keys): r["median_ms"] for r in js["results"]
            if r["policy"] != "deepspeed"}  # fmt: skip


def name(plan: tuple) -> str:
    pol, r, m, sync, comp, _ = plan
    return f"{pol} r{r} m{m} {sync} {comp}"


def auto(js: dict) -> str:
    a = js.get("auto_step")
    return f"{a['vs_best']:.3f}" if a else "-"


def ceiling() -> None:
    print(
        "# auto's criterion (within 5% of the best row, in both runs): what one plan per shape can do"
    )
    met = total = 0
    for one, two in PAIRS:
        print(f"\n## {one} / {two}")
        g1, g2 = grids(one), grids(two)
        for grid in sorted(set(g1) & set(g2)):
            p1, p2 = plans(g1[grid]), plans(g2[grid])
            b1, b2 = min(p1.values()), min(p2.values())
            both = [p for p in p1 if p in p2]
            worse = {p: max(p1[p] / b1, p2[p] / b2) for p in both}
            oracle = min(both, key=worse.get)
            within = sum(worse[p] <= 1.05 for p in both)
            met, total = met + (within > 0), total + 1
            print(f"{grid:32s} oracle {name(oracle):34s} {p1[oracle] / b1:.3f} / "
                  f"{p2[oracle] / b2:.3f}; within 5% in both: {within:2d} of {len(both)}; "
                  f"auto {auto(g1[grid])} / {auto(g2[grid])}")  # fmt: skip
    print(f"\ngrids where some plan is within 5% of the best in both runs: {met} of {total}")
    print("\n# the best row's ratio to its measured bound, every run (runs in PAIRS order)")
    runs = [r for pair in PAIRS for r in pair]
    per_grid: dict[str, list[float]] = {}
    for run in runs:
        for grid, js in grids(run).items():
            if grid.startswith("step_bound_"):
                rows = [r for r in js["results"] if r["policy"] != "deepspeed"]
                best = min(rows, key=lambda r: r["median_ms"])
                per_grid.setdefault(grid, []).append(best["bound_ratio"])
    for grid, ratios in sorted(per_grid.items()):
        held = sum(x <= 1.10 for x in ratios)
        print(
            f"{grid:32s} {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} runs; "
            f"<= 1.10x in {held}: " + " ".join(f"{x:.2f}" for x in ratios)
        )


if __name__ == "__main__":
    ceiling()
