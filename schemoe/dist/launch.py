"""Run a function on several local ranks (spawned processes, gloo) and collect what each returns.

Used by the tests, the benchmarks and `schemoe train --nproc P`. Every rank gets the usual launcher
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) so code run
here behaves as under torchrun. A rank that raises makes `spawn` raise a RuntimeError whose first
line names the rank and its exception ("distributed run failed: rank 0 raised ValueError: ...")
and whose rest is that rank's traceback; a group that does not finish within `timeout` is killed
and `spawn` raises TimeoutError, so a broken collective never hangs the caller.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from . import topology
from .lifeline import die_with_parent, on_signals

__all__ = ["free_port", "init_process_group", "joined", "set_launcher_env", "shutdown", "spawn"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    """The end of a rank: release this process's cached groups (`topology.release`) and destroy
    every process group while the interpreter is fully alive (a no-op when none is initialised).

    Every entry point that initialised torch.distributed ends through here. A group left to the
    interpreter's exit aborted a finished rank with SIGABRT in 7 of 25 testbed runs of `bench
    layer`, against 0 of 25 ending here (docs/results/exit_abort_testbed.txt, one interleaved
    run); gc.collect breaks the cycles that keep one alive."""
    topology.release()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def joined(backend: str = "gloo", timeout_s: float = 120.0) -> Iterator[None]:
    """A launched rank's group (torchrun, the testbed) for the block: `init_process_group` on
    entry, `shutdown` on exit however the block ends."""
    init_process_group(backend, timeout_s)
    try:
        yield
    finally:
        shutdown()


def init_process_group(backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """init_process_group from the launcher env, with a finite collective timeout."""
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def set_launcher_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives a rank on one host (what init_process_group reads)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _worker(rank, world, port, fn, args, results, threads, timeout_s, parent, backend="gloo"):
    die_with_parent(parent)  # even a launcher killed by SIGKILL takes its ranks along
    set_launcher_env(rank, world, port)
    import torch

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per local rank, before the first collective
        init_process_group(backend, timeout_s)
        out = fn(rank, world, *args)
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that
        # die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 (every failure, even KeyboardInterrupt, goes to the parent)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        # a diverged run, a failed save: the message says it all; a traceback for the rest
        tb = "" if isinstance(e, FloatingPointError | OSError) else traceback.format_exc()
        results.put((rank, False, (f"{type(e).__name__}: {first}", tb)))
    finally:
        shutdown()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    run_timeout: float | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; return results by rank.

    `backend`: "gloo" (CPU) or "nccl" (rank r on cuda:r; needs world_size GPUs).
    `timeout` bounds every collective; `run_timeout` the whole run (default: timeout + 30 s).
    `fn` must be importable (module level) and its return value picklable. The ranks die with
    the caller: SIGTERM/SIGHUP to it are forwarded to them (then SystemExit(128 + signal)), and
    each rank has a parent-death guard for a caller killed outright (schemoe.dist.lifeline).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, results, threads, timeout, os.getpid(), backend),
            daemon=True,
        )
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    errors: list[str] = []
    limit = run_timeout if run_timeout is not None else timeout + 30.0
    deadline = time.monotonic() + limit

    def forward(signum: int) -> None:
        errors.append(f"the launcher got signal {signum}; its ranks were stopped")
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    try:
        with on_signals(forward):
            for p in procs:
                p.start()
            _collect(procs, results, out, errors, deadline, limit, fn)
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=0.5 if errors else 10.0)
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed run failed: " + "\n".join(errors))
    return [out[r] for r in range(world_size)]


def _collect(procs, results, out, errors, deadline, limit, fn) -> None:
    """Fill `out` (rank -> result) until every rank reported; stop at the first error."""
    world_size = len(procs)
    while len(out) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{world_size}-rank run of {getattr(fn, '__name__', fn)} did not finish in "
                f"{limit:.0f}s; finished ranks: {sorted(out)}"
            )
        try:
            rank, ok, val = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and not errors:
                errors.append(
                    f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}"
                )
                return
            continue
        if ok:
            out[rank] = pickle.loads(val)
        else:
            summary, tb = val
            more = f"\n--- rank {rank} ---\n{tb}" if tb else ""
            errors.append(f"rank {rank} raised {summary}{more}")
            return  # the others will fail or hang on the missing peer; stop them
