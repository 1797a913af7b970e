"""Run K ranks per node of the testbed, each inside its namespace, with torchrun's env.

Rank layout is node-major (rank = node * K + local_rank), as `schemoe.dist.topology` expects. Each
child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR (rank 0's
address) and MASTER_PORT like under torchrun, plus two launcher settings: GLOO_SOCKET_IFNAME=eth0
so gloo binds to the namespace's address, and OMP_NUM_THREADS=1 (torchrun's default for several
ranks).

Where the bytes go: gloo's full mesh connects every pair of ranks to the address the peer bound.
On a testbed without an intra-node rate the ranks of a node share its namespace and address, so
the kernel routes their pairs over that namespace's loopback (`lo`), not eth0: intra-node pairs
are unshaped, inter-node pairs cross the shaped veths. With an intra-node rate each rank has its
own namespace (rank = node * K + local), so every pair leaves through the rank's shaped eth0.
tests/test_testbed.py and tests/test_testbed_ranks.py check both with interface counters.

A child that exits non-zero makes the launcher kill the others and return that code; a run that
outlives `timeout` is killed and returns 124. Nothing waits unbounded. The ranks die with the
launcher: SIGTERM/SIGHUP to it kill them (then it exits 128 + signal), and each child carries a
parent-death signal for a launcher killed outright (schemoe.dist.lifeline).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from ..dist.lifeline import on_signals, set_parent_death_signal
from . import netns

__all__ = ["child_command", "run"]

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_command(target: Sequence[str]) -> list[str]:
    """`[-m] module args` or `script.py args` -> the python command line each rank runs."""
    target = list(target)
    if target and target[0] == "--":
        target = target[1:]
    if not target:
        raise ValueError("nothing to run: give a module (e.g. schemoe.cli bench a2a) or a script")
    if target[0] == "-m":
        if len(target) < 2:
            raise ValueError("-m needs a module name")
        return [sys.executable, "-m", *target[1:]]
    if target[0].endswith(".py") or os.path.isfile(target[0]):
        if not os.path.isfile(target[0]):
            raise ValueError(f"script {target[0]!r} does not exist")
        return [sys.executable, *target]
    return [sys.executable, "-m", *target]


def _free_port(ns: str) -> int:
    # Ask the kernel inside rank 0's namespace, where the store will listen.
    code = "import socket;s=socket.socket();s.bind(('',0));print(s.getsockname()[1])"
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(out.stdout)


def _kill(procs: list[subprocess.Popen]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)  # the rank and anything it started
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3.0
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)


def run(
    target: Sequence[str],
    ranks_per_node: int,
    timeout: float = 600.0,
    bed: netns.Testbed | None = None,
) -> int:
    """Launch `target` on every node of the testbed that is up; return the first failing code."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    cmd = child_command(target)
    netns.check_prerequisites()
    bed = bed or netns.load()
    if bed.per_rank and ranks_per_node != bed.ranks_per_node:
        raise ValueError(
            f"ranks_per_node {ranks_per_node}: the testbed that is up has "
            f"{bed.ranks_per_node} rank namespaces per node; run with that many, or bring it up "
            f"again with --ranks-per-node {ranks_per_node}"
        )
    world = bed.nodes * ranks_per_node
    base = dict(os.environ)
    base.update(
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        MASTER_ADDR=bed.master_addr,
        MASTER_PORT=str(_free_port(bed.rank_ns(0, 0))),
        GLOO_SOCKET_IFNAME=netns.IFNAME,
        OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join(p for p in (_PKG_ROOT, base.get("PYTHONPATH")) if p),
    )
    procs: list[subprocess.Popen] = []
    with on_signals(lambda _signum: _kill(procs)):
        try:
            for node in range(bed.nodes):
                for local in range(ranks_per_node):
                    env = dict(
                        base,
                        RANK=str(node * ranks_per_node + local),
                        LOCAL_RANK=str(local),
                        GROUP_RANK=str(node),
                        NODE_RANK=str(node),
                    )
                    procs.append(
                        subprocess.Popen(
                            ["ip", "netns", "exec", bed.rank_ns(node, local), *cmd],
                            env=env,
                            start_new_session=True,
                            # no threads here; it only calls a prctl resolved at import
                            preexec_fn=set_parent_death_signal,  # noqa: PLW1509
                        )
                    )
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    rank, code = bad[0]
                    print(
                        f"testbed run: rank {rank} exited with {code}; stopping the others",
                        file=sys.stderr,
                    )
                    return code if code > 0 else 128 - code
                if all(c == 0 for c in codes):
                    return 0
                if time.monotonic() > deadline:
                    print(f"testbed run: not finished after {timeout:g}s; killed", file=sys.stderr)
                    return 124
                time.sleep(0.05)
        finally:
            _kill(procs)
