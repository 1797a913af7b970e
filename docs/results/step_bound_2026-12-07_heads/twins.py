"""Same plan, two rows: `sequential` and `schemoe` at r = 1 run the same task order (a one-chunk
region has one order), so in a `bench step` output each (m, grad sync, grad dtype) at r = 1 is
measured twice in the same run. Their difference is this box's run-to-run noise at that shape.

    python docs/results/step_bound_2026-12-07_heads/twins.py DIR [DIR ...] > twins.txt
"""

import glob
import json
import sys
from pathlib import Path

for folder in sys.argv[1:]:
    for path in sorted(glob.glob(f"{folder}/step_bound_*_2x?.txt")):
        js = [
            json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")
        ][-1]
        rows = {
            (r["policy"], r["chunks"], r["micro_chunks"], r["grad_sync"], r["grad_compress"]): r
            for r in js["results"]
        }
        diffs = []
        for (pol, r, m, sync, comp), row in rows.items():
            if pol == "sequential" and r == 1:
                a, b = row["median_ms"], rows[("schemoe", 1, m, sync, comp)]["median_ms"]
                diffs.append(abs(a - b) / min(a, b))
        diffs.sort()
        print(
            f"{path}: {len(diffs)} twin pairs, |difference| median {100 * diffs[len(diffs) // 2]:.1f}%"
            f", max {100 * diffs[-1]:.1f}%"
        )
