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

import errno
import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..dist.devices import control_tensor

__all__ = [
    "agree",
    "checked",
    "collect_digests",
    "describe",
    "fsync_dir",
    "latest_line",
    "rank_world",
    "read",
    "rotate",
    "set_aside",
    "settle",
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
    reader never sees half a file, and the rename survives a crash. On any failure the temporary
    file is removed, and an OSError names `path` (a full disk is ENOSPC, not torch's "unexpected
    pos": tensors are serialised in memory first, so the OS reports the write that failed)."""
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(obj, str):
        data = obj.encode()
    else:
        buf = io.BytesIO()  # one more copy of the file in memory, for an exact errno
        torch.save(obj, buf)
        data = buf.getbuffer()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def describe(e: BaseException) -> str:
    """An error at save time in words: ENOSPC as "no space left on device writing PATH"."""
    if isinstance(e, OSError) and e.errno is not None:
        what = "no space left on device" if e.errno == errno.ENOSPC else e.strerror or str(e)
        return f"{what} writing {e.filename}" if e.filename else what
    return f"{type(e).__name__}: {e}"


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


def latest_line(root: Path) -> str:
    latest = root / "latest"
    if latest.is_file():
        return f"{latest} still names {latest.read_text().strip()}"
    return f"{root} holds no earlier checkpoint"


def settle(err: BaseException | None, root: Path, tmp: Path, step: int) -> None:
    """Whether every rank succeeded (collective); if not, rank 0 removes the partial folder and
    every rank raises one line naming the first failing rank and what failed (OSError; the
    failing rank re-raises anything else, a bug, with its traceback)."""
    if agree(err is None):
        return
    rank, world = rank_world()
    mine = describe(err) if err is not None else None
    said = [mine]
    if world > 1:
        said = [None] * world
        dist.all_gather_object(said, mine)
    who = next(r for r, m in enumerate(said) if m is not None)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    agree(True)  # the partial files are gone before anyone reports
    text = (
        f"checkpoint of step {step} not written: rank {who}: {said[who]}; removed the partial "
        f"{tmp}; {latest_line(root)}"
    )
    if err is not None and not isinstance(err, OSError):
        raise err
    raise OSError(text)


_STEP_DIR = re.compile(r"^step-(\d+)(-\d+)?$")


def set_aside(root: Path, first_bad: int) -> Path | None:
    """After a divergence: rename every complete checkpoint of step >= `first_bad` (the state the
    non-finite steps started from, and any later one) to diverged-step-N, out of `latest`'s and
    the rotation's reach, and point `latest` at the newest one left. Returns that folder, or None
    (then `latest` is removed). Rank 0 only; no collective."""
    left: list[tuple[int, Path]] = []
    for p in root.glob("step-*"):
        m = _STEP_DIR.match(p.name)
        if not m or not (p / "meta.json").exists():
            continue
        if int(m[1]) >= first_bad:
            dest = root / f"diverged-{p.name}"
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(p, dest)
        else:
            left.append((int(m[1]), p))
    fsync_dir(root)
    if not left:
        (root / "latest").unlink(missing_ok=True)
        return None
    newest = max(left, key=lambda sp: (sp[0], (sp[1] / "meta.json").stat().st_mtime_ns))[1]
    write(newest.name, root / "latest")
    return newest
