"""`schemoe train` and `schemoe export` check every argument before a rank starts: bad input is
exit status 2 and one error line naming the value, never a traceback per rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

from schemoe import cli
from train_cases import TINY

BASE = [*TINY, "--nproc", "2", "--steps", "2"]


def _no_ckpt_behind_latest(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "latest").write_text("step-00000099")
    return str(d)


def _a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("not a folder")
    return str(f)


# (flags, builder of a path argument or None, text the error line must contain)
CASES = {
    "log-every 0": (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    "min-lr-ratio -3": (["--min-lr-ratio", "-3"], "--min-lr-ratio must be >= 0 and <= 1, got -3"),
    "min-lr-ratio 2": (["--min-lr-ratio", "2"], "--min-lr-ratio must be >= 0 and <= 1, got 2"),
    "timeout 0": (["--timeout", "0"], "--timeout must be > 0 and <= 1e+09, got 0"),
    "timeout -5": (["--timeout", "-5"], "--timeout must be > 0 and <= 1e+09, got -5"),
    "timeout inf": (["--timeout", "inf"], "--timeout must be > 0 and <= 1e+09, got inf"),
    "threads 0": (["--threads", "0"], "--threads must be >= 1, got 0"),
    "nproc 0": (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    "steps 0": (["--steps", "0"], "--steps must be >= 1, got 0"),
    "lr 0": (["--lr", "0"], "--lr must be > 0 and finite, got 0"),
    "lr nan": (["--lr", "nan"], "--lr must be > 0 and finite, got nan"),
    "clip -1": (["--clip", "-1"], "--clip must be >= 0 and finite, got -1"),
    "corpus-bytes 10": (["--corpus-bytes", "10"], "--corpus-bytes must be >= 10000, got 10"),
    "heads not dividing dim": (["--heads", "3"], "--model-dim 32 must be divisible by --heads 3"),
    "experts not dividing ranks": (["--experts", "3"], "--experts 3 must be divisible by the 2"),
    "ranks-per-node": (["--ranks-per-node", "3"], "--ranks-per-node 3 must divide the 2 ranks"),
    "top-k above experts": (["--top-k", "9"], "top_k"),
    "micro-chunks 0": (
        ["--micro-chunks", "0"],
        "--micro-chunks must be an int >= 1 or auto, got 0",
    ),
    "micro-chunks x": (
        ["--micro-chunks", "x"],
        "--micro-chunks must be an int >= 1 or auto, got 'x'",
    ),
    "micro-chunks not dividing batch": (
        ["--batch", "4", "--micro-chunks", "3"],
        "--batch 4 must be divisible by --micro-chunks 3",
    ),
    "micro-chunks with policy auto": (
        ["--micro-chunks", "2", "--batch", "4", "--policy", "auto"],
        "--micro-chunks 2 needs a fixed --policy, got 'auto'",
    ),
    "unknown policy": (["--policy", "nope"], "unknown schedule policy 'nope'"),
    "unknown algorithm": (["--algorithm", "nope"], "unknown all-to-all algorithm 'nope'"),
    "unknown compressor": (["--compressor-backward", "nope"], "unknown compressor 'nope'"),
    "bad compressor option": (["--compressor-option", "zfp"], "NAME.KEY=VALUE, got 'zfp'"),
    "option the compressor does not take": (
        ["--compressor", "zfp", "--compressor-option", "zfp.mode=fixed"],
        "options {'mode': 'fixed'} do not fit compressor 'zfp'",
    ),
    "capacity-factor inf": (["--capacity-factor", "inf"], "capacity_factor must be finite"),
    "seq-len longer than the corpus": (["--seq-len", "20000"], "--seq-len 20000 is too long"),
    "missing corpus": (["--corpus", "/nonexistent/x"], "corpus path '/nonexistent/x' does not"),
    "missing resume": (["--resume", "/nonexistent/x"], "'/nonexistent/x' holds no checkpoint"),
    "resume whose latest names a missing folder": (
        ["--resume", _no_ckpt_behind_latest],
        "its 'latest' names 'step-00000099', which does not exist",
    ),
    "save under a file": (["--save", lambda p: _a_file(p) + "/ckpt"], "--save '"),
    "save is a file": (["--save", _a_file], "is a file; give a folder"),
    "export under a file": (["--export", lambda p: _a_file(p) + "/m.pt"], "--export '"),
    "export is a folder": (["--export", str], "is a folder; give a file name"),
    "plot under a file": (["--plot", lambda p: _a_file(p) + "/l.png"], "--plot '"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_train_argument_exits_2_with_one_line_before_any_rank_starts(case, tmp_path, capsys):
    flags, want = CASES[case]
    argv = [f(tmp_path) if callable(f) else f for f in flags]
    rc = cli.main(["train", *BASE, *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert out == ""  # no rank printed a step line: none was started
    assert err.startswith("schemoe train: error: ") and err.count("\n") == 1, err
    assert want in err and "Traceback" not in err, err


@pytest.mark.parametrize("case", ["missing folder", "latest names a missing folder"])
def test_bad_export_argument_exits_2_with_one_line(case, tmp_path, capsys):
    src, out_path = "/nonexistent/ckpt", str(tmp_path / "m.pt")
    if case == "latest names a missing folder":
        src = _no_ckpt_behind_latest(tmp_path)
    rc = cli.main(["export", src, out_path])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("schemoe export: error: ") and err.count("\n") == 1, err


def test_the_installed_command_prints_one_line_and_no_traceback_for_bad_input():
    cmd = [sys.executable, "-m", "schemoe", "train", *BASE, "--log-every", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip() == "schemoe train: error: --log-every must be >= 1, got 0"
    assert run.stdout == ""
