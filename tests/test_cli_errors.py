"""Every bad command-line input is one line on stderr naming the flag typed and its value, exit
status 2, no traceback, and nothing started: each case runs `schemoe.cli.main` in this process
with every way of starting a rank or a process (torch.multiprocessing, multiprocessing,
subprocess, schemoe's spawn and testbed launchers) replaced by one that fails the test."""

from __future__ import annotations

import multiprocessing.process
import subprocess
from pathlib import Path

import pytest
import torch.multiprocessing

from schemoe import cli
from schemoe.dist import launch
from schemoe.profile import cli as profile_cli
from schemoe.testbed import launch as testbed_launch
from schemoe.testbed import netns
from schemoe.train import command as train_loop

# (argv, the flag the line names, the value it names); {tmp} is the case's tmp_path.
CASES = {
    # schemoe train
    "train ep-size below one": (["train", "--ep-size", "-1"], "--ep-size", "-1"),
    "train no experts": (["train", "--experts", "0"], "--experts", "0"),
    "train replan capacity factors dropless": (
        ["train", "--replan", "--capacity-factor", "0", "--replan-capacity-factors", "1,2"],
        "--replan-capacity-factors",
        "1,2",
    ),
    "train replan capacity factors without replan": (
        ["train", "--replan-capacity-factors", "0.5"],
        "--replan-capacity-factors",
        "0.5",
    ),
    "train replan max drop": (["train", "--replan-max-drop", "1"], "--replan-max-drop", "1"),
    "bench replan capacity factors dropless": (
        ["bench", "replan", "--capacity-factors", "1,2"],
        "--capacity-factors",
        "1,2",
    ),
    "train option of no compressor": (
        ["train", "--compressor-option", "foo.bar=1"],
        "--compressor-option",
        "foo.bar=1",
    ),
    "train option of a compressor not chosen": (
        ["train", "--compressor", "int8", "--compressor-option", "fp16.x=1"],
        "--compressor-option",
        "fp16.x=1",
    ),
    "train option of zfp while int8 runs": (
        ["train", "--compressor", "int8", "--compressor-option", "zfp.rate=4"],
        "--compressor-option",
        "zfp.rate=4",
    ),
    "train option value that is no number": (
        ["train", "--compressor", "zfp", "--compressor-option", "zfp.rate=abc"],
        "--compressor-option",
        "zfp.rate=abc",
    ),
    "train dedup in capacity mode": (["train", "--dedup"], "--capacity-factor", "1.25"),
    "train dedup with weights on the input": (
        ["train", "--dedup", "--capacity-factor", "0", "--weights-on", "input"],
        "--weights-on",
        "input",
    ),
    "train no steps": (["train", "--steps", "0"], "--steps", "0"),
    "train lr nan": (["train", "--lr", "nan"], "--lr", "nan"),
    "train no chunks": (["train", "--chunks", "0"], "--chunks", "0"),
    "train top-k zero": (["train", "--top-k", "0"], "--top-k", "0"),
    "train negative capacity factor": (
        ["train", "--capacity-factor", "-1"],
        "--capacity-factor",
        "-1",
    ),
    "train empty batch": (["train", "--batch", "0"], "--batch", "0"),
    "train empty sequences": (["train", "--seq-len", "0"], "--seq-len", "0"),
    "train no micro-batches": (["train", "--grad-accum", "0"], "--grad-accum", "0"),
    "train no threads": (["train", "--threads", "0"], "--threads", "0"),
    "train no ranks": (["train", "--nproc", "0"], "--nproc", "0"),
    "train seed past 2**32": (
        ["train", "--seed", "1180591620717411303424"],
        "--seed",
        "1180591620717411303424",
    ),
    "train negative seed": (["train", "--seed", "-1"], "--seed", "-1"),
    "train timeout below a second": (["train", "--timeout", "1e-9"], "--timeout", "1e-09"),
    "train threads past the cores": (["train", "--threads", "100000"], "--threads", "100000"),
    "train warmup past the steps": (
        ["train", "--warmup", "1000", "--steps", "3"],
        "--warmup",
        "1000",
    ),
    "train infinite z-loss weight": (["train", "--z-loss-weight", "inf"], "--z-loss-weight", "inf"),
    "train negative trials": (["train", "--policy", "auto", "--trials", "-1"], "--trials", "-1"),
    "train empty shortlist": (
        ["train", "--policy", "auto", "--shortlist", "0"],
        "--shortlist",
        "0",
    ),
    "train corpus of 1200 bytes": (
        ["train", "--corpus", "{tmp}/small.txt"],
        "--corpus",
        "{tmp}/small.txt",
    ),
    "train empty corpus": (["train", "--corpus", "{tmp}/empty.txt"], "--corpus", "{tmp}/empty.txt"),
    "train corpus folder without text files": (
        ["train", "--corpus", "{tmp}/nothing"],
        "--corpus",
        "{tmp}/nothing",
    ),
    "train binary corpus": (
        ["train", "--corpus", "{tmp}/binary.bin"],
        "--corpus",
        "{tmp}/binary.bin",
    ),
    "train corpus file not utf-8": (
        ["train", "--corpus", "{tmp}/latin1.txt"],
        "--corpus",
        "{tmp}/latin1.txt",
    ),
    "train more chunks than rows": (["train", "--chunks", "100000"], "--chunks", "100000"),
    "train fastermoe chunks past the ranks": (
        ["train", "--policy", "fastermoe", "--chunks", "5"],
        "--chunks",
        "5",
    ),
    "train experts past the memory": (
        ["train", "--experts", "100000000"],
        "--experts",
        "100000000",
    ),
    "train option of zfp not named": (
        ["train", "--compressor-option", "zfp.rate=abc"],
        "--compressor-option",
        "zfp.rate=abc",
    ),
    # schemoe bench a2a
    "a2a unknown algorithm": (["bench", "a2a", "--algorithms", "nope"], "--algorithms", "nope"),
    "a2a size zero": (["bench", "a2a", "--sizes", "64K,0"], "--sizes", "0"),
    "a2a no repeats": (["bench", "a2a", "--repeats", "0"], "--repeats", "0"),
    "a2a negative warmup": (["bench", "a2a", "--warmup", "-1"], "--warmup", "-1"),
    "a2a no ranks": (["bench", "a2a", "--nproc", "0"], "--nproc", "0"),
    "a2a no time": (["bench", "a2a", "--timeout", "0"], "--timeout", "0"),
    # schemoe bench layer
    "layer model-dim zero": (["bench", "layer", "--model-dim", "0"], "--model-dim", "0"),
    "layer hidden-dim negative": (["bench", "layer", "--hidden-dim", "-1"], "--hidden-dim", "-1"),
    "layer experts not dividing the ranks": (
        ["bench", "layer", "--nproc", "2", "--experts", "3"],
        "--experts",
        "3",
    ),
    "layer top-k zero": (["bench", "layer", "--top-k", "0"], "--top-k", "0"),
    "layer top-k above the experts": (
        ["bench", "layer", "--nproc", "2", "--top-k", "5"],
        "--top-k",
        "5",
    ),
    "layer capacity factor nan": (
        ["bench", "layer", "--capacity-factor", "nan"],
        "--capacity-factor",
        "nan",
    ),
    "layer negative warmup": (["bench", "layer", "--warmup", "-1"], "--warmup", "-1"),
    "layer no repeats": (["bench", "layer", "--repeats", "0"], "--repeats", "0"),
    "layer no policies": (["bench", "layer", "--policies", ""], "--policies", "''"),
    "layer unknown policy": (["bench", "layer", "--policies", "nope"], "--policies", "nope"),
    "layer unknown compressor": (
        ["bench", "layer", "--compressors", "none/nope"],
        "--compressors",
        "nope",
    ),
    "layer chunk zero": (["bench", "layer", "--chunks", "1,0"], "--chunks", "1,0"),
    "layer no tokens": (["bench", "layer", "--tokens", "0"], "--tokens", "0"),
    "layer ranks-per-node not dividing": (
        ["bench", "layer", "--nproc", "2", "--ranks-per-node", "3"],
        "--ranks-per-node",
        "3",
    ),
    "layer timeout below a second": (["bench", "layer", "--timeout", "0.5"], "--timeout", "0.5"),
    "layer more chunks than rows": (
        ["bench", "layer", "--chunks", "1,100000"],
        "--chunks",
        "100000",
    ),
    "layer fastermoe chunks past the ranks": (
        ["bench", "layer", "--policies", "fastermoe", "--chunks", "3"],
        "--chunks",
        "3",
    ),
    "layer experts past the memory": (
        ["bench", "layer", "--experts", "100000000"],
        "--experts",
        "100000000",
    ),
    "layer predict without the default profile": (
        ["bench", "layer", "--predict", "--profile", "{tmp}/none.json"],
        "schemoe profile",
        "{tmp}/none.json",
    ),
    "layer predict without a profile": (
        ["bench", "layer", "--predict", "--profile", "{tmp}/profiles.json"],
        "--predict",
        "{tmp}/profiles.json",
    ),
    # schemoe bench step (the launch flags, and step's own through bench/cli.py's table)
    "step no ranks": (["bench", "step", "--nproc", "0"], "--nproc", "0"),
    "step negative timeout": (["bench", "step", "--timeout", "-1"], "--timeout", "-1"),
    "step model-dim zero": (["bench", "step", "--model-dim", "0"], "--model-dim", "0"),
    "step experts not dividing the ranks": (
        ["bench", "step", "--nproc", "2", "--experts", "3"],
        "--experts",
        "3",
    ),
    "step more chunks than rows": (["bench", "step", "--chunks", "100000"], "--chunks", "100000"),
    "step experts past the memory": (
        ["bench", "step", "--experts", "100000000"],
        "--experts",
        "100000000",
    ),
    "step window zero": (["bench", "step", "--grad-windows", "0"], "--grad-windows", "0"),
    "step empty batch": (["bench", "step", "--batch", "0"], "--batch", "0"),
    # schemoe bench compress
    "compress no rows": (["bench", "compress", "--rows", "0"], "--rows", "0"),
    "compress negative cols": (["bench", "compress", "--cols", "-1"], "--cols", "-1"),
    "compress unknown compressor": (
        ["bench", "compress", "--compressors", "nope"],
        "--compressors",
        "nope",
    ),
    "compress unknown device": (["bench", "compress", "--device", "tpu"], "--device", "tpu"),
    "compress no repeats": (["bench", "compress", "--repeats", "0"], "--repeats", "0"),
    # schemoe profile, simulate
    "profile no ranks": (["profile", "--nproc", "0"], "--nproc", "0"),
    "profile ranks-per-node not dividing": (
        ["profile", "--nproc", "4", "--ranks-per-node", "3"],
        "--ranks-per-node",
        "3",
    ),
    "profile experts not dividing": (
        ["profile", "--nproc", "4", "--experts", "3"],
        "--experts",
        "3",
    ),
    "profile link rate without a unit": (
        ["profile", "--link-rate", "fast"],
        "--link-rate",
        "fast",
    ),
    "profile no tokens": (["profile", "--tokens", "0"], "--tokens", "0"),
    "profile timeout below a second": (["profile", "--timeout", "0.001"], "--timeout", "0.001"),
    "profile experts past the memory": (
        ["profile", "--experts", "100000000"],
        "--experts",
        "100000000",
    ),
    "profile no time": (["profile", "--timeout", "0"], "--timeout", "0"),
    "simulate no layers": (["simulate", "--layers", "0"], "--layers", "0"),
    "simulate unknown preset": (["simulate", "--preset", "nope"], "--preset", "nope"),
    "simulate infinite capacity": (
        ["simulate", "--capacity-factor", "inf"],
        "--capacity-factor",
        "inf",
    ),
    "simulate missing profile": (
        ["simulate", "--profile", "{tmp}/none.json"],
        "--profile",
        "{tmp}/none.json",
    ),
    "validate missing bench output": (
        ["validate", "{tmp}/bench.txt"],
        "RUNS",
        "{tmp}/bench.txt",
    ),
    # schemoe testbed
    "testbed up no nodes": (
        ["testbed", "up", "--nodes", "0", "--rate", "1gbit"],
        "--nodes",
        "0",
    ),
    "testbed up rate without unit": (
        ["testbed", "up", "--nodes", "2", "--rate", "fast"],
        "--rate",
        "fast",
    ),
    "testbed up bad latency": (
        ["testbed", "up", "--nodes", "2", "--rate", "1gbit", "--latency", "soon"],
        "--latency",
        "soon",
    ),
    "testbed up ranks-per-node without intra-rate": (
        ["testbed", "up", "--nodes", "2", "--rate", "1gbit", "--ranks-per-node", "2"],
        "--ranks-per-node",
        "2",
    ),
    "testbed run no ranks": (
        ["testbed", "run", "--ranks-per-node", "0", "--", "-m", "schemoe.cli"],
        "--ranks-per-node",
        "0",
    ),
    "testbed run no time": (
        ["testbed", "run", "--ranks-per-node", "1", "--timeout", "0", "--", "-m", "x"],
        "--timeout",
        "0",
    ),
    # schemoe export (checkpoints)
    "export no checkpoint": (
        ["export", "{tmp}", "{tmp}/out.pt"],
        "CHECKPOINT",
        "{tmp}",
    ),
    "export missing folder": (
        ["export", "{tmp}/missing", "{tmp}/out.pt"],
        "CHECKPOINT",
        "{tmp}/missing",
    ),
}


