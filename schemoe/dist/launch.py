"""Run a function on several local ranks (spawned processes, gloo) and collect what each returns.

Used by the tests, the benchmarks and `schemoe train --nproc P`. Every rank gets the usual launcher
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) so code run
here behaves as under torchrun.

A failed run is one line, naming the rank that caused it, however many ranks fail after it:
`RankFailure` ("distributed run failed: rank 2 was killed by signal SIGKILL ...", "... rank 1
raised ValueError: ..."). A rank dead without reporting is named from its exit status; an error
of a rank that raised beats the other ranks' peer failures (a connection it closed, a collective
it left), which are shown only when nothing else is known, then with the ranks that reported
nothing (stalled). After the first failure the others get `GRACE_S` to report, then are killed:
a rank blocked in a collective never outlives the run. SIGINT, SIGTERM or SIGHUP to the caller
stops every rank the same way and raises `lifeline.Interrupted` (a SystemExit, status 128 +
signal). A run past `run_timeout` is killed and `spawn` raises TimeoutError.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from . import topology
from .failures import is_peer_failure
from .host import configure_rank
from .lifeline import (
    Interrupted,
    Stopped,
    caught_signals,
    die_with_parent,
    sigint_ignored,
    signal_name,
    stop_on_sigterm,
)

__all__ = [
    "GRACE_S",
    "RankFailure",
    "free_port",
    "init_process_group",
    "joined",
    "set_launcher_env",
    "shutdown",
    "spawn",
]

# After a rank's failure or a stop request, how long the other ranks get to report and exit
# before they are killed (a rank blocked in a collective cannot react to anything else).
GRACE_S = 3.0
# Errors a user can cause (what `cliargs.guard` shows as one line); any other type a rank raises
# is a bug, whose traceback spawn writes to stderr.
EXPECTED = (ValueError, RuntimeError, OSError, FloatingPointError)
_WHY = {
    signal.SIGKILL: "the kernel's OOM killer sends it when memory runs out; `dmesg` says if it did",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code",
    signal.SIGABRT: "native code aborted",
}


class RankFailure(RuntimeError):
    """A spawned run failed; the message is one line naming the rank that caused it. `rank`: that
    rank; `traceback`: its traceback when it raised ("" otherwise)."""

    def __init__(self, message: str, rank: int, tb: str = "") -> None:
        super().__init__(message)
        self.rank, self.traceback = rank, tb

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.traceback)


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


def _worker(rank, world, port, fn, args, results, host, timeout_s, parent, backend="gloo"):
    die_with_parent(parent)  # even a launcher killed by SIGKILL takes its ranks along
    stop_on_sigterm()  # the launcher's stop request; SIGINT stays ignored (sigint_ignored)
    try:
        _run_rank(rank, world, port, fn, args, results, host, timeout_s, backend)
    except Stopped:
        pass  # arrived while reporting another error: the launcher is stopping the run anyway
    finally:
        # From here a stop request ends the process at once: no exception (and so no traceback
        # from multiprocessing's bootstrap) can come out of a rank that is exiting.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(BaseException):
            shutdown()


def _run_rank(rank, world, port, fn, args, results, host, timeout_s, backend) -> None:
    """Run `fn` and put exactly one report: (rank, "ok", pickled result), (rank, "stopped",
    step), or (rank, "error" | "peer", (summary line, traceback, expected error type?))."""
    set_launcher_env(rank, world, port)
    import torch

    configure_rank(*host)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per local rank, before the first collective
        init_process_group(backend, timeout_s)
        out = fn(rank, world, *args)
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that
        # die with this process before the parent reads them.
        results.put((rank, "ok", pickle.dumps(out)))
    except Stopped as e:
        results.put((rank, "stopped", e.step))
    except BaseException as e:  # noqa: BLE001 (every failure goes to the parent)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        kind = "peer" if is_peer_failure(e) else "error"
        summary = f"{type(e).__name__}: {first}" if first else type(e).__name__
        results.put((rank, kind, (summary, traceback.format_exc(), isinstance(e, EXPECTED))))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    run_timeout: float | None = None,
    backend: str = "gloo",
    keep_freed_memory: bool = True,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; return results by rank.

    `backend`: "gloo" (CPU) or "nccl" (rank r on cuda:r; needs world_size GPUs).
    `threads`: each rank's CPU threads; `keep_freed_memory`: each rank keeps the memory it frees
    (schemoe.dist.host: no page faults for the large tensors a step reallocates).
    `timeout` bounds every collective; `run_timeout` the whole run (default: timeout + 30 s).
    `fn` must be importable (module level) and its return value picklable. The ranks die with
    the caller: SIGINT/SIGTERM/SIGHUP to it stop them and raise `lifeline.Interrupted`
    (SystemExit(128 + signal)), and each rank has a parent-death guard for a caller killed
    outright (schemoe.dist.lifeline). A failed rank raises `RankFailure` (see the module doc).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, results, (threads, keep_freed_memory), timeout,
                  os.getpid(), backend),
            daemon=True,
        )
        for r in range(world_size)
    ]
    limit = run_timeout if run_timeout is not None else timeout + 30.0
    state = _State(procs, results, time.monotonic() + limit)
    try:
        with caught_signals() as state.signals:
            with sigint_ignored():  # the ranks inherit it: Ctrl-C reaches the launcher only
                for p in procs:
                    p.start()
            _collect(state)
            if state.done():  # a signal now still ends the wait (and the run, with 128 + it)
                _join(procs, lambda: bool(state.signals))
    finally:
        _join(procs, lambda: True)
    if state.signals:
        raise Interrupted(state.signals[0], state.where())
    if state.failed():
        raise state.failure()
    if not state.done():
        raise TimeoutError(
            f"{world_size}-rank run of {getattr(fn, '__name__', fn)} did not finish in "
            f"{limit:.0f}s; finished ranks: {sorted(state.out)}"
        )
    return [state.out[r] for r in range(world_size)]


def _join(procs, stop: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait up to `seconds` for the ranks to exit on their own (until `stop()` says not to),
    then kill what is left: no rank outlives `spawn`."""
    deadline = time.monotonic() + seconds
    while any(p.pid is not None and p.is_alive() for p in procs):
        if stop() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join()


