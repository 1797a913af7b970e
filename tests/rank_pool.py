"""Ranks spawned once and reused by many test cases (torchtitan's `with_comms`, as a pool).

    pool = RankPool(4)                        # 4 processes, gloo group initialised in each
    results = pool.run(fn, *args)             # fn(rank, world, *args) on every rank, by rank
    pool.close()

Each `run` is one test case, so a failing case fails alone while the ranks' start and group
set-up is paid once per world size. A case that raises on any rank, or a rank that dies or
outlives `run_timeout`, closes the pool (the ranks may be stuck in a collective or out of step);
the `ranks` fixture then builds a fresh one for the next case. The ranks fork from a forkserver
that imported torch and schemoe once (`context`), not from fresh interpreters that import both
again (~2 s of CPU each).
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from procs import alive
from schemoe.dist.launch import free_port, init_process_group, set_launcher_env

__all__ = ["RankPool", "context"]


def context():
    """The multiprocessing context of the test ranks: a forkserver preloading torch, schemoe's
    training loop and this module (and with it `procs`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rank_pool", "schemoe.train.loop"])
    return ctx


def _exit_with(pid: int) -> None:
    """End this rank once process `pid` (pytest) is gone, even killed by SIGKILL. Not the kernel's
    parent-death signal: the rank's parent is the forkserver, which lives while any rank does."""

    def watch() -> None:
        while alive(pid):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="rank-pool-watch", daemon=True).start()


def _serve(rank, world, port, inbox, results, timeout_s, parent):
    _exit_with(parent)  # a killed pytest takes its ranks along
    set_launcher_env(rank, world, port)
    torch.set_num_threads(1)
    init_process_group("gloo", timeout_s)
    try:
        while (job := inbox.get()) is not None:
            fn, args = job
            try:
                results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
            except BaseException:  # noqa: BLE001 (the parent reports it and closes the pool)
                results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():  # (a case may have shut the group down itself)
            dist.destroy_process_group()


class RankPool:
    """`world` ranks, each running the functions `run` sends it (see the module docstring)."""

    def __init__(self, world: int, timeout: float = 120.0) -> None:
        ctx = context()
        self.world, self.timeout = world, timeout
        self.results = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, world, port, self.inboxes[r], self.results, timeout, os.getpid()),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.closed = False

    def run(self, fn: Callable[..., Any], *args: Any, run_timeout: float | None = None) -> list:
        """fn(rank, world, *args) on every rank; the results by rank. Raises RuntimeError with
        the failing ranks' tracebacks, TimeoutError past run_timeout (default timeout + 30 s)."""
        if self.closed:
            raise RuntimeError("this RankPool is closed")
        for inbox in self.inboxes:
            inbox.put((fn, args))
        out: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + (run_timeout or self.timeout + 30.0)
        while len(out) + len(errors) < self.world:
            try:
                rank, ok, val = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    errors.append(f"rank(s) {dead} died")
                    break
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"{fn.__name__} did not finish on {self.world} ranks")
                continue
            if ok:
                out[rank] = pickle.loads(val)
            else:
                errors.append(f"--- rank {rank} ---\n{val}")
                break  # the others may wait on the failed rank: do not wait for them
        if errors:
            self.close()
            raise RuntimeError("distributed case failed:\n" + "\n".join(errors))
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for inbox, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
