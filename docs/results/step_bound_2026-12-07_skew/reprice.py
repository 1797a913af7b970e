"""The step grids of this run (one run: its run 2 was stopped) re-priced with the profile as
fitted and with skew = 0 (everything else the same profile), and the grids of the last two runs
(step_bound_2026-12-07_overlap, _run2: profiles without skew, priced at the time with buckets
queued behind the all-to-alls) re-priced by the simulator of 99d4164 (buckets share the link; reprice.txt was made there):
each grid's median |error| of the simulated steps and auto's choice (the fastest predicted
plan) measured against the best row.

    python docs/results/step_bound_2026-12-07_skew/reprice.py > docs/results/step_bound_2026-12-07_skew/reprice.txt
"""

import glob
import json
import sys
from dataclasses import replace

from schemoe.costmodel.hardware import Hardware

sys.path.insert(0, "docs/results/step_bound_2026-12-07_overlap")
from reprice import predictions, rows_of  # noqa: E402  (its readers; its main is guarded)


def priced(hw, cfg, rows):
    out = predictions(hw, cfg, rows)
    errors = sorted(abs(p / m - 1) for p, m, _ in out)
    best = min(m for _, m, _ in out)
    chosen = min(out, key=lambda o: o[0])  # ties: the first row, as bench step's auto
    return errors[len(errors) // 2], chosen[1] / best, chosen[2]


def report(pattern, variants):
    within = {name: 0 for name, _ in variants}
    for path in sorted(glob.glob(pattern)):
        cfg, rows = rows_of(path)
        hw = Hardware.from_json(next(iter(json.load(open(path[:-4] + ".profile.json")).values())))
        cells = []
        for name, f in variants:
            err, auto, plan = priced(f(hw), cfg, rows)
            within[name] += auto <= 1.05
            cells.append(f"{name}: median |error| {err:.1%}, auto {plan} / best {auto:.3f}")
        where = "/".join(path.split("/")[-2:])
        print(f"{where} (skew {hw.skew * 1e3:.2f} ms, overlap {hw.overlap:.2f}):\n  " + "\n  ".join(cells))
    print("auto within 5% of the best row: " + ", ".join(f"{n} {k}" for n, k in within.items()))


if __name__ == "__main__":
    here = "docs/results/step_bound_2026-12-07_skew"
    report(f"{here}*/*_2x?.txt", [("fitted", lambda h: h), ("skew 0", lambda h: replace(h, skew=0.0))])
    print()
    report("docs/results/step_bound_2026-12-07_overlap*/*_2x?.txt", [("this simulator", lambda h: h)])
