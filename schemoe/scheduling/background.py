"""Background transfers: low-priority network work (gradient all-reduce buckets, "AR" tasks) that
fills the network's idle time, below every all-to-all a scheduled region posts.

    bg = Background(window=1)
    bg.submit(start, done)     # start() -> Pending, posted when the network is idle; done(result)
    bg.pump()                  # post what may go now (executors call it between their tasks)
    bg.flush()                 # post everything left and wait for all of it

The rule (the all-to-alls' priority): a queued transfer is posted only while no all-to-all of a
scheduled region is in flight (`busy`, counted by the executors that were handed this object)
and fewer than `window` background transfers are in flight; queued transfers go in submission
order. A posted transfer is never preempted: a region that starts an all-to-all while one runs
shares the link with it for the rest of that transfer (so buckets are best kept small).

Threads: `submit`, `pump` and `flush` post from the calling thread only (NCCL's rule: no
collective from a worker thread); completions are noticed by polling `is_completed()` at pump
points and by `flush`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Background"]


class Background:
    """A FIFO of low-priority transfers posted into idle network time (module docstring).

    Args:
        window: how many background transfers may be in flight at once (>= 1).
    """

    def __init__(self, window: int = 1) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.window = window
        self.busy = 0  # all-to-alls of scheduled regions in flight
        self._queue: deque[tuple[Callable[[], Any], Callable[[Any], None]]] = deque()
        self._inflight: deque[tuple[Any, Callable[[Any], None]]] = deque()
        self.posted = 0  # transfers posted so far (for tests and traces)

    def __len__(self) -> int:
        """Transfers queued or in flight."""
        return len(self._queue) + len(self._inflight)

    def submit(self, start: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """Queue a transfer: `start()` posts it and returns a Pending (`wait()`,
        `is_completed()`); `done(result)` runs once it has completed."""
        self._queue.append((start, done))
        self.pump()

    def _reap(self) -> None:
        while self._inflight and _completed(self._inflight[0][0]):
            pending, done = self._inflight.popleft()
            done(pending.wait())

    def _post(self) -> None:
        start, done = self._queue.popleft()
        self._inflight.append((start(), done))
        self.posted += 1

    def pump(self) -> None:
        """Post queued transfers while no all-to-all is in flight and the window has room."""
        self._reap()
        while self._queue and self.busy == 0 and len(self._inflight) < self.window:
            self._post()

    def flush(self) -> None:
        """Post every queued transfer and wait for all of them (end of backward)."""
        while self._queue:
            self._post()
        while self._inflight:
            pending, done = self._inflight.popleft()
            done(pending.wait())


def _completed(pending: Any) -> bool:
    probe = getattr(pending, "is_completed", None)
    return bool(probe()) if probe is not None else False
