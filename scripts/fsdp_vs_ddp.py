"""`schemoe train --fsdp` (FSDP2 dense weights, experts expert-parallel) against the DDP run of the
same model and seed: the per-step losses and gradient norms side by side.

    python scripts/fsdp_vs_ddp.py [--nproc 4] [schemoe train flags...]
    python scripts/fsdp_vs_ddp.py --nproc 4 --ep-size 2 --steps 20       # EP 2 x expert-DP 2
    python scripts/fsdp_vs_ddp.py --nproc 4 --ep-size 4 --steps 20       # EP 4, FSDP over 4

Each run is `schemoe.train.loop.train` on --nproc fresh gloo CPU ranks (20 steps, no eval by
default, then the given flags); losses come from the Python API's summary, grad norms from rank
0's --log-file rows (JSONL), never from stdout. Prints one line per step, then one JSON object:
`same_to_5_significant_digits` (every loss equal when printed with 5 significant digits) and
`max_rel_diff` (the largest |loss_fsdp - loss_ddp| / |loss_ddp|).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from schemoe.dist.launch import spawn
from schemoe.train import loop as T


def _rank(rank: int, world: int, argv: list[str]) -> dict:
    return T.train(rank, world, T.parse_args(argv))


def _run(nproc: int, argv: list[str], log: Path) -> tuple[list[float], list[float]]:
    out = spawn(_rank, nproc, [*argv, "--log-file", str(log)], timeout=600, run_timeout=3600)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return out[0]["losses"], [r["grad_norm"] for r in rows]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--nproc", type=int, default=4)
    known, rest = p.parse_known_args(argv)
    flags = ["--device", "cpu", "--steps", "20", "--eval-seqs", "0", "--log-every", "1000", *rest]
    with tempfile.TemporaryDirectory() as tmp:
        ddp = _run(known.nproc, flags, Path(tmp) / "ddp.jsonl")
        fsdp = _run(known.nproc, [*flags, "--fsdp"], Path(tmp) / "fsdp.jsonl")
    pairs = list(zip(ddp[0], fsdp[0], strict=True))
    for step, ((a, b), ga, gb) in enumerate(zip(pairs, ddp[1], fsdp[1], strict=True), 1):
        print(
            f"step {step:3d}  loss ddp {a:.7f} fsdp {b:.7f}  grad norm ddp {ga:.5f} fsdp {gb:.5f}"
        )
    same = all(f"{a:.5g}" == f"{b:.5g}" for a, b in pairs)
    worst = max(abs(b - a) / abs(a) for a, b in pairs)
    print(json.dumps({"nproc": known.nproc, "argv": rest, "steps": len(pairs),
                      "same_to_5_significant_digits": same, "max_rel_diff": worst}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
