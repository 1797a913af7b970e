"""Which device a process group's collectives take, and the one place control tensors are made.

Rule (DESIGN.md, "Devices and scale-out rules"): every tensor handed to a collective lives on the
backend's device: gloo takes CPU tensors, NCCL the rank's current CUDA device. Data tensors (the
rows an all-to-all moves, expert weights) are already there when the model is placed; small
control tensors (token counts, flags, norms, eval sums, trial timings) are created by
`control_tensor` / `control_zeros` on `comm_device(group)`, never on the default device.

    flag = control_tensor([int(ok)], dtype=torch.int64, group=group)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)

NCCL issue rule (see also schemoe.collectives): on NCCL no collective is issued from a worker
thread; `issues_from_worker_thread(group)` is False there and the multi-phase algorithms enqueue
their phases on side streams from the calling thread instead. Gloo keeps its comm thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "backend_name",
    "comm_device",
    "control_tensor",
    "control_zeros",
    "issues_from_worker_thread",
    "local_device",
]


def backend_name(group: Any = None) -> str:
    """The backend of `group` ("gloo", "nccl", ...), or "gloo" without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return "gloo"
    return str(dist.get_backend(group)).lower()


def comm_device(group: Any = None) -> torch.device:
    """The device `group`'s collectives take: the current CUDA device on NCCL, else CPU."""
    if backend_name(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_tensor(
    values: Sequence[float] | Sequence[int], *, dtype: torch.dtype, group: Any = None
) -> torch.Tensor:
    """A small tensor of `values` on `comm_device(group)`, ready for a collective."""
    return torch.tensor(list(values), dtype=dtype, device=comm_device(group))


def control_zeros(
    shape: Sequence[int] | int, *, dtype: torch.dtype, group: Any = None
) -> torch.Tensor:
    """Zeros of `shape` on `comm_device(group)`, ready for a collective."""
    return torch.zeros(shape, dtype=dtype, device=comm_device(group))


def issues_from_worker_thread(group: Any = None) -> bool:
    """Whether a multi-phase algorithm may drive `group` from its comm thread: gloo yes, NCCL no
    (NCCL's documented deadlock: collectives from two host threads, e.g. DDP's all-reduce on the
    autograd thread, can be enqueued in different orders on different ranks)."""
    return backend_name(group) != "nccl"


def local_device(kind: str, local_rank: int) -> torch.device:
    """The device of this rank for `kind` ("cpu" or "cuda"): cuda:LOCAL_RANK on GPU nodes."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        if not 0 <= local_rank < torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs"
            )
        return torch.device("cuda", local_rank)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {kind!r}")
