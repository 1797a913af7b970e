"""Reader of checkpoints written before DCP (meta.json format "schemoe-checkpoint/1"): rank 0's
dense.pt, each rank's experts-RRRRR.pt and rng-RRRRR.pt, every file a `torch.save` dict of
tensors under the same keys the DCP format uses. Nothing writes this format any more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .files import checked, read

__all__ = ["LEGACY_FORMAT", "file_names", "rng", "tensors"]

LEGACY_FORMAT = "schemoe-checkpoint/1"


def file_names(meta: dict[str, Any]) -> list[str]:
    """The tensor files a legacy checkpoint must hold (RNG files are optional)."""
    return ["dense.pt", *(f"experts-{r:05d}.pt" for r in range(int(meta["world_size"])))]


def tensors(folder: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every model/optimizer tensor (memory-mapped), each file checked against meta.json's
    digests first."""
    out: dict[str, torch.Tensor] = {}
    for name in file_names(meta):
        out.update(read(checked(folder, name, meta)))
    return out


def rng(folder: Path, meta: dict[str, Any], rank: int) -> dict[str, torch.Tensor] | None:
    """This rank's RNG states, or None when there are none."""
    name = f"rng-{rank:05d}.pt"
    return read(checked(folder, name, meta)) if (folder / name).exists() else None
