"""After / before ratios of ab.sh's outputs: raw medians, and each median over its own
invocation's lower bound (the `lower_bound_ms` column: the compute bound of one rank alone, x
ranks per core, or the network's bytes, measured in the same invocation), which takes out some
of the machine's drift between invocations.

    python docs/results/early_weights_2026-12-07/ab.py docs/results/early_weights_2026-12-07/ab600.txt

(also docs/results/recv_first_2026-12-07/ab.txt's: the same layout, m = 1 and 2)
"""

import re
import statistics
import sys
from pathlib import Path

runs: dict = {}
head = None
for line in Path(sys.argv[1]).read_text().splitlines():
    if m := re.match(r"## (\S+), round (\d+), (2x\d), (\w+)", line):
        head = m.groups()
    elif line.startswith("schemoe") and head:
        f = line.split()
        rate, rnd, topo, tree = head
        runs.setdefault((rate, topo, f[1], f[2]), {}).setdefault(rnd, {})[tree] = (
            float(f[6]),
            float(f[6]) / float(f[9]),
        )
for (rate, topo, r, m), rounds in runs.items():
    raw = [x["after"][0] / x["before"][0] for x in rounds.values() if len(x) == 2]
    norm = [x["after"][1] / x["before"][1] for x in rounds.values() if len(x) == 2]
    print(
        f"{rate} {topo} r={r} m={m}: after/before raw {' '.join(f'{v:.3f}' for v in raw)} "
        f"(median {statistics.median(raw):.3f}); over the invocation's bound "
        f"{' '.join(f'{v:.3f}' for v in norm)} (median {statistics.median(norm):.3f})"
    )
