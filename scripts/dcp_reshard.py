"""DCP checkpoints of `schemoe train`: exact resume on the same ranks, and 4 -> 2 -> 1 -> 4.

    PYTHONPATH=. python scripts/dcp_reshard.py --out docs/results/dcp_2026-12-05

Every run is the `schemoe train` command (tiny model, dropless routing so that a token's output
does not depend on the rank count) with --log-file; the checks in between run on P ranks with
`schemoe.dist.launch.spawn`. It writes runs.jsonl (one line per check) and summary.txt to --out:

(a) resume on 4 ranks: 8 steps straight vs 4 steps, save, resume to 8: the step losses and every
    tensor of the step-8 checkpoints (weights, AdamW state), counted element by element.
(b) hops with training: 4 ranks to step 4, resume on 2 to step 8, on 1 to step 12, on 4 to 16.
    At each hop the checkpoint is loaded on the new rank count and saved again at once: the
    tensors must be bitwise the saved ones (moved, not recomputed); the held-out eval loss of
    the loaded model on P' ranks is compared with that of the saved model on its own P.
    Step losses after a hop to P' != P are listed, not compared: the global batch (batch x P)
    and the data streams change with P, so no run without resharding draws the same batches.
(c) round trip without training: the step-4 checkpoint loaded and saved on 2, 1, then 4 ranks,
    against the same checkpoint loaded and saved on 4 (both then lack RNG states): bitwise equal
    tensors, and 4 resumed steps from each give the same losses, bitwise.
(d) bad inputs to `schemoe train --resume` (a checkpoint of another model: --layers 3; a torn
    .distcp file; an edited meta.json) and to `checkpoint.load` (a 3-layer model): the one error
    line each, and every file of the checkpoint folder unchanged (SHA-256 before and after).

`--parts` runs some of them: (d) alone makes its checkpoint (8 steps on 4 ranks). Output:
OUT/runs-PARTS.jsonl, one line per check and a last line {"summary": ...}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from schemoe.checkpoint import store as checkpoint
from schemoe.checkpoint.meta import read_meta
from schemoe.dist.launch import spawn
from schemoe.train import loop as T
from schemoe.train.config import TrainConfig
from schemoe.train.model import evaluate
from schemoe.train.setup import setup

TINY = ["--device", "cpu", "--model-dim", "32", "--hidden-dim", "48", "--layers", "2",
        "--heads", "2", "--seq-len", "32", "--batch", "4", "--experts", "4",
        "--corpus-bytes", "200000", "--eval-seqs", "8", "--eval-every", "0",
        "--log-every", "1000", "--capacity-factor", "0"]  # fmt: skip


def train(nproc: int, log: Path, *args: str) -> dict[int, float]:
    """One `schemoe train` run; its step losses from the --log-file."""
    cmd = [sys.executable, "-m", "schemoe", "train", *TINY, "--nproc", str(nproc)]
    cmd += [*args, "--log-file", str(log)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in lines if "loss" in r}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    folder = checkpoint.resolve(folder)
    return checkpoint._tensors(folder, read_meta(folder))


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    """Elements that differ bitwise (every key of either; a missing key counts as a mismatch)."""
    if a.keys() != b.keys():
        return -1
    return sum(int((x.view(-1) != b[k].view(-1)).sum()) for k, x in a.items())


def _load_eval_save(rank: int, world: int, src: str, dst: str | None) -> float:
    """On `world` ranks: load `src` into the CLI's model, its held-out eval loss, and, with
    `dst`, save it again at once (its meta kept, so `--resume dst` works)."""
    run = setup(rank, world, TrainConfig.from_args(T.parse_args(TINY)))
    got = checkpoint.load(src, run.core, run.opt)
    loss = evaluate(run.core, run.windows, run.cfg.batch)
    if dst is not None:
        checkpoint.save(dst, run.core, run.opt, step=got.step, meta=got.meta)
    return loss


def load_eval_save(nproc: int, src: Path, dst: Path | None = None) -> float:
    return spawn(_load_eval_save, nproc, str(src), dst and str(dst), timeout=300)[0]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def exact_resume(work: Path) -> dict:
    straight = train(4, work / "a.jsonl", "--steps", "8", "--save", str(work / "a"))
    first = train(
        4, work / "b1.jsonl", "--steps", "8", "--stop-after", "4", "--save", str(work / "b")
    )
    rest = train(4, work / "b2.jsonl", "--resume", str(work / "b"))
    resumed = {**first, **rest}
    return {
        "check": "a: 4-rank resume at step 4 vs 8 straight steps",
        "losses_straight": [straight[s] for s in sorted(straight)],
        "losses_resumed": [resumed[s] for s in sorted(resumed)],
        "losses_bitwise_equal": straight == resumed,
        "differing_elements_step8": differing(tensors(work / "a"), tensors(work / "b")),
    }


def hops(work: Path) -> list[dict]:
    c, out, prev = work / "c", [], 4
    losses = train(4, work / "c0.jsonl", "--steps", "16", "--stop-after", "4", "--save", str(c))
    out.append(
        {"check": "b: start on 4 ranks", "steps": sorted(losses), "losses": list(losses.values())}
    )
    for i, (nproc, stop) in enumerate(((2, 8), (1, 12), (4, 16)), 1):
        src = work / f"hop{i}-from"  # kept aside: the rotation of `c` deletes old steps
        shutil.copytree(checkpoint.resolve(c), src)
        saved = load_eval_save(prev, src)
        moved = work / f"hop{i}-moved"
        loaded = load_eval_save(nproc, src, moved)
        losses = train(nproc, work / f"c{i}.jsonl", "--resume", str(c), "--stop-after", str(stop))
        out.append({
            "check": f"b: hop {prev} -> {nproc} ranks at step {read_meta(src)['step']}",
            "differing_elements_after_load_and_save": differing(tensors(src), tensors(moved)),
            "eval_saved_on_P": saved, "eval_loaded_on_P2": loaded, "eval_rel_diff": rel(loaded, saved),
            "steps": sorted(losses), "losses": list(losses.values()),
        })  # fmt: skip
        prev = nproc
    return out


def round_trip(work: Path) -> dict:
    start = work / "hop1-from"
    r = start
    for nproc in (2, 1, 4):
        load_eval_save(nproc, r, work / f"rt{nproc}")
        r = work / f"rt{nproc}"
    same = work / "same4"
    load_eval_save(4, start, same)
    args = ("--stop-after", "8")
    a = train(4, work / "rt.jsonl", "--resume", str(r), "--save", str(work / "rt-run"), *args)
    b = train(
        4, work / "same.jsonl", "--resume", str(same), "--save", str(work / "same-run"), *args
    )
    return {
        "check": "c: step-4 checkpoint through 2, 1, 4 ranks vs loaded and saved on 4",
        "differing_elements_vs_start": differing(tensors(r), tensors(start)),
        "differing_elements_vs_same4": differing(tensors(r), tensors(same)),
        "losses_round_trip": list(a.values()),
        "losses_same4": list(b.values()),
        "losses_bitwise_equal": a == b,
    }


def digests(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}  # fmt: skip


def _damage(d: Path, how: str) -> list[str]:
    """Damage checkpoint folder `d` as `how` says; the extra flags of the resume."""
    step = checkpoint.resolve(d)
    if how == "torn .distcp":
        f = step / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    if how == "edited meta.json":
        meta = json.loads((step / "meta.json").read_text())
        meta["step"] = 3
        (step / "meta.json").write_text(json.dumps(meta))
    return ["--layers", "3"] if how == "another model" else []


def bad_inputs(work: Path) -> list[dict]:
    good = work / "a"
    if not good.exists():
        train(4, work / "a.jsonl", "--steps", "8", "--save", str(good))
    out = []
    for how in ("another model", "torn .distcp", "edited meta.json"):
        d = work / f"bad-{how.replace(' ', '-')}"
        shutil.copytree(good, d)
        extra = _damage(d, how)
        before = digests(d)
        cmd = [sys.executable, "-m", "schemoe", "train", *TINY, "--nproc", "2", "--steps", "12"]
        cmd += ["--resume", str(d), *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        lines = r.stderr.strip().splitlines()
        out.append({
            "check": f"d: schemoe train --resume, {how}", "returncode": r.returncode,
            "stderr_lines": len(lines), "error": lines[-1].replace(str(work), "WORK"),
            "files_unchanged": digests(d) == before, "traceback": "Traceback" in r.stderr,
        })  # fmt: skip
    before = digests(good)
    try:
        run = setup(0, 1, TrainConfig.from_args(T.parse_args([*TINY, "--layers", "3"])))
        checkpoint.load(good, run.core, run.opt)
        error = "no error"
    except ValueError as e:
        error = f"ValueError: {e}".replace(str(work), "WORK")
    out.append({"check": "d: checkpoint.load into a 3-layer model", "error": error,
                "files_unchanged": digests(good) == before})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON lines")
    p.add_argument("--parts", default="abcd", help="which checks: any of a, b, c (needs b), d")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows += [exact_resume(work)] if "a" in a.parts else []
        rows += hops(work) if "b" in a.parts else []
        rows += [round_trip(work)] if "c" in a.parts and "b" in a.parts else []
        rows += bad_inputs(work) if "d" in a.parts else []
    rows.append({"summary": summarise(rows)})
    (a.out / f"runs-{a.parts}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps(rows[-1]["summary"]))


def summarise(rows: list[dict]) -> dict:
    """One verdict per part (a, b, c, d), and the largest eval difference after a hop."""
    out: dict = {}
    for r in rows:
        part = r["check"][0]
        if part == "a":
            out["a_resume_bitwise"] = (
                r["losses_bitwise_equal"] and not r["differing_elements_step8"]
            )
        elif part == "b" and "eval_rel_diff" in r:
            out["b_max_eval_rel_diff"] = max(out.get("b_max_eval_rel_diff", 0), r["eval_rel_diff"])
            moved = r["differing_elements_after_load_and_save"] == 0
            out["b_hops_tensors_bitwise"] = out.get("b_hops_tensors_bitwise", True) and moved
        elif part == "c":
            same = r["differing_elements_vs_start"] == 0 and r["losses_bitwise_equal"]
            out["c_round_trip_bitwise"] = same
        elif part == "d":
            out["d_files_unchanged"] = out.get("d_files_unchanged", True) and r["files_unchanged"]
    return out


if __name__ == "__main__":
    main()
