"""Run a function on several local ranks (spawned processes, gloo) and collect what each returns.

Used by the tests, the benchmarks and `schemoe train --nproc P`. Every rank gets the usual launcher
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) so code run
here behaves as under torchrun. A rank that raises makes `spawn` raise with that rank's traceback;
a group that does not finish within `timeout` is killed and `spawn` raises TimeoutError, so a
broken collective never hangs the caller.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "init_process_group", "spawn"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """init_process_group from the launcher env, with a finite collective timeout."""
    import torch.distributed as dist

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _worker(rank, world, port, fn, args, results, threads, timeout_s, backend="gloo"):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per local rank, before the first collective
        init_process_group(backend, timeout_s)
        out = fn(rank, world, *args)
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that
        # die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 (every failure, even KeyboardInterrupt, goes to the parent)
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
    `fn` must be importable (module level) and its return value picklable.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, results, threads, timeout, backend),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    import time

    limit = run_timeout if run_timeout is not None else timeout + 30.0
    deadline = time.monotonic() + limit
    try:
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
                    break
                continue
            if ok:
                out[rank] = pickle.loads(val)
            else:
                errors.append(f"--- rank {rank} ---\n{val}")
                break  # the others will fail or hang on the missing peer; stop them
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 10.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
