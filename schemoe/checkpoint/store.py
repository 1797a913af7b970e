"""Checkpoints that reshard: save on P ranks, resume on any P' that divides the experts.

Layout of `DIR` (one folder per saved step; `latest` names the newest complete one):

    DIR/latest                 text: "step-00000040"
    DIR/step-00000040/
      meta.json                format "schemoe-dcp/1", step, world size, run arguments, loss
                               history, the SHA-256 of every other file (written last)
      .metadata                DCP's index of every key: shape, dtype, file and offset
      __3_0.distcp             rank 3's part, written by torch.distributed.checkpoint (DCP)

The tensors are one flat DCP state dict per rank under these keys:

    model/<name>               a dense tensor (every rank holds it; DCP writes it once)
    model/<name>[e]            global expert e of stacked weights, e.g. ...experts.w1_EMH[5]
    model/<...experts.experts.e.rest>   ModuleExperts: the one-rank name of expert e
    optim/<k>/<same key>       AdamW exp_avg, exp_avg_sq, step of that tensor
    rng/<rank>/<name>          that rank's torch and data-generator RNG states

Dense tensors go in under the same keys from every rank rather than from rank 0 alone: DCP
deduplicates replicated keys and spreads the writes over the ranks by size, and the same call
then also covers experts replicated over data-parallel groups (ep x dp). Keys name global
experts, so loading is the same for any P': each rank reads, with DCP and no collective, the
dense keys and the rows of its own experts (`MoELayer.expert_slice()`), and its optimizer state
likewise. RNG states are restored only when P' = P (a different P draws different batches
anyway). Tensor records are read with `torch.load(weights_only=True)` and DCP's .metadata with an
allow-listed unpickler (dcp_io.py): nothing in a checkpoint can run code. Writes are atomic: all
ranks write into `step-N.tmp/`, rank 0 adds meta.json, renames the folder and only then replaces
`latest` (write + fsync + os.replace), so a run killed mid-write leaves the previous checkpoint as
it was. Multi-node runs need `DIR` on a shared filesystem. Checkpoints of the format before DCP
("schemoe-checkpoint/1": dense.pt, experts-RRRRR.pt) still load (legacy.py).

`export(src, out)` merges a checkpoint into one file of unsharded tensors (the state_dict of the
one-rank model) for inference; `load` accepts that file too; `register` adds `schemoe export`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..cliargs import guard
from ..dist.failures import NonFiniteError
from . import dcp_io, legacy
from .dcp_io import METADATA, data_file
from .files import agree as _agree
from .files import checked, collect_digests, latest_line, rotate, settle, write_digests
from .files import fsync_dir as _fsync_dir
from .files import rank_world as _rank_world
from .files import read as _read
from .files import write as _write
from .meta import FORMAT, UNVERIFIED_FLAG, meta_digest, read_meta, resolve, verify
from .restore import STACKED, load_model, load_optimizer, needed
from .shards import bare as _bare
from .shards import finite as _finite
from .shards import rank_state as _rank_state

__all__ = ["Loaded", "export", "export_model", "load", "load_export", "register", "resolve", "save",
           "verify"]  # fmt: skip

EXPORT_FORMAT = "schemoe-export/1"


def _read_keys(
    folder: Path, meta: dict[str, Any], pick: Callable[[list[str]], list[str]]
) -> dict[str, torch.Tensor]:
    """The tensors of the keys `pick` chooses from a checkpoint's keys, the files they lie in
    checked against meta.json's digests first (.metadata before it is parsed). A legacy
    checkpoint's files are all read (memory-mapped)."""
    if meta["format"] == legacy.LEGACY_FORMAT:
        tensors = legacy.tensors(folder, meta)
        return {k: tensors[k] for k in pick(list(tensors))}
    md = dcp_io.read_metadata(checked(folder, METADATA, meta).parent)
    want = {k: md.state_dict_metadata[k] for k in pick(list(md.state_dict_metadata))}
    for name in sorted({s.relative_path for i, s in md.storage_data.items() if i.fqn in want}):
        checked(folder, name, meta)
    return dcp_io.fetch(folder, want)


