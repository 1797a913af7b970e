"""The file side of checkpoints (schemoe.checkpoint): atomic writes, weights-only reads, and the
all-ranks agreement that a write succeeded.

A file is written to a temporary name, fsynced, renamed and its folder fsynced, so a reader never
sees half a file and the rename survives a crash; a file is read with
`torch.load(weights_only=True)`, so nothing in a checkpoint can run code.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["agree", "fsync_dir", "rank_world", "read", "write"]


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
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
