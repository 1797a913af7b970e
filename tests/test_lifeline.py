"""Ranks die with their launcher: SIGTERM to `schemoe train` or `schemoe testbed run` stops the
ranks (the train launcher then says so in one line), and a launcher killed outright (SIGKILL)
still takes them along (parent-death signal). Linux only: the tests read /proc. SIGINT, a rank
killed, a stalled rank and resuming afterwards: test_signals.py."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from procs import children, cmdline, gone_within, reap
from train_cases import TINY

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _signal_and_check(p: subprocess.Popen, ranks: list[int], sig: int) -> None:
    """Send `sig` to the launcher `p`: it exits within 15 s (with 128 + SIGTERM on SIGTERM) and
    none of its `ranks` is alive 5 s later."""
    p.send_signal(sig)
    p.wait(15)
    assert gone_within(ranks, 5.0) == []
    if sig == signal.SIGTERM:
        assert p.returncode == 128 + signal.SIGTERM
        if p.stderr is not None:  # the train launcher: one line saying what happened
            err = p.stderr.read()
            said = [x for x in err.splitlines() if x.startswith("schemoe train:")]
            assert "Traceback" not in err, err
            assert len(said) == 1, err
            assert re.fullmatch(
                r"schemoe train: interrupted by SIGTERM at step \d+; nothing saved \(no --save\)",
                said[0],
            ), said


def _first_line(p: subprocess.Popen, prefix: str, seconds: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line.startswith(prefix):
            return line
    pytest.fail(f"no line starting with {prefix!r} within {seconds}s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_rank_outlives_the_train_launcher_killed_after_its_first_step(sig):
    cmd = [sys.executable, "-m", "schemoe", "train", *TINY, "--nproc", "2", "--steps", "100000"]
    p = subprocess.Popen(
        [*cmd, "--log-every", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    ranks: list[int] = []
    try:
        _first_line(p, "step", 240)
        ranks = [c for c in children(p.pid) if "spawn_main" in cmdline(c)]
        assert len(ranks) == 2, [cmdline(c) for c in children(p.pid)]
        _signal_and_check(p, ranks, sig)
    finally:
        reap(p, ranks)


CHILD = """
import os, sys, time
with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the testbed needs root and iproute2 (ip, tc)",
)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_rank_outlives_the_testbed_launcher(sig, tmp_path):
    from schemoe.testbed import netns

    if netns.namespaces() or os.path.exists(netns.STATE_FILE):
        pytest.skip("a testbed is already up; not touching someone else's")
    script, pids = tmp_path / "child.py", tmp_path / "pids"
    script.write_text(CHILD)
    pids.mkdir()
    netns.up(2, "1gbit")
    ranks: list[int] = []
    p = None
    try:
        cmd = [sys.executable, "-m", "schemoe", "testbed", "run", "--ranks-per-node", "1"]
        p = subprocess.Popen([*cmd, "--timeout", "100", "--", str(script), str(pids)])
        deadline = time.monotonic() + 30
        while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # both pid files written in full
        ranks = [int((pids / f).read_text()) for f in os.listdir(pids)]
        assert len(ranks) == 2
        _signal_and_check(p, ranks, sig)
    finally:
        reap(p, ranks)
        netns.down()
