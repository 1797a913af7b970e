"""Peak memory per rank of `schemoe train` at m micro-chunks (loopback, gloo, 2 ranks).

    python scripts/stack_memory.py [--micro-chunks 1,4] [schemoe train flags...]

For each m, two fresh rank processes each import torch and schemoe, read their resident set
(`base_mb`, /proc/self/status VmRSS), run `schemoe.train.loop.train` (5 steps by default, no eval,
the given flags) and read their peak resident set (`peak_mb`, VmHWM). `train_mb` = peak - base:
what the run adds (corpus, model, optimizer state, activations and saved graphs, gradients,
gloo's buffers). Linux only. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from schemoe.dist.launch import spawn
from schemoe.train import loop as T
from schemoe.train.args import add_arguments


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {key} in /proc/self/status")


def _rank(rank: int, world: int, argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(argv)
    base = _status_mb("VmRSS")
    out = T.train(rank, world, a)
    peak = _status_mb("VmHWM")
    return {
        "rank": rank,
        "base_mb": round(base, 1),
        "peak_mb": round(peak, 1),
        "train_mb": round(peak - base, 1),
        "final_loss": out["final_loss"],
    }


def main(argv: list[str]) -> None:
    ms = [1, 4]
    if "--micro-chunks" in argv:
        i = argv.index("--micro-chunks")
        ms = [int(v) for v in argv[i + 1].split(",")]
        argv = argv[:i] + argv[i + 2 :]
    rows = []
    for m in ms:
        flags = ["--device", "cpu", "--steps", "5", "--eval-every", "0", *argv]
        for r in spawn(_rank, 2, [*flags, "--micro-chunks", str(m)], timeout=300):
            rows.append({"micro_chunks": m, **r})
            print(json.dumps(rows[-1]), flush=True)
    base = {r["rank"]: r for r in rows if r["micro_chunks"] == ms[0]}
    ratio = {
        f"m{r['micro_chunks']}/rank{r['rank']}": {
            k: round(r[k] / base[r["rank"]][k], 3) for k in ("peak_mb", "train_mb")
        }
        for r in rows
    }
    print(json.dumps({"argv": argv, "rows": rows, "ratio_to_first_m": ratio}))


if __name__ == "__main__":
    main(sys.argv[1:])
