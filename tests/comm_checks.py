"""Test helpers run inside the ranks: a checker that wraps torch.distributed's collectives and
records every tensor handed to one whose device is not its group's backend device, or which was
made on the default device (a factory call without `device=`: on a NCCL rank that tensor would be
on the CPU while NCCL wants CUDA), and the thread each collective was issued from; and a counter
of host syncs (`.tolist()`, `.item()`, `.cpu()` and int/float/bool of a tensor).

On a CPU machine every tensor is on the CPU, so the device comparison alone catches nothing; the
default-device mark is what a CUDA run would expose (torch.set_default_device is not changed:
that would move the data tensors too)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from schemoe.dist import devices

__all__ = ["CommCheck", "count_host_syncs"]

_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.randn,
    torch.rand,
    torch.randint,
    torch.randperm,
}
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all",
    "reduce_scatter_tensor",
    "send",
    "recv",
)


class _MarkDefaultDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES and kwargs.get("device") is None and isinstance(out, torch.Tensor):
            out._made_on_default_device = True
        return out


class CommCheck:
    """with CommCheck() as c: ...  -> c.bad (violations), c.threads (issuing thread names)."""

    def __init__(self) -> None:
        self.bad: list[str] = []
        self.threads: set[str] = set()
        self.calls = 0
        self._saved: dict[str, object] = {}
        self._mode = _MarkDefaultDevice()

    def _check(self, name: str, t, group) -> None:
        if isinstance(t, list | tuple):
            for u in t:
                self._check(name, u, group)
            return
        if not isinstance(t, torch.Tensor):
            return
        want = devices.comm_device(group)
        if t.device != want:
            self.bad.append(f"{name}: tensor on {t.device}, the group's backend wants {want}")
        if getattr(t, "_made_on_default_device", False):
            self.bad.append(f"{name}: {tuple(t.shape)} tensor made on the default device")

    def _wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            group = kwargs.get("group")
            for a in (*args, *kwargs.values()):
                self._check(name, a, group)
            return fn(*args, **kwargs)

        return wrapped

    def _wrap_batch(self, fn):
        def wrapped(ops):
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            for op in ops:
                self._check("batch_isend_irecv", op.tensor, op.group)
            return fn(ops)

        return wrapped

    def __enter__(self):
        for name in _COLLECTIVES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        self._saved["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap_batch(dist.batch_isend_irecv)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


@contextmanager
def count_host_syncs():
    """Counts calls that copy a tensor's value to the host: yields a dict name -> count."""
    counts: dict[str, int] = {}
    names = ("tolist", "item", "cpu", "__int__", "__float__", "__bool__", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(n):
        def f(self, *a, **k):
            counts[n] = counts.get(n, 0) + 1
            return saved[n](self, *a, **k)

        return f

    for n in names:
        setattr(torch.Tensor, n, wrap(n))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)