def _tensors(folder: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every model/optimizer tensor of a checkpoint folder, digests checked first."""
    return _read_keys(folder, meta, lambda keys: [k for k in keys if not k.startswith("rng/")])


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    rng: dict[str, torch.Tensor] | None = None,
    meta: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write a checkpoint of `step` into `directory` (collective: every rank calls it).

    `latest` moves only after a complete, finite save: every rank's files written and their
    digests in meta.json, every model and optimizer tensor finite on every rank.

    Args:
        directory: the checkpoint folder (created if needed; shared by all ranks).
        model: the model (a DDP wrapper is unwrapped); optimizer: its optimizer, or None.
        step: optimizer steps taken so far.
        rng: this rank's RNG states, e.g. {"torch": torch.get_rng_state(), "data": g.get_state()}.
        meta: JSON-serialisable extras (run arguments, loss history), stored in meta.json.
        keep: complete checkpoints to keep (older ones are deleted after the new one is live).

    Returns the folder of the new checkpoint.

    Raises:
        NonFiniteError: some rank's state holds NaN/Inf; nothing is written, `latest` unchanged.
        OSError: some rank could not write (a full disk: "no space left on device writing
            PATH"); every rank raises the same line naming that rank, the partial folder is
            removed, `latest` unchanged.
    """
    model, (rank, world) = _bare(model), _rank_world()
    root = Path(directory)
    name = f"step-{step:08d}"
    tmp = root / f"{name}.tmp"
    state = _rank_state(model, optimizer, rng, rank)
    if not _agree(_finite(state)):  # HOST SYNC per tensor
        raise NonFiniteError(
            f"checkpoint of step {step} not written: the model or optimizer state holds NaN/Inf "
            f"(the run diverged); {latest_line(root)}"
        )
    err: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left over by an interrupted write
            tmp.mkdir()
        except OSError as e:
            err = e
    settle(err, root, tmp, step)
    # collective; this rank's own failure, if any. Settled before the digests: when another
    # rank's write failed, DCP wrote no .metadata, and rank 0 must report that rank's error
    # (a full disk), not its own missing file.
    settle(dcp_io.write(state, tmp), root, tmp, step)
    try:
        mine = sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp"))
        write_digests(tmp, [*mine, *([METADATA] * (rank == 0))], rank)
    except BaseException as e:  # noqa: BLE001 (every rank raises it in settle)
        err = e
    settle(err, root, tmp, step)
    if rank == 0:
        try:
            _publish(root, tmp, name, step, world, meta)
        except BaseException as e:  # noqa: BLE001 (every rank raises it in _settle)
            err = e
    settle(err, root, tmp, step)
    if rank == 0:
        rotate(root, keep)
    _agree(True)
    return root / (root / "latest").read_text().strip()


def _publish(root: Path, tmp: Path, name: str, step: int, world: int, extra) -> Path:
    """Rank 0, once every rank wrote its files: meta.json (digests of every file and of
    itself), the folder renamed into place, then `latest` (removing the folder if `latest`
    cannot be written, so no complete folder is left that `latest` does not name)."""
    digests = collect_digests(tmp)
    want = {METADATA, *(data_file(r) for r in range(world))}
    assert want <= set(digests), f"{tmp}: no digest for {sorted(want - set(digests))}"
    # the caller's extras (e.g. a loaded checkpoint's meta) never override what this save is
    info = {k: v for k, v in (extra or {}).items() if k not in ("files", "meta_sha256")}
    info.update(format=FORMAT, step=step, world_size=world, finite=True)
    info["files"] = digests
    info["meta_sha256"] = meta_digest(info)
    _write(json.dumps(info, indent=1), tmp / "meta.json")
    final, n = root / name, 1
    while final.exists():  # never rename onto a live checkpoint
        final, n = root / f"{name}-{n}", n + 1
    os.replace(tmp, final)
    _fsync_dir(root)
    try:
        _write(final.name, root / "latest")
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    return final


@dataclass(frozen=True)
class Loaded:
    """What `load` restored: the step, meta.json's contents, and this rank's RNG states (None
    when the checkpoint was written on a different number of ranks, or is an export)."""

    step: int
    meta: dict[str, Any]
    rng: dict[str, torch.Tensor] | None


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    allow_unverified: bool = False,
) -> Loaded:
    """Load a checkpoint folder (its `latest`, or one step-N folder) or an exported file into
    `model` and `optimizer`, resharding experts to this rank's slice. Every rank calls it; no
    collective. Raises ValueError when the checkpoint does not fit the model, when a file or
    meta.json fails its digest, and for a checkpoint without digests (the format before them)
    unless `allow_unverified`; such a checkpoint must then hold finite tensors."""
    model, (rank, world) = _bare(model), _rank_world()
    path = Path(path)
    if path.is_file():
        state, meta = load_export(path)
        tensors = {f"model/{k}": v for k, v in state.items()}
        step, rng = int(meta.get("step", 0)), None
    else:
        folder = resolve(path)
        meta = read_meta(folder, allow_unverified=allow_unverified)
        mine = f"rng/{rank}/" if meta["world_size"] == world else None
        tensors = _read_keys(
            folder,
            meta,
            lambda keys: [
                *needed(model, optimizer is not None, keys),
                *(k for k in keys if mine and k.startswith(mine)),
            ],
        )
        step = meta["step"]
        if "files" not in meta and not _finite(tensors):
            raise ValueError(
                f"{folder} (unverified: no digests, loaded with {UNVERIFIED_FLAG}) holds NaN/Inf "
                "tensors: its files are corrupt; use another checkpoint"
            )
        if meta["format"] == legacy.LEGACY_FORMAT:
            rng = legacy.rng(folder, meta, rank) if mine else None
        else:
            keys = [k for k in tensors if mine and k.startswith(mine)]
            rng = {k.removeprefix(mine): tensors.pop(k) for k in keys} or None
    load_model(model, tensors, path)
    if optimizer is not None:
        load_optimizer(model, optimizer, tensors)
    return Loaded(step, meta, rng)


