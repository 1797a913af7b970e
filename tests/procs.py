"""Linux process helpers of the launcher tests (test_lifeline, test_signals): read /proc to find a
launcher's ranks and check they are gone, and clean up what a failed check left running."""

from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["alive", "children", "cmdline", "gone_within", "ranks_of", "reap"]


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # [state, ppid, ...]
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def children(pid: int) -> list[int]:
    return [
        int(d)
        for d in os.listdir("/proc")
        if d.isdigit() and (_stat(int(d)) or [0, 0])[1] == str(pid)
    ]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ranks_of(launcher: int) -> list[int]:
    """The ranks `schemoe.dist.launch.spawn` started from process `launcher`, by rank (they are
    started in rank order, so their PIDs ascend unless the PID counter wrapped)."""
    return sorted(c for c in children(launcher) if "spawn_main" in cmdline(c))


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The `pids` still alive after waiting up to `seconds` for all of them to end."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def reap(p: subprocess.Popen | None, ranks: list[int]) -> None:
    """Kill whatever a failed check left running: the ranks, then the launcher."""
    for r in ranks:
        if alive(r):
            os.kill(r, signal.SIGKILL)
    if p is not None and p.poll() is None:
        p.kill()
    if p is not None:
        p.wait()