@dataclass
class _State:
    """What the launcher knows of its ranks while it waits for them."""

    procs: list
    results: Any
    deadline: float
    out: dict[int, Any] = field(default_factory=dict)  # rank -> result
    errors: dict[int, tuple[str, str, str, bool]] = field(default_factory=dict)
    dead: dict[int, int] = field(default_factory=dict)  # died unreported: rank -> exit code
    stopped: dict[int, int | None] = field(default_factory=dict)  # rank -> its step
    signals: list[int] = field(default_factory=list)
    since: float | None = None  # first failure, or the stop request

    def done(self) -> bool:
        return len(self.out) == len(self.procs)

    def failed(self) -> bool:
        return bool(self.errors or self.dead)

    def heard(self) -> set[int]:
        return set(self.out) | set(self.errors) | set(self.dead) | set(self.stopped)

    def decided(self) -> bool:
        """Whether the cause of a failure is known: a dead rank, or one that raised (not a peer
        failure, which only says some other rank is the cause), or everyone was heard."""
        kinds = {e[0] for e in self.errors.values()}
        return bool(self.dead) or "error" in kinds or self.heard() == set(range(len(self.procs)))

    def where(self) -> str:
        """The stopped ranks' step (rank 0's first) as " at step N", or "" when none said."""
        steps = [s for _, s in sorted(self.stopped.items()) if s is not None]
        return f" at step {steps[0]}" if steps else ""

    def failure(self) -> RankFailure:
        """The one error of a failed run: the first dead rank, else the first rank that raised,
        else the first peer failure with the ranks that reported nothing."""
        prefix = "distributed run failed: "
        if self.dead:
            rank, code = next(iter(self.dead.items()))
            return RankFailure(prefix + _death(rank, code), rank)
        errors = sorted(self.errors.items(), key=lambda kv: kv[1][0] != "error")  # stable
        rank, (kind, summary, tb, expected) = errors[0]
        if not expected:  # a bug: its traceback is wanted (a user error is the line alone)
            sys.stderr.write(f"--- rank {rank} traceback ---\n{tb}")
        line = f"rank {rank} raised {summary}"
        silent = sorted(set(range(len(self.procs))) - self.heard())
        if kind == "peer" and silent:
            which = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
            line += f" [{which} reported nothing within {GRACE_S:g}s of it: stalled; stopped]"
        return RankFailure(prefix + line, rank, tb)


def _death(rank: int, code: int) -> str:
    if code < 0:
        why = f" ({_WHY[-code]})" if -code in _WHY else ""
        return f"rank {rank} was killed by signal {signal_name(-code)}{why}"
    return f"rank {rank} exited with status {code} without reporting an error or a result"


def _collect(state: _State) -> None:
    """Read the ranks' reports until every rank returned, or a failure's cause is known (or
    `GRACE_S` passed since it), or every rank reported or exited after a signal (or `GRACE_S`
    passed), or the deadline. Signals are acted on here, not in their handler: SIGTERM to every live rank on
    the first, SIGKILL on a second."""
    n, told = len(state.procs), 0
    while True:
        if len(state.signals) > told:
            told = len(state.signals)
            state.since = state.since if state.since is not None else time.monotonic()
            _send(state.procs, signal.SIGTERM if told == 1 else signal.SIGKILL)
        try:
            rank, kind, val = state.results.get(timeout=0.1)
            _record(state, rank, kind, val)
        except queue.Empty:
            _reap_dead(state)
        now = time.monotonic()
        if state.signals:  # (one may have come since the top of the loop: sent next time)
            state.since = state.since if state.since is not None else now
            _drain(state)
            # A rank that reported has left its loop (and `train` its checkpoint consistent):
            # killing it skips only its teardown, which takes seconds.
            over = [r in state.heard() or p.exitcode is not None for r, p in enumerate(state.procs)]
            if all(over) or now > state.since + GRACE_S:
                return
        elif state.failed():
            state.since = state.since if state.since is not None else now
            if state.decided() or now > state.since + GRACE_S:
                return
        elif len(state.out) == n or now > state.deadline:
            return


def _record(state: _State, rank: int, kind: str, val: Any) -> None:
    if kind == "ok":
        state.out[rank] = pickle.loads(val)
    elif kind == "stopped":
        state.stopped[rank] = val
    else:
        state.errors[rank] = (kind, *val)


def _reap_dead(state: _State) -> None:
    """Ranks that exited without a report. Checked only when the queue is empty: a rank's report
    is in the pipe before it exits (the queue's feeder thread is joined at exit)."""
    if state.signals:
        return  # after a stop request the launcher's own signals kill them
    for r, p in enumerate(state.procs):
        if p.exitcode is not None and r not in state.heard():
            state.dead[r] = p.exitcode


def _drain(state: _State) -> None:
    with contextlib.suppress(queue.Empty, OSError, EOFError):
        while True:
            _record(state, *state.results.get_nowait())


def _send(procs, sig: int) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
