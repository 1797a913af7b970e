"""The step grids of this run and its run 2 re-priced with the profile's fitted `overlap` and with
overlap = 0 (everything else the same profile): each grid's median |error| of the simulated steps
and auto's choice (the fastest predicted plan) measured against the best row.

    python docs/results/step_bound_2026-12-07_overlap/reprice.py > .../reprice.txt
"""

import glob
import json
import sys
from dataclasses import replace

from schemoe.costmodel.hardware import Hardware
from schemoe.costmodel.plans import StepPlan, predict_plan
from schemoe.profile.steps import shape_of


def rows_of(path):
    cfg, rows, head = None, [], None
    for line in open(path):
        if line.startswith("# config:"):
            cfg = dict(kv.split("=") for kv in line[len("# config:") :].split())
        elif "median_ms" in line and line.split()[0] == "policy":
            head = line.split()
        elif head and line.strip() and line[0] not in "#{":
            v = line.split()
            if len(v) == len(head) and v[0] in ("sequential", "schemoe"):
                rows.append(dict(zip(head, v)))
    return cfg, rows


def predictions(hw, cfg, rows):
    """(predicted ms, measured ms, plan name) of each row, priced on `hw`."""
    shape, out = shape_of(cfg), []
    for r in rows:
        plan = StepPlan(
            r["policy"], int(r["chunks"]), int(r["micro_chunks"]), r["grad_sync"],
            r["grad_compress"],
        )  # fmt: skip
        pred = predict_plan(
            hw, shape, plan, algorithm=cfg["algorithm"], grad_algorithm=cfg["grad_algorithm"],
            bucket_bytes=float(cfg["bucket_mb"]) * 2**20,
        )  # fmt: skip
        out.append((pred.step_s * 1e3, float(r["median_ms"]), plan.name))
    return out


def priced(hw, cfg, rows):
    """(median |error|, auto's row / the best row): auto is the fastest predicted row, ties
    going to the first row as in bench step's auto (not to the faster measured twin)."""
    out = predictions(hw, cfg, rows)
    errors = sorted(abs(p / m - 1) for p, m, _ in out)
    best = min(m for _, m, _ in out)
    return errors[len(errors) // 2], min(out, key=lambda o: o[0])[1] / best


if __name__ == "__main__":
    here = sys.argv[1] if len(sys.argv) > 1 else "docs/results/step_bound_2026-12-07_overlap"
    for path in sorted(glob.glob(f"{here}*/*_2x?.txt")):
        cfg, rows = rows_of(path)
        hw = Hardware.from_json(next(iter(json.load(open(path[:-4] + ".profile.json")).values())))
        cells = []
        for name, rec in (("fitted", hw), ("overlap 0", replace(hw, overlap=0.0))):
            err, auto = priced(rec, cfg, rows)
            cells.append(f"{name}: median |error| {err:.1%}, auto / best {auto:.3f}")
        print(
            f"{path.split('/')[-2]}/{path.split('/')[-1]} (overlap {hw.overlap:.2f}): "
            + "; ".join(cells)
        )
