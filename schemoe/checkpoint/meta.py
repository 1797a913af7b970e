"""A checkpoint's meta.json, read and checked before anything else of the checkpoint is trusted,
and the whole-checkpoint check a launcher runs before any rank starts.

meta.json carries the SHA-256 of every other file ("files") and of its own content
("meta_sha256": the SHA-256 of the canonical JSON of every other key), so an edited step, loss
history or argument is refused like a flipped byte in a tensor file. Checkpoints written before
the digests existed have no "files": they load only when the caller says so
(`allow_unverified=True`, `--allow-unverified-checkpoint`), and are then checked for NaN/Inf.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .dcp_io import METADATA, read_metadata
from .files import checked
from .legacy import LEGACY_FORMAT, file_names

__all__ = ["FORMAT", "UNVERIFIED_FLAG", "meta_digest", "read_meta", "resolve", "verify"]

FORMAT = "schemoe-dcp/1"
UNVERIFIED_FLAG = "--allow-unverified-checkpoint"


def meta_digest(meta: dict[str, Any]) -> str:
    """The SHA-256 of meta.json's content without its own digest (canonical JSON: sorted keys)."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder `path` names: itself (a step-N folder) or the one its `latest`
    names. Raises ValueError saying what is missing."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    if (path / "latest").exists():
        name = (path / "latest").read_text().strip()
        folder = path / name
        if not (folder / "meta.json").exists():
            what = "has no meta.json" if folder.is_dir() else "does not exist"
            raise ValueError(
                f"{str(path)!r}: its 'latest' names {name!r}, which {what}; pass one of its "
                "step-N folders instead"
            )
        return folder
    raise ValueError(f"{str(path)!r} holds no checkpoint (no 'latest' and no meta.json)")


def read_meta(folder: Path, *, allow_unverified: bool = False) -> dict[str, Any]:
    """meta.json of checkpoint `folder`, parsed and checked: valid JSON of our format, unedited
    (its meta_sha256), and with digests for the other files unless `allow_unverified`. Raises
    ValueError naming the file."""
    path = Path(folder) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}): the checkpoint's meta.json is truncated or "
            "damaged; use another checkpoint (a step-N folder)"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, LEGACY_FORMAT):
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: format {got!r}, expected {FORMAT!r} (or {LEGACY_FORMAT!r})")
    want = meta.get("meta_sha256")
    if want is not None and meta_digest(meta) != want:
        raise ValueError(
            f"{path} was edited after it was written (its content no longer matches its "
            f"meta_sha256; it says step {meta.get('step')!r}): restore it or use another "
            "checkpoint; a resumed run takes other settings from flags, not from meta.json"
        )
    if "files" not in meta and not allow_unverified:
        raise ValueError(
            f"{path} records no SHA-256 digests (a checkpoint written before schemoe kept "
            f"them): its files cannot be verified; pass {UNVERIFIED_FLAG} to load it anyway "
            "(its tensors and the run's final eval are then checked for NaN/Inf)"
        )
    if not isinstance(meta.get("step"), int) or meta["step"] < 0:
        raise ValueError(f"{path}: step must be an int >= 0, got {meta.get('step')!r}")
    return meta


def verify(path: str | os.PathLike, *, allow_unverified: bool = False) -> Path:
    """Check a whole checkpoint before loading it (no collective; a launcher runs it before any
    rank starts): meta.json (`read_meta`), and every file it lists present and matching its
    SHA-256, DCP's .metadata and every data file it names among them. Returns the folder.
    Reads every file once."""
    folder = resolve(path)
    meta = read_meta(folder, allow_unverified=allow_unverified)
    if meta["format"] == LEGACY_FORMAT:
        names = {*file_names(meta), *meta.get("files", {})}
    else:
        md = read_metadata(checked(folder, METADATA, meta).parent)
        names = {*meta.get("files", {}), *(s.relative_path for s in md.storage_data.values())}
    for name in sorted(names):
        checked(folder, name, meta)
    return folder
