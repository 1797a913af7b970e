"""Another lead for auto's step choice, checked offline and dropped: a safety margin. Among the plans
predicted within `delta` of the fastest, take the one with the fewest layer calls' all-to-all
rounds (r x m; then the fastest predicted; ties: the first row, as bench step's auto), so a plan
with more collectives must be predicted faster by more than the model's typical error. Every
committed grid with a profile is re-priced by the current model; delta is picked on the runs
before bf8e462 ("tune") and checked on the three runs after it ("test": _skew, _lead, _lead_run2).
Per delta: grids whose choice is within 5% of the best row, and the median choice / best.

    python docs/results/step_bound_2026-12-07_ceiling/margin.py > docs/results/step_bound_2026-12-07_ceiling/margin.txt
"""

import glob
import json
import os
import sys

from schemoe.costmodel.hardware import Hardware

sys.path.insert(0, "docs/results/step_bound_2026-12-07_overlap")
import reprice  # its grid reader and pricing loop (its main is guarded)

DELTAS = (0.0, 0.05, 0.08, 0.10, 0.12, 0.15, 0.20)
TEST = ("_skew", "_lead", "_lead_run2")

chosen: dict[tuple[str, float], list[float]] = {}
for path in sorted(glob.glob("docs/results/step_bound_2026-12-0*/step_*_2x?.txt")):
    if not os.path.exists(path[:-4] + ".profile.json"):
        continue
    cfg, rows = reprice.rows_of(path)
    with open(path[:-4] + ".profile.json") as f:
        hw = Hardware.from_json(next(iter(json.load(f).values())))
    priced = reprice.predictions(hw, cfg, rows)
    best = min(m for _, m, _ in priced)
    fastest = min(p for p, _, _ in priced)
    group = "test" if path.split("/")[-2].endswith(TEST) else "tune"
    for delta in DELTAS:
        near = [
            (int(r["chunks"]) * int(r["micro_chunks"]), p, i, m)
            for i, (r, (p, m, _)) in enumerate(zip(rows, priced))
            if p <= fastest * (1 + delta)
        ]
        chosen.setdefault((group, delta), []).append(min(near)[3] / best)
for group in ("tune", "test"):
    for delta in DELTAS:
        v = sorted(chosen[(group, delta)])
        print(
            f"{group} delta {delta:.2f}: within 5% in {sum(x <= 1.05 for x in v)} of {len(v)} grids, "
            f"median choice / best {v[len(v) // 2]:.3f}"
        )
