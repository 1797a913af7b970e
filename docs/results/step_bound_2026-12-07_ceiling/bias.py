"""The step model's bias by plan family: the three runs priced with skew (step_bound_2026-12-07_skew,
_lead, _lead_run2) re-priced by the current model on their own profiles; per grid, the median
over runs and rows of predicted / measured for r = 1, 4 and m = 1, 2 (below 1: priced too low).

    python docs/results/step_bound_2026-12-07_ceiling/bias.py > docs/results/step_bound_2026-12-07_ceiling/bias.txt
"""

import glob
import json
import statistics
import sys

from schemoe.costmodel.hardware import Hardware

sys.path.insert(0, "docs/results/step_bound_2026-12-07_overlap")
import reprice  # its grid reader and pricing loop (its main is guarded)

RUNS = ("skew", "lead", "lead_run2")

ratios: dict[tuple[str, str], list[float]] = {}
for run in RUNS:
    for path in sorted(glob.glob(f"docs/results/step_bound_2026-12-07_{run}/*_2x?.txt")):
        cfg, rows = reprice.rows_of(path)
        with open(path[:-4] + ".profile.json") as f:
            hw = Hardware.from_json(next(iter(json.load(f).values())))
        grid = path.split("/")[-1][:-4].removeprefix("step_bound_").removeprefix("step_auto_")
        for row, (pred, meas, _) in zip(rows, reprice.predictions(hw, cfg, rows)):
            family = f"r{row['chunks']} m{row['micro_chunks']}"
            ratios.setdefault((grid, family), []).append(pred / meas)
print("predicted / measured, median over the rows of each family in runs " + ", ".join(RUNS))
for grid in sorted({g for g, _ in ratios}):
    cells = [
        f"{fam}: {statistics.median(ratios[(g, fam)]):.2f}"
        for g, fam in sorted(ratios)
        if g == grid
    ]
    print(f"{grid:20s} " + "  ".join(cells))
