"""The file side of checkpoints (schemoe.checkpoint.store): atomic writes, weights-only reads, checksums,
and the all-ranks agreement that a write succeeded.

A file is written to a temporary name, fsynced, renamed and its folder fsynced, so a reader never
sees half a file and the rename survives a crash; a file is read with
`torch.load(weights_only=True)`, so nothing in a checkpoint can run code. Every rank records the
SHA-256 of each file it wrote (digests-RRRRR.json), rank 0 merges them into meta.json ("files"),
and a load checks each file it opens against it: a flipped byte or a missing shard is an error
naming the file, not a silently different model. The check reads each file once in full
(SHA-256 runs at roughly 0.5-2 GB/s per core).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..dist.devices import control_tensor

__all__ = [
    "agree",
    "checked",
    "collect_digests",
    "fsync_dir",
    "rank_world",
    "read",
    "rotate",
    "sha256",
    "write",
    "write_digests",
]


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def write(obj: dict[str, torch.Tensor] | str, path: Path) -> None:
    """Tensors (torch.save) or text to a temporary name, fsync, rename, fsync the folder: a
    reader never sees half a file, and the rename survives a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if isinstance(obj, str):
            f.write(obj.encode())
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint file's tensors, memory-mapped; ValueError for anything that is not."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # UnpicklingError for anything that is not plain tensors
        raise ValueError(
            f"{path} is not a loadable checkpoint file (tensors only, weights_only=True): {e}"
        ) from e


def agree(ok: bool) -> bool:
    """Whether every rank succeeded (a collective: also a barrier)."""
    _, world = rank_world()
    if world == 1:
        return ok
    flag = control_tensor([int(ok)], dtype=torch.int64)  # on the backend's device
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_digests(folder: Path, names: list[str], rank: int) -> None:
    """This rank's part of the manifest: the SHA-256 of each file it wrote into `folder`."""
    write(json.dumps({n: sha256(folder / n) for n in names}), folder / f"digests-{rank:05d}.json")


def collect_digests(folder: Path) -> dict[str, str]:
    """Merge (and remove) every rank's digests-*.json: the manifest rank 0 puts in meta.json."""
    out: dict[str, str] = {}
    for part in sorted(folder.glob("digests-*.json")):
        out.update(json.loads(part.read_text()))
        part.unlink()
    return dict(sorted(out.items()))


def checked(folder: Path, name: str, meta: dict) -> Path:
    """`folder / name`, after checking that it exists and, when meta.json lists digests
    ("files"; checkpoints written before them have none), that its SHA-256 matches. Raises
    ValueError naming the file. Reads the whole file once."""
    path = folder / name
    if not path.is_file():
        raise ValueError(
            f"checkpoint {folder} is missing {name} (written with {meta.get('world_size')} "
            "ranks, it needs every rank's file): copy it back or use another checkpoint"
        )
    want = meta.get("files", {}).get(name)
    if want is not None and (got := sha256(path)) != want:
        raise ValueError(
            f"checkpoint file {path} is corrupt: its SHA-256 is {got[:16]}..., meta.json "
            f"records {want[:16]}...; use another checkpoint"
        )
    return path


def rotate(root: Path, keep: int) -> None:
    """Delete all but the `keep` newest complete checkpoints, except the newest whose tensors
    are all finite: a diverged run never rotates away its last good state."""
    done = [p for p in root.glob("step-*") if p.suffix != ".tmp" and (p / "meta.json").exists()]
    done.sort(key=lambda p: (p / "meta.json").stat().st_mtime_ns)  # write order
    good = [p for p in done if json.loads((p / "meta.json").read_text()).get("finite", True)]
    for old in done[: max(0, len(done) - keep)]:
        if not good or old != good[-1]:
            shutil.rmtree(old, ignore_errors=True)
