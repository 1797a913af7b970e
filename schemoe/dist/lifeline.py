"""Ranks die with their launcher: signal handling in the launcher, a parent-death guard in ranks.

Used by `schemoe.dist.launch.spawn` (so `schemoe train --nproc P`) and the testbed launcher.

- `caught_signals()` (spawn): while a launcher waits for its ranks, SIGINT, SIGTERM and SIGHUP
  are only recorded; the launcher's loop then stops its ranks (SIGTERM, SIGKILL after a grace
  period) and raises `Interrupted`, a SystemExit with status 128 + signal, whose text is the one
  line to show ("interrupted by SIGINT at step 7"). SIGINT is handled the same whether it was
  sent to the launcher's PID or to the whole process group (Ctrl-C): ranks ignore SIGINT
  (`sigint_ignored` around their start, inherited through exec) and stop on SIGTERM only
  (`stop_on_sigterm`: the first raises `Stopped`, a BaseException no `except Exception` takes,
  at once or at the end of a `stop_deferred` block, so that a checkpoint being saved completes).
- `on_signals(handler)` (testbed): SIGTERM and SIGHUP call `handler(signum)` (which stops the
  ranks) and then raise SystemExit(128 + signum), so the launcher's `finally` clean-up runs too.
  Python's default for SIGTERM is to die at once, without `finally`, leaving every rank running.
- `die_with_parent(parent)`: a rank is killed (SIGKILL) when the process that started it dies,
  even by SIGKILL, which no handler can forward. Linux: prctl(PR_SET_PDEATHSIG) through ctypes,
  which the kernel applies (it survives exec, so it also covers `ip netns exec python ...`);
  elsewhere a daemon thread polls os.getppid() once a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

__all__ = [
    "Interrupted",
    "Stopped",
    "caught_signals",
    "die_with_parent",
    "on_signals",
    "set_parent_death_signal",
    "sigint_ignored",
    "signal_name",
    "stop_deferred",
    "stop_on_sigterm",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a launcher


def signal_name(signum: int) -> str:
    """The name of signal `signum` (9 -> "SIGKILL"; "signal 99" for one Python does not name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(SystemExit):
    """A launcher stopped by a signal, after stopping its ranks. A SystemExit with status
    128 + signum (130 for SIGINT, 143 for SIGTERM): uncaught, Python exits with that status and
    no traceback. `str(e)` is the line to show: "interrupted by SIGINT" + `detail`."""

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__(128 + signum)
        self.signum, self.detail = signum, detail

    def __str__(self) -> str:
        return f"interrupted by {signal_name(self.signum)}{self.detail}"

    def __reduce__(self):
        return type(self), (self.signum, self.detail)


class Stopped(BaseException):
    """Raised in a rank by the launcher's stop request (SIGTERM, see `stop_on_sigterm`). A
    BaseException, so no `except Exception` swallows it. `step`: the step the rank was in, when
    its training loop recorded one on the way out (None otherwise)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.step = signum, None


def _find_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved at import, in the launcher: a preexec_fn (after fork) only calls it, no dlopen.
_PRCTL = _find_prctl()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the Linux kernel to send `sig` to this process when its parent dies; False where
    that is not available (not Linux, or prctl failed). Usable as a `preexec_fn`."""
    return _PRCTL is not None and _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent: int) -> None:
    """End this process when process `parent` (its launcher) is gone: the kernel's parent-death
    signal, or a polling thread where there is none. Exits now if `parent` already died."""
    if not set_parent_death_signal():

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="schemoe-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # died before the guard was set: nobody would signal us
        os._exit(1)


@contextlib.contextmanager
def on_signals(handler: Callable[[int], None]) -> Iterator[None]:
    """Within the block, SIGTERM/SIGHUP run `handler(signum)` then raise SystemExit(128 +
    signum). Outside the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on(signum: int, _frame) -> None:
        handler(signum)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def caught_signals() -> Iterator[list[int]]:
    """Within the block, SIGINT, SIGTERM and SIGHUP are appended to the yielded list instead of
    acting (the caller polls it). Outside the main thread (where Python cannot set handlers) the
    list stays empty and the signals keep their handlers."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    old = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in STOP_SIGNALS}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored within the block: processes started in it inherit SIG_IGN through exec,
    and Python then installs no KeyboardInterrupt handler in them, so a Ctrl-C to the process
    group reaches only the launcher (which stops them). A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class _Stop:
    """A rank's stop request: how many `stop_deferred` blocks are open, and a deferred signal."""

    depth = 0
    pending: int | None = None


def _raise_stop(signum: int) -> None:
    _Stop.pending = None  # raised once: a later block's end must not raise it again
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stopped(signum)


def stop_on_sigterm() -> None:
    """In a rank: the first SIGTERM raises `Stopped` in the main thread (at the end of the
    outermost `stop_deferred` block, when one is open); later ones are ignored (the rank is
    already stopping, and the launcher kills what outlives its grace period)."""

    def stop(signum: int, _frame) -> None:
        if _Stop.depth:
            _Stop.pending = signum
        else:
            _raise_stop(signum)

    signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def stop_deferred() -> Iterator[None]:
    """A block that a stop request does not cut short (a checkpoint's commit): `Stopped` is
    raised when the block ends, however it ends. Without `stop_on_sigterm` it changes nothing.
    Also a decorator (`@stop_deferred()`), for a whole function."""
    _Stop.depth += 1
    try:
        yield
    finally:
        _Stop.depth -= 1
        if not _Stop.depth and _Stop.pending is not None:
            _raise_stop(_Stop.pending)