def export(
    src: str | os.PathLike, out: str | os.PathLike, *, allow_unverified: bool = False
) -> Path:
    """Merge checkpoint `src` into one file `out` of unsharded tensors (no collective);
    `allow_unverified` as for `load`.

    The file is {"format", "meta" (JSON text), "state"}: `state` is the state_dict of the
    one-rank model, so `model.load_state_dict(load_export(out)[0])` restores it.
    """
    folder = resolve(Path(src))
    meta = read_meta(folder, allow_unverified=allow_unverified)
    tensors = _tensors(folder, meta)
    state: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for key, v in tensors.items():
        if not key.startswith("model/"):
            continue
        key = key[len("model/") :]
        m = STACKED.match(key)
        if m:
            stacked[m[1]][int(m[2])] = v
        else:
            state[key] = v.clone()
    for name, rows in stacked.items():
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"{folder}: experts of {name} are incomplete: have {sorted(rows)}")
        state[name] = torch.stack([rows[e] for e in range(len(rows))])
    out = Path(out)
    _write({"format": EXPORT_FORMAT, "meta": json.dumps(meta), "state": state}, out)
    return out


def export_model(
    model: nn.Module, out: str | os.PathLike, *, step: int = 0, meta: dict[str, Any] | None = None
) -> Path | None:
    """Export a live (possibly expert-parallel) model to one file (collective: each rank writes
    its experts next to `out`, rank 0 merges them). Returns the path on rank 0, else None."""
    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    save(parts, model, None, step=step, meta=meta, keep=1)
    rank, _ = _rank_world()
    path = export(parts, out) if rank == 0 else None
    _agree(True)
    if rank == 0:
        shutil.rmtree(parts, ignore_errors=True)
    return path


def load_export(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict of the one-rank model, meta) of a file written by `export`."""
    blob = _read(Path(path))
    if not isinstance(blob, dict) or blob.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path} is not a schemoe export ({EXPORT_FORMAT})")
    return blob["state"], json.loads(blob["meta"])


def register(sub) -> None:
    """`schemoe export CHECKPOINT OUT`."""
    p = sub.add_parser("export", help="merge a (sharded) checkpoint into one inference file")
    p.add_argument("checkpoint", help="checkpoint folder (its latest) or one step-N folder")
    p.add_argument("out", help="output file")
    p.add_argument(UNVERIFIED_FLAG, action="store_true",
                   help="read a checkpoint written before digests (its files cannot be checked)")  # fmt: skip
    p.set_defaults(func=guard("schemoe export", _export_command))


def _export_command(a) -> int:
    try:
        resolve(a.checkpoint)  # both arguments checked, named as --help names them, first
    except ValueError as e:
        raise ValueError(f"CHECKPOINT {e}") from None
    if Path(a.out).is_dir() or not Path(a.out).parent.is_dir():
        raise ValueError(f"OUT {a.out!r} must name a file in a folder that exists")
    print(export(a.checkpoint, a.out, allow_unverified=a.allow_unverified_checkpoint))
    return 0
