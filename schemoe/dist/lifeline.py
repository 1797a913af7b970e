"""Ranks die with their launcher: signal forwarding in the launcher, a parent-death guard in ranks.

Used by `schemoe.dist.launch.spawn` (so `schemoe train --nproc P`) and the testbed launcher. Two
mechanisms, because either alone leaves orphans:

- `on_signals(handler)`: while a launcher waits for its ranks, SIGTERM and SIGHUP call
  `handler(signum)` (which stops the ranks) and then raise SystemExit(128 + signum), so the
  launcher's own `finally` clean-up runs too. Python's default for SIGTERM is to die at once,
  without `finally` or atexit, leaving every rank running.
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

__all__ = ["die_with_parent", "on_signals", "set_parent_death_signal"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


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
