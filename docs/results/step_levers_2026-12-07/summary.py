"""The lever A/Bs of levers.sh, read back from raw/: per row, each variant's median ms in both
rounds (/ its bound ratio), and per variant the median over rows and rounds of its time over the
baseline's in the same round; then the phases of the traced step (trace_200mbit_2x1/).

    python docs/results/step_levers_2026-12-07/summary.py > docs/results/step_levers_2026-12-07/summary.txt
"""

import glob
import json
import os
import statistics

from schemoe.bench.tables import last_json

HERE = os.path.dirname(os.path.abspath(__file__))
# experiment: (file prefix, the baseline variant, the variants), as levers.sh names the files
EXPERIMENTS = [
    ("pin, 200 Mbit/s 2x1", "r200x1", "none", ["rank"]),
    ("pin, 200 Mbit/s 2x2", "r200x2", "none", ["rank", "node2"]),
    ("pin, 600 Mbit/s 2x1", "r600x1", "none", ["rank"]),
    ("pin the main thread only, 200 Mbit/s 2x1", "pm200x1", "none", ["main"]),
    ("pin the main thread only, 600 Mbit/s 2x1", "pm600x1", "none", ["main"]),
    ("tcp_slow_start_after_idle, 200 Mbit/s 2x1", "s200x1", "ss1", ["ss0"]),
    ("TCP buffers 4 MiB, 200 Mbit/s 2x1", "b200x1", "def", ["big"]),
]


def rows(path: str) -> dict[str, dict]:
    with open(path) as f:
        js = last_json(f.read())
    keys = ("policy", "chunks", "micro_chunks", "grad_sync", "grad_compress")
    return {" ".join(str(r[k]) for k in keys): r for r in js["results"]}


def ab(title: str, prefix: str, base: str, variants: list[str]) -> None:
    print(f"## {title}: median ms / bound ratio, rounds 1 and 2")
    runs = {
        (v, n): rows(f"{HERE}/raw/{prefix}_{v}_{n}.txt") for v in [base, *variants] for n in (1, 2)
    }
    for row in runs[(base, 1)]:
        cells = [f"{v}: " + " ".join(f"{runs[(v, n)][row]['median_ms']:.0f}/"
                                     f"{runs[(v, n)][row]['bound_ratio']:.2f}" for n in (1, 2))
                 for v in [base, *variants]]  # fmt: skip
        print(f"{row:34s} " + "   ".join(cells))
    for v in variants:
        r = [runs[(v, n)][row]["median_ms"] / runs[(base, n)][row]["median_ms"]
             for row in runs[(base, 1)] for n in (1, 2)]  # fmt: skip
        best = {n: min(x["median_ms"] for x in runs[(v, n)].values()) /
                min(x["median_ms"] for x in runs[(base, n)].values()) for n in (1, 2)}  # fmt: skip
        print(f"{v} / {base}: median {statistics.median(r):.3f} (range {min(r):.3f}-{max(r):.3f}); "
              f"best row {best[1]:.3f} / {best[2]:.3f}\n")  # fmt: skip


def micro() -> None:
    print("## m = 4 beside m = 2, 200 Mbit/s: median ms / bound ratio, rounds 1 and 2")
    for rpn in (1, 2):
        runs = {n: rows(f"{HERE}/raw/m4_200mbit_{rpn}_{n}.txt") for n in (1, 2)}
        for row in runs[1]:
            print(
                f"2x{rpn} {row:30s} "
                + " ".join(
                    f"{runs[n][row]['median_ms']:.0f}/{runs[n][row]['bound_ratio']:.2f}"
                    for n in (1, 2)
                )
            )
    print()


def phases() -> None:
    """When each rank's forward and backward tasks ran in the traced step, ms from its start."""
    path = glob.glob(f"{HERE}/trace_200mbit_2x1/*.json")[0]
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    print(f"## the traced step ({os.path.basename(path)}), ms from each rank's first task")
    for pid in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == pid]
        t0 = min(e["ts"] for e in mine)

        def span(cat: str, tid: str, mine=mine, t0=t0) -> str:
            s = [
                e for e in mine if e["cat"] == cat and (e["tid"] == "compute") == (tid == "compute")
            ]
            a, b = min(e["ts"] for e in s), max(e["ts"] + e["dur"] for e in s)
            return f"{(a - t0) / 1e3:6.1f}-{(b - t0) / 1e3:6.1f} ({len(s)} tasks)"

        print(f"rank {pid}: forward compute {span('forward', 'compute')}, transfers "
              f"{span('forward', 'net')}; backward compute {span('backward', 'compute')}, "
              f"transfers {span('backward', 'net')}")  # fmt: skip


if __name__ == "__main__":
    for exp in EXPERIMENTS:
        ab(*exp)
    micro()
    phases()
