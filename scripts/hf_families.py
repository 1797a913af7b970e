"""Every converted Hugging Face MoE family against its unmodified model, one row per family, and
a JSON line at the end (docs/training.md's table comes from it; nothing is downloaded).

    PYTHONPATH=. python scripts/hf_families.py [--families mixtral,deepseek_v3] [--no-ranks]
        [--markdown]    # also the table of docs/training.md and README.md, before the JSON line

Per family, on the tiny random model of schemoe.integrations.hf_tiny (2 MoE layers, hidden 32):
- logits / grads: max|diff| of the logits and of every parameter gradient (experts in MoELayer's
  layout), converted vs unmodified, fp32, at the family's default initialisation ("default") and
  with every MoE-block weight drawn from N(0, 0.5) ("std0.5"); on one process, and on 2 gloo
  ranks at both ("2ranks_default", "2ranks_std0.5"; each rank its own batch, dense gradients
  summed as DDP would, experts sharded);
- roundtrip: max|diff| of the logits of the family's own class loaded (`from_pretrained`) from
  what `hf_export.save_pretrained` wrote for the converted model (std 0.5), against the converted
  model's; one process, and on 2 ranks (the experts gathered from both);
- greedy: 6 greedily generated tokens equal the unmodified model's (one process, std 0.5);
- train_2ranks: 5 AdamW steps (lr 1e-2, std 0.5, the same 2 x (2 x 6)-token batch each step) of
  the converted model expert-parallel on 2 ranks against the unmodified model on one process fed
  both ranks' batches: the largest relative difference of a step's loss (hf_tiny.train_steps);
- bf16: the share of (layer, token) pairs whose expert set differs between the family's own bf16
  router and MoELayer's fp32 one, on the same bf16 input of each layer (16 x 64 tokens, 2 layers).
Refused families are listed with the error replace_moe_blocks raises.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch
import transformers as tf

from schemoe.dist.launch import spawn
from schemoe.integrations.hf import replace_moe_blocks
from schemoe.integrations.hf_tiny import (
    REFUSED_TINY,
    TINY,
    bf16_routing_mismatch,
    compare,
    round_trip,
    same_greedy_tokens,
    tiny,
    train_steps,
)

INITS = (("default", None), ("std0.5", 0.5))  # the family's own initialisation; N(0, 0.5)


def _compared(family: str, rank: int = 0, world: int = 1) -> dict:
    """logits_<init> and grads_<init>: compare's max|diff| at each of INITS."""
    out = {}
    for name, std in INITS:
        r = compare(family, std, rank, world)
        out[f"logits_{name}"], out[f"grads_{name}"] = r["logits"], r["grads"]
    return out


def _two_ranks(rank: int, world: int, family: str, path: str) -> dict:
    tf.utils.logging.disable_progress_bar()  # from_pretrained's and save_pretrained's bars
    return _compared(family, rank, world) | {
        "train": train_steps(family, 0.5, rank, world),
        "roundtrip": round_trip(family, 0.5, path, rank, world),
    }


def measure(family: str, ranks: bool) -> dict:
    row: dict = {"family": family, "status": "converted", **_compared(family)}
    with tempfile.TemporaryDirectory() as d:
        row["roundtrip_1proc"] = round_trip(family, 0.5, d)
    if ranks:
        with tempfile.TemporaryDirectory() as d:
            both = spawn(_two_ranks, 2, family, d, timeout=300)
        row["roundtrip_2ranks"] = max(r["roundtrip"] for r in both)
        for key in (k for k in both[0] if k.startswith(("logits_", "grads_"))):
            kind, init = key.split("_", 1)  # logits_default -> logits_2ranks_default
            row[f"{kind}_2ranks_{init}"] = max(r[key] for r in both)
        one = train_steps(family, 0.5)
        row["train_losses"] = one
        row["train_2ranks"] = max(
            abs(a - b) / abs(a) for r in both for a, b in zip(one, r["train"])
        )
    row["greedy_same"] = same_greedy_tokens(family, 0.5)
    row["bf16_mismatch_default"] = bf16_routing_mismatch(family, None)
    row["bf16_mismatch_std0.5"] = bf16_routing_mismatch(family, 0.5)
    return row


def refused(family: str) -> dict:
    try:
        replace_moe_blocks(tiny(family))
    except (TypeError, ValueError) as e:
        return {"family": family, "status": "refused", "error": str(e)}
    return {"family": family, "status": "converted?!"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(TINY), help="comma-separated families")
    ap.add_argument("--no-ranks", action="store_true", help="skip the 2-rank measurement")
    ap.add_argument("--markdown", action="store_true", help="print the docs table too")
    args = ap.parse_args()
    rows = []
    tf.utils.logging.disable_progress_bar()  # from_pretrained's and save_pretrained's bars
    cols = ["logits_default", "grads_default", "logits_std0.5", "grads_std0.5", "roundtrip_1proc"]
    cols += [] if args.no_ranks else ["logits_2ranks_default", "grads_2ranks_default",
        "logits_2ranks_std0.5", "grads_2ranks_std0.5", "train_2ranks", "roundtrip_2ranks"]  # fmt: skip
    print(f"# transformers {tf.__version__}, torch {torch.__version__}; {' '.join(sys.argv)}")
    print(f"{'family':18s} " + " ".join(f"{c:>14s}" for c in cols) + "  greedy  bf16 (default/0.5)")
    for fam in args.families.split(","):
        if fam in REFUSED_TINY:
            rows.append(refused(fam))
            print(f"{fam:18s} refused: {rows[-1].get('error', '')}")
            continue
        row = measure(fam, not args.no_ranks)
        rows.append(row)
        figs = " ".join(f"{row[c]:14.1e}" for c in cols)
        bf = f"{row['bf16_mismatch_default']:.2%} / {row['bf16_mismatch_std0.5']:.2%}"
        print(f"{fam:18s} {figs}  {row['greedy_same']!s:6s}  {bf}", flush=True)
    if args.families == ",".join(TINY):
        rows += [refused(f) for f in REFUSED_TINY]
    if args.markdown:
        print(markdown(rows))
    print(json.dumps({"hf_families": rows}))


def _worst(row: dict, kind: str) -> float:
    return max(v for k, v in row.items() if k.startswith(kind))


def markdown(rows: list[dict]) -> str:
    """The docs table: one row per family, the worst figure of each kind over default init,
    std 0.5 and 2 ranks."""
    head = (
        "| family | status | logits max abs diff | grads max abs diff | greedy "
        "| 5 AdamW steps, 2 ranks: loss max rel diff | save_pretrained -> from_pretrained: logits "
        "max abs diff | bf16 expert sets differ (default / std 0.5) |"
    )
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "converted":
            out.append(f"| {r['family']} | refused | - | - | - | - | - | - |")
            continue
        bf = f"{r['bf16_mismatch_default']:.2%} / {r['bf16_mismatch_std0.5']:.2%}"
        same = "same tokens" if r["greedy_same"] else "DIFFER"
        logits, grads = _worst(r, "logits_"), _worst(r, "grads_")
        train = f"{r['train_2ranks']:.1e}" if "train_2ranks" in r else "-"
        back = _worst(r, "roundtrip_")
        out.append(
            f"| {r['family']} | converted | {logits:.1e} | {grads:.1e} | {same} | {train} "
            f"| {back:.1e} | {bf} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
