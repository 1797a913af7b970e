"""Stopping `schemoe train --nproc 2` from outside: SIGINT to the launcher's PID, a rank killed
with SIGKILL (as the OOM killer does), a rank that stalls past --timeout. (Ctrl-C, SIGINT to the
whole process group, takes the SIGINT path because ranks inherit SIGINT ignored: checked below
without a run.) Each run must end with every rank gone, a non-zero exit and one line saying what
happened (no traceback), and a resume from the last checkpoint must give the losses an
uninterrupted run gives. In-process: `spawn` names the rank that raised or died, once. Every
wait is bounded (subprocess timeouts, spawn's run timeout), so a regression fails, not hangs.

The runs save every step; the test signals once step 3's checkpoint exists. Losses are read from
--log-file (JSONL), never from stdout. The uninterrupted run and the resumes run the same 2-rank
training on the session's rank pool. Linux only (reads /proc)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import schemoe
from procs import gone_within, ranks_of, reap
from schemoe.dist import lifeline
from schemoe.dist.launch import RankFailure, spawn
from train_cases import TINY, train_on

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

STEPS = 1000  # the LR schedule's length: the same in every run compared
REFERENCE = 40  # steps of the uninterrupted run; an interrupted one must stop before
TRAIN = [sys.executable, "-m", "schemoe", "train", *TINY, "--nproc", "2", "--steps", str(STEPS)]
ENV = {**os.environ, "PYTHONPATH": str(Path(schemoe.__file__).parents[1])}


def _losses(log: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _pool_train(ranks, *extra: str) -> None:
    """The same 2-rank run as TRAIN with `extra`, on the session's ranks: the runs compared with
    an interrupted one need no launcher of their own (the interrupted run has one)."""
    ranks(2).run(train_on, ["--steps", str(STEPS), *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ranks) -> dict[int, float]:
    """Losses of the uninterrupted run, steps 1..REFERENCE."""
    log = tmp_path_factory.mktemp("reference") / "log.jsonl"
    _pool_train(ranks, "--stop-after", str(REFERENCE), "--log-file", str(log))
    return _losses(log)


def _interrupt(tmp: Path, how: str, *extra: str) -> tuple[int, str, float, int]:
    """Start a run saving every step into tmp/ckpt; once step 3's checkpoint exists, `how`:
    "sigint" / "sigterm" (to the launcher's PID),
    "kill-rank" (SIGKILL to rank 1), "stall-rank" (SIGSTOP to rank 1). Returns (exit status,
    stderr, seconds from the signal to every process gone, the step of `latest`)."""
    ckpt = tmp / "ckpt"
    cmd = [*TRAIN, "--save", str(ckpt), "--save-every", "1", "--log-file", str(tmp / "a.jsonl")]
    p = subprocess.Popen([*cmd, *extra], env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "step-00000003").is_dir():
            assert p.poll() is None and time.monotonic() < deadline, "no step-3 checkpoint"
            time.sleep(0.02)
        ranks = ranks_of(p.pid)
        assert len(ranks) == 2
        t0 = time.monotonic()
        if how in ("sigint", "sigterm"):
            p.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
        else:
            os.kill(ranks[1], signal.SIGKILL if how == "kill-rank" else signal.SIGSTOP)
        _, err = p.communicate(timeout=60)
        left = gone_within(ranks, 10.0)
        took = time.monotonic() - t0
        assert left == [], f"ranks {left} outlived the launcher"
    finally:
        reap(p, ranks)
    latest = (ckpt / "latest").read_text().strip()
    return p.returncode, err, took, int(latest.split("-")[1])


def _one_line(err: str) -> str:
    """The launcher's line; the only `schemoe train:` line, and no rank printed a traceback."""
    assert "Traceback" not in err, err
    said = [x for x in err.splitlines() if x.startswith("schemoe train:")]
    assert len(said) == 1, err
    return said[0]


def _resume_matches(tmp: Path, saved: int, reference: dict[int, float], ranks) -> None:
    """--resume from the last checkpoint: the next two steps' losses equal the reference's."""
    assert saved + 2 <= REFERENCE, f"stopped too late to compare (step {saved})"
    log = tmp / "resumed.jsonl"
    extra = ("--resume", str(tmp / "ckpt"), "--stop-after", str(saved + 2), "--log-file", str(log))
    _pool_train(ranks, *extra)
    resumed = _losses(log)
    assert sorted(resumed) == [saved + 1, saved + 2]
    assert resumed == {s: reference[s] for s in resumed}  # bitwise, 2 ranks


def _stopped_line(sig: str, line: str, tmp: Path, saved: int) -> None:
    m = re.fullmatch(
        rf"schemoe train: interrupted by {sig} at step (\d+); last checkpoint: (.+)", line
    )
    assert m, line
    assert Path(m.group(2)) == tmp / "ckpt" / f"step-{saved:08d}"
    assert int(m.group(1)) >= saved


def test_sigint_to_the_launcher_stops_both_ranks_in_one_line_and_the_resume_matches(
    tmp_path, reference, ranks
):
    code, err, took, saved = _interrupt(tmp_path, "sigint")
    assert code == 130, err
    _stopped_line("SIGINT", _one_line(err), tmp_path, saved)
    assert took < 10
    _resume_matches(tmp_path, saved, reference, ranks)


def test_processes_started_inside_sigint_ignored_ignore_sigint_so_ctrl_c_reaches_the_launcher():
    code = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    probe = [sys.executable, "-c", code]
    with lifeline.sigint_ignored():
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    outside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert inside.strip() == "True"
    assert outside.strip() == "False"


def test_a_rank_killed_by_sigkill_is_named_with_its_signal_and_the_resume_matches(
    tmp_path, reference, ranks
):
    code, err, took, saved = _interrupt(tmp_path, "kill-rank")
    assert code == 2, err
    assert _one_line(err) == (
        "schemoe train: error: distributed run failed: rank 1 was killed by signal SIGKILL "
        "(the kernel's OOM killer sends it when memory runs out; `dmesg` says if it did)"
    )
    assert took < 10
    _resume_matches(tmp_path, saved, reference, ranks)


def test_a_stalled_rank_ends_the_run_at_the_collective_timeout_naming_both_ranks(tmp_path):
    code, err, took, _ = _interrupt(tmp_path, "stall-rank", "--timeout", "3")
    assert code == 2, err
    line = _one_line(err)
    assert re.match(
        r"schemoe train: error: distributed run failed: rank 0 raised PeerFailure: rank 0, step "
        r"\d+ \(\w+\)( in \S+:\d+ \(\w+\))?: a collective( \(\w+\))? did not complete within "
        r"the 3s timeout \(--timeout\)",
        line,
    ), line
    assert line.endswith("[rank 1 reported nothing within 3s of it: stalled; stopped]"), line
    assert took < 3 + 10


# ------------------------------------------------------------------ spawn, in process


def _fails(rank: int, world: int, how: str) -> None:
    if rank == 1:
        if how == "exits":
            os._exit(3)
        raise {"raises": ValueError, "bug": KeyError}[how]("boom")
    dist.barrier()  # rank 0 waits for rank 1, and fails when rank 1's connection closes


@pytest.mark.parametrize(
    ("how", "line"),
    [
        ("raises", "distributed run failed: rank 1 raised ValueError: boom"),
        ("bug", "distributed run failed: rank 1 raised KeyError: 'boom'"),
        ("exits", "distributed run failed: rank 1 exited with status 3 without reporting an error or a result"),
    ],
    ids=["raises", "bug", "exits"],
)  # fmt: skip
def test_spawn_names_the_rank_that_failed_once_and_not_the_peers_that_lost_it(how, line, capfd):
    with pytest.raises(RankFailure) as e:
        spawn(_fails, 2, how, timeout=30)
    assert str(e.value) == line
    assert e.value.rank == 1
    err = capfd.readouterr().err
    if how == "bug":  # not an error a user causes: its traceback is shown
        assert "--- rank 1 traceback ---" in err and "KeyError: 'boom'" in err, err
    else:
        assert "Traceback" not in err, err


def test_interrupted_is_a_system_exit_with_status_128_plus_the_signal():
    e = lifeline.Interrupted(signal.SIGINT, " at step 4")
    assert isinstance(e, SystemExit) and e.code == 130
    assert str(e) == "interrupted by SIGINT at step 4"
    assert lifeline.Interrupted(signal.SIGTERM).code == 143


def test_a_stop_request_inside_stop_deferred_is_raised_when_the_block_ends():
    old = signal.getsignal(signal.SIGTERM)
    lifeline.stop_on_sigterm()
    done = []
    try:
        with pytest.raises(lifeline.Stopped), lifeline.stop_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, and must not raise yet
            done.append(True)
        assert done == [True]
        with lifeline.stop_deferred():  # raised once: a later block ends quietly
            pass
    finally:
        signal.signal(signal.SIGTERM, old)