class Started(BaseException):
    """Raised by a launcher a bad input reached (BaseException: no error guard catches it)."""


@pytest.fixture
def nothing_starts(monkeypatch):
    """Every launcher of ranks or processes fails the test if called."""

    def refuse(*args, **kwargs):
        raise Started(f"a process was started: {args[:2]!r}")

    for owner, name in (
        (torch.multiprocessing, "spawn"),
        (torch.multiprocessing, "start_processes"),
        (multiprocessing.process.BaseProcess, "start"),
        (subprocess, "Popen"),
        (launch, "spawn"),
        (train_loop, "spawn"),
        (profile_cli, "spawn"),
        (testbed_launch, "run"),
        (netns, "up"),
    ):
        monkeypatch.setattr(owner, name, refuse)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _corpora(tmp: Path) -> None:
    """The files the corpus cases name: 1200 bytes of text, an empty file, a binary (NUL bytes),
    latin-1 text (not UTF-8), a folder without .py/.txt/.md files."""
    (tmp / "small.txt").write_text("a line of text\n" * 80)
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "binary.bin").write_bytes(bytes(range(256)) * 100)
    (tmp / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 2000)
    (tmp / "nothing").mkdir()
    (tmp / "nothing" / "data.bin").write_bytes(b"\0" * 20_000)


@pytest.mark.parametrize(("argv", "flag", "value"), CASES.values(), ids=list(CASES))
def test_a_bad_input_is_one_line_naming_the_flag_and_value_and_starts_nothing(
    argv, flag, value, tmp_path, capsys, nothing_starts
):
    _corpora(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    value = value.replace("{tmp}", str(tmp_path))
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert flag in err and value in err, err
    assert out == ""
