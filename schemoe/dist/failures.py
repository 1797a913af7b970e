"""Failing loudly and early: a lost peer becomes a clear error, a non-finite value names its layer.

Two mechanisms, both used by `schemoe train`:

- Peer failure. Every collective is bounded by the process group's timeout
  (`init_process_group(timeout=...)`, `--timeout`). A rank that raises calls `abort()`, which
  tears down its process group so its peers' pending transfers fail within milliseconds
  ("connection reset") instead of waiting for the timeout; a rank that dies has the same effect;
  a rank that stalls is caught by the timeout. `is_peer_failure(e)` recognises the backend's
  messages for a closed connection or a timeout (nothing else), and `PeerFailure` says which it
  was and where (rank, step, phase) it was seen.
- Non-finite values (`--check-finite`). `FiniteChecker` puts a forward hook on every module and
  checks each floating-point output; the first module whose output is NaN/Inf (its inputs were
  finite, or an earlier hook would have fired) is named with the step, and after backward every
  gradient is checked by parameter name. Each check is a host-device sync, hence a flag.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["FiniteChecker", "NonFiniteError", "PeerFailure", "abort", "is_peer_failure"]


class PeerFailure(RuntimeError):
    """A collective could not complete: another rank died, raised, or stalled past the timeout."""


class NonFiniteError(FloatingPointError):
    """A module produced NaN/Inf (forward) or a parameter got a NaN/Inf gradient (backward)."""


# What the backends say when a peer is gone (gloo raises plain RuntimeErrors naming its transport,
# "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ..."; NCCL's watchdog and
# aborted communicators say so too): (text, cause). Matched case-sensitively, first match wins.
_SIGNS = (
    ("Connection closed by peer", "closed"),
    ("Connection reset by peer", "closed"),
    ("Broken pipe", "closed"),
    ("Connection refused", "closed"),
    ("Timed out waiting", "timeout"),  # gloo: "Timed out waiting 4000ms for send operation"
    ("Application timeout caused pair closure", "timeout"),  # gloo, on the waiting side
    ("collective operation timeout", "timeout"),  # NCCL watchdog
    ("NCCL communicator was aborted", "closed"),
    ("ncclRemoteError", "closed"),
)
_BACKENDS = ("gloo", "NCCL", "nccl", "c10d")
# gloo messages that carry no backend name but say nothing else: matched on their own.
_OWN = ("Application timeout caused pair closure",)


def _cause(e: BaseException) -> str | None:
    """ "closed" (a peer's connection went away), "timeout" (a peer stayed silent past the
    timeout) or None (not a recognised backend message)."""
    text = str(e)
    if not any(b in text for b in _BACKENDS) and not any(o in text for o in _OWN):
        return None
    return next((cause for sign, cause in _SIGNS if sign in text), None)


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is the backend reporting a lost or silent peer (gloo, NCCL, the store): a
    PeerFailure, torch's DistError, or a RuntimeError carrying one of the backends' messages
    for a closed connection or a timeout. Any other error (even one mentioning gloo) is not."""
    if isinstance(e, PeerFailure | dist.DistError):
        return True
    return isinstance(e, RuntimeError) and _cause(e) is not None


def abort() -> None:
    """Tear down the default process group so the peers fail now instead of at their timeout."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # best effort: the group is already broken
            dist.destroy_process_group()


def peer_failure(
    e: BaseException, rank: int, step: int, phase: str, timeout: datetime.timedelta | float | None
) -> PeerFailure:
    """The PeerFailure to raise from `e`, which `is_peer_failure` accepted. It says what the
    backend saw: a peer that closed its connection (it died or raised; seen at once), or one
    that stayed silent past the timeout (it stalls, or died without closing), and the operation
    when the backend names it ("recv"). Which peer is the launcher's to say (`spawn` names the
    rank that died or raised, or the ranks that reported nothing)."""
    t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = f"rank {rank}, step {step} ({phase}){_innermost(e)}"
    op = re.search(r"for (\w+) operation", first)  # gloo: "Timed out waiting 5000ms for recv op..."
    what = f"a collective ({op.group(1)})" if op else "a collective"
    cause = _cause(e)
    if cause == "closed":
        what = "another rank closed its connection: it died or raised"
    elif cause == "timeout":
        within = f"within the {t:g}s timeout (--timeout)" if t else "within the timeout"
        what = (
            f"{what} did not complete {within}: another rank stalled, or died or raised "
            "without closing its connection"
        )
    else:
        what = f"{what} failed: another rank may have died, raised or stalled"
    return PeerFailure(f"{where}: {what}. Backend said: {first}")


_PACKAGE = Path(__file__).resolve().parents[1]


def _innermost(e: BaseException) -> str:
    """The last frame of `e`'s traceback in this package, i.e. which of its collectives was
    waiting, as " in collectives/naive.py:27 (wait)"; "" when no frame is in the package."""
    tb, found = e.__traceback__, ""
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        if path.is_relative_to(_PACKAGE):
            rel = path.relative_to(_PACKAGE).as_posix()
            found = f" in {rel}:{tb.tb_lineno} ({tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    return found


def _bad(t: torch.Tensor) -> int:
    # host sync: the count decides whether to raise
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0


class FiniteChecker:
    """Checks every module's forward outputs and every gradient for NaN/Inf.

    Args:
        model: the module tree to watch (pass the bare model, not a DDP wrapper).

    Set `checker.step` before each step; `check_grads()` after backward; `close()` removes the
    hooks. Raises NonFiniteError naming the module (or parameter) and the step.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model, self.step = model, 0
        self._handles = [
            m.register_forward_hook(self._hook(name or type(m).__name__))
            for name, m in model.named_modules()
        ]

    def _hook(self, name: str):
        def check(module: nn.Module, _inputs, output) -> None:
            outs = output if isinstance(output, tuple | list) else (output,)
            for i, t in enumerate(outs):
                if isinstance(t, torch.Tensor) and (n := _bad(t)):
                    which = f" output {i}" if len(outs) > 1 else ""
                    raise NonFiniteError(
                        f"non-finite values in {name} ({type(module).__name__}){which} at step "
                        f"{self.step} (forward): {n} of {t.numel()} elements are NaN/Inf"
                    )

        return check

    def check_loss(self, loss: torch.Tensor) -> None:
        if _bad(loss):
            raise NonFiniteError(f"non-finite loss {loss.item()} at step {self.step}")

    def check_grads(self) -> None:
        for name, p in self.model.named_parameters():
            if p.grad is not None and (n := _bad(p.grad)):
                raise NonFiniteError(
                    f"non-finite gradient of {name} at step {self.step} (backward): "
                    f"{n} of {p.grad.numel()} elements are NaN/Inf"
                )

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
