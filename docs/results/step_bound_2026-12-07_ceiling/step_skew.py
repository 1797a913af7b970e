"""A lead for auto's step choice, offline: every committed step-bound grid re-priced by the current
model on its own profile, (a) as profiled and (b) with `skew` (the per-all-to-all wait for the last
rank) fitted instead to two whole steps of the grid, sequential r = 4 and r = 1 (m = 1, ddp, fp32):
the skew at which the model's r4 - r1 difference equals the measured one (bisection in 0-50 ms).
Per grid: skew, auto's choice (the fastest predicted row) against the best row, and the median
|error|. Caveat: (b) prices the grid with two of its own 32 rows, so it is an upper estimate of
what a profile that timed those two steps itself would give. Profiles before bf8e462 have no
skew (0) and none of the runs before it were priced by this model when measured.

    python docs/results/step_bound_2026-12-07_ceiling/step_skew.py > docs/results/step_bound_2026-12-07_ceiling/step_skew.txt
"""

import glob
import json
import os
import sys
from dataclasses import replace

from schemoe.costmodel.hardware import Hardware

sys.path.insert(0, "docs/results/step_bound_2026-12-07_overlap")
import reprice  # its grid reader and pricing loop (its main is guarded)

SKEW_MAX = 0.05


def calibration_rows(rows: list[dict]) -> list[dict] | None:
    """sequential r = 1 and r = 4 at m = 1, ddp, fp32 (in that order), None if the grid lacks one."""
    cal = {r["chunks"]: r for r in rows if r["policy"] == "sequential" and r["micro_chunks"] == "1"
           and r["grad_sync"] == "ddp" and r["grad_compress"] == "none"}  # fmt: skip
    return [cal["1"], cal["4"]] if "1" in cal and "4" in cal else None


def step_skew(hw: Hardware, cfg: dict, cal: list[dict]) -> float:
    measured = float(cal[1]["median_ms"]) - float(cal[0]["median_ms"])

    def gap(skew: float) -> float:
        (p1, _, _), (p4, _, _) = reprice.predictions(replace(hw, skew=skew), cfg, cal)
        return p4 - p1

    lo, hi = 0.0, SKEW_MAX
    if gap(lo) >= measured or gap(hi) <= measured:
        return lo if gap(lo) >= measured else hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < measured else (lo, mid)
    return (lo + hi) / 2


held = {"profiled": 0, "step-fitted": 0}
grids = 0
for path in sorted(glob.glob("docs/results/step_bound_2026-12-0*/step_*_2x?.txt")):
    cfg, rows = reprice.rows_of(path)
    cal = calibration_rows(rows)
    if cal is None or not os.path.exists(path[:-4] + ".profile.json"):
        continue  # the M=512 grids (bf16 gradients only); the 12-05 runs (no profile)
    with open(path[:-4] + ".profile.json") as f:
        hw = Hardware.from_json(next(iter(json.load(f).values())))
    skew = step_skew(hw, cfg, cal)
    (e0, a0), (e1, a1) = (
        reprice.priced(hw, cfg, rows),
        reprice.priced(replace(hw, skew=skew), cfg, rows),
    )
    grids += 1
    held["profiled"] += a0 <= 1.05
    held["step-fitted"] += a1 <= 1.05
    run, grid = path.split("/")[-2].removeprefix("step_bound_"), path.split("/")[-1][11:-4]
    print(f"{run:24s} {grid:20s} skew {hw.skew * 1e3:5.2f} -> {skew * 1e3:5.2f} ms; auto / best "
          f"{a0:.3f} -> {a1:.3f}; median |error| {e0:.1%} -> {e1:.1%}")  # fmt: skip
print(
    f"auto within 5% of the best row: profiled skew {held['profiled']} of {grids} grids, "
    f"step-fitted skew {held['step-fitted']} of {grids}"
)
