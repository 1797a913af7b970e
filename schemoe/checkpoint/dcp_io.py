"""The tensor payload of a checkpoint through torch.distributed.checkpoint (DCP): a write that
names the file an OS error hit (ENOSPC on a full disk), and reads that run no code from the
checkpoint.

DCP writes one `__<rank>_0.distcp` per rank (each tensor a `torch.save` record, read back with
`weights_only=True`) and rank 0 writes `.metadata`: a plain pickle of DCP's Metadata (keys,
shapes, dtypes, where each record lies). Unpickling it with `pickle.load`, as DCP's own reader
does, would run whatever a crafted file names; here it is unpickled with an allow-list of DCP's
metadata classes, torch.Size, dtypes and paths, so nothing in a checkpoint can run code.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .files import rank_world

__all__ = ["METADATA", "data_file", "fetch", "read_metadata", "write"]

METADATA = ".metadata"
_META_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}  # fmt: skip
_NO_DIST = "torch.distributed is disabled, unavailable or uninitialized"


def data_file(rank: int) -> str:
    """The file DCP's FileSystemWriter writes for `rank` (one file per rank, one thread)."""
    return f"__{rank}_0.distcp"


class _Spool(io.BytesIO):
    """A file's bytes in memory; DCP closes its stream before the spool is written out."""

    data: bytes = b""

    def close(self) -> None:
        if not self.closed:
            self.data = self.getvalue()
        super().close()


class _NamingFileSystem(FileSystem):
    """DCP's local file system, except that a file is written the way `files.write` writes one:
    serialised in memory first, then one write, flush and fsync, so a full disk is ENOSPC naming
    the file (torch.save streaming into a file on a full disk fails inside its zip writer as
    "unexpected pos N vs M"); the cost is one more copy of this rank's file in memory. Reads
    are DCP's own."""

    @contextmanager
    def create_stream(self, path, mode) -> Iterator:
        try:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            spool = _Spool()
            yield spool
            data = spool.data if spool.closed else spool.getvalue()
            with super().create_stream(path, mode) as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
        except OSError as e:
            if not e.filename:
                e.filename = str(path)
            raise


def write(state: dict[str, torch.Tensor], folder: Path) -> BaseException | None:
    """`dcp.save` of this rank's `state` into `folder` (collective when a process group is
    up: DCP gathers the plans, deduplicates keys several ranks hold, and every rank learns of
    any rank's failure). Returns this rank's own failure, None when it wrote its part (another
    rank may still have failed: the caller settles that)."""
    # sync_files off: the file system above fsyncs every file it writes (DCP's own fsync
    # needs a real file's descriptor, and falls back to a machine-wide sync without one)
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=False)
    writer.fs = _NamingFileSystem()
    try:
        with warnings.catch_warnings():  # one process, no group: as intended, not a warning
            warnings.filterwarnings("ignore", message=_NO_DIST)
            dcp.save(state, storage_writer=writer, no_dist=rank_world()[1] == 1)
    except CheckpointException as e:
        failed = e.failures.get(rank_world()[0])
        return failed[0] if failed is not None else None
    return None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name) if module.startswith(("torch", "pathlib")) else None
        ok = (
            (module, name) in _ALLOWED
            or (module == _META_MODULE and isinstance(obj, type) and obj.__module__ == module)
            or (module == "torch" and isinstance(obj, torch.dtype))
            or (module.startswith("pathlib") and isinstance(obj, type) and issubclass(obj, Path))
        )
        if not ok:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return obj


def read_metadata(folder: Path) -> Metadata:
    """DCP's Metadata of checkpoint `folder`, unpickled with the allow-list. Raises ValueError
    naming the file for anything else."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as f:
            md = _Unpickler(f).load()
    except Exception as e:  # UnpicklingError, EOFError, ... : not DCP metadata
        raise ValueError(
            f"{path} is not a loadable checkpoint file (DCP metadata classes only, tensors only "
            f"with weights_only=True): {e}"
        ) from e
    if not isinstance(md, Metadata):
        raise ValueError(f"{path} holds a {type(md).__name__}, not DCP Metadata")  # noqa: TRY004
    return md


class _Reader(dcp.FileSystemReader):
    """DCP's file reader with `read_metadata` replaced by the allow-listed one."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = read_metadata(Path(self.path))
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def fetch(folder: Path, want: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """The tensors `want` names (keys of the checkpoint's metadata), read from `folder` on this
    process alone (no collective), into new CPU tensors of the stored shape and dtype."""
    out = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in want.items()}
    if not out:
        return out
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            dcp.load(out, storage_reader=_Reader(folder), no_dist=True)
    except CheckpointException as e:
        first = next(iter(e.failures.values()))[0]
        raise ValueError(
            f"{folder} is not a loadable checkpoint (tensors only, weights_only=True): "
            f"{type(first).__name__}: {first}"
        ) from None
    return out
