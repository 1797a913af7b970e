"""`schemoe train` and `schemoe export` check every argument before a rank starts: bad input is
exit status 2 and one error line naming the flag and the value, never a traceback per rank. The
checks are TrainConfig's (one path); the MoEConfig's errors are spelled with the flags."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from schemoe import cli
from schemoe.train import loop as T
from schemoe.train.config import MOE_FLAGS, TrainConfig, flag, spelled_with_flags
from train_cases import TINY, tiny

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
    "timeout 0": (["--timeout", "0"], "--timeout must be >= 1 and <= 1e+09 and finite (seconds"),
    "timeout -5": (["--timeout", "-5"], "--timeout must be >= 1 and <= 1e+09 and finite (seconds"),
    "timeout inf": (
        ["--timeout", "inf"],
        "--timeout must be >= 1 and <= 1e+09 and finite (seconds",
    ),
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
    "top-k above experts": (["--top-k", "9"], "--top-k 9 must be <= --experts 4"),
    "ep-size -1": (["--ep-size", "-1"], "--ep-size must be >= 1, got -1"),
    "ep-size not dividing ranks": (["--ep-size", "3", "--experts", "6"], "--ep-size 3 must divide"),
    "experts 0": (["--experts", "0"], "--experts must be >= 1, got 0"),
    "noise-std -1": (["--noise-std", "-1"], "--noise-std must be >= 0.0, got -1.0"),
    "aux-loss-weight nan": (["--aux-loss-weight", "nan"], "--aux-loss-weight must be >= 0.0"),
    "bucket-mb 0": (["--bucket-mb", "0"], "--bucket-mb must be > 0 and finite, got 0"),
    "grad-algorithm with ddp": (["--grad-algorithm", "hier"], "--grad-algorithm hier needs"),
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
    "unknown policy": (["--policy", "nope"], "--policy: unknown schedule policy 'nope'"),
    "unknown algorithm": (
        ["--algorithm", "nope"],
        "--algorithm: unknown all-to-all algorithm 'nope'",
    ),
    "unknown compressor": (
        ["--compressor-backward", "nope"],
        "--compressor-backward: unknown compressor 'nope'",
    ),
    "bad compressor option": (["--compressor-option", "zfp"], "NAME.KEY=VALUE, got 'zfp'"),
    # The option's own message is the compression tier's; train puts the flag in front.
    "option the compressor does not take": (
        ["--compressor", "zfp", "--compressor-option", "zfp.mode=fixed"],
        "error: --compressor-option: compressor option zfp.mode=fixed",
    ),
    "option of an unknown compressor": (
        ["--compressor-option", "zfpp.rate=4"],
        "error: --compressor-option: compressor option zfpp.rate=4: no compressor 'zfpp'",
    ),
    "option of a compressor the run does not use": (
        ["--compressor", "int8", "--compressor-option", "zfp.rate=4"],
        "error: --compressor-option: compressor option zfp.rate=4 is for zfp",
    ),
    "capacity-factor inf": (
        ["--capacity-factor", "inf"],
        "--capacity-factor must be >= 0 and finite (0 for dropless), got inf",
    ),
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


def test_every_moe_config_field_maps_to_a_flag_of_schemoe_train():
    settings = {f.name for f in dataclasses.fields(TrainConfig)}
    for section, (cls, names) in MOE_FLAGS.items():
        assert set(names) == {f.name for f in dataclasses.fields(cls)}, section
        assert set(names.values()) <= settings, section
    parser_flags = {d for d in vars(T.parse_args([]))} - {"explicit"}
    assert parser_flags == settings  # one setting per flag, no more, no fewer


@pytest.mark.parametrize(
    ("section", "field"), [(s, f) for s, (_, names) in MOE_FLAGS.items() for f in names]
)
def test_an_moe_config_error_is_spelled_with_the_flags(section, field):
    names = MOE_FLAGS[section][1]
    said = spelled_with_flags(
        ValueError(f"{field}=3 must be <= {field} or {section}.{field}"), names, section
    )
    want = flag(names[field])
    assert str(said) == f"{want} 3 must be <= {want} or {want}"


def test_the_config_is_frozen_and_its_defaults_are_the_command_lines():
    cfg = TrainConfig(device="cpu")
    assert cfg == TrainConfig.from_args(T.parse_args(["--device", "cpu"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg, micro_chunks=2).micro_chunks == 2 and cfg.micro_chunks == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"steps": "3"}, TypeError, "--steps must be int, got str '3'"),
        ({"renormalize": 1}, TypeError, "--renormalize must be bool"),
        ({"batch": True}, TypeError, "--batch must be int"),
        ({"device": "tpu"}, ValueError, "--device must be one of ('cpu', 'cuda'), got 'tpu'"),
        ({"compressor_option": ["zfp"]}, ValueError, "NAME.KEY=VALUE, got 'zfp'"),
    ],
)
def test_a_config_built_in_python_is_checked_as_the_command_line_is(kwargs, error, text):
    with pytest.raises(error) as e:
        TrainConfig(**{"device": "cpu", **kwargs})
    assert text in str(e.value)


def test_the_rank_count_checks_run_in_validate():
    cfg = TrainConfig(device="cpu", top_k=3, corpus_bytes=200_000)  # E: 2 per rank by default
    cfg.validate(2)  # E = 4
    with pytest.raises(ValueError, match="--top-k 3 must be <= --experts 2"):
        cfg.validate(1)  # E = 2
    with pytest.raises(ValueError, match="--top-k 3 must be <= --experts 2"):
        tiny("--top-k", "3", "--experts", "2")


def test_an_arguments_file_stands_for_its_flags_and_later_flags_override_it(tmp_path):
    f = tmp_path / "run.args"
    f.write_text("# a configuration\n--steps 3 --layers 2  # two blocks\n--top-k 1\n")
    a = T.parse_args([f"@{f}", "--steps", "5"])
    cfg = TrainConfig.from_args(a)
    assert (cfg.steps, cfg.layers, cfg.top_k) == (5, 2, 1)
    assert {"steps", "layers", "top_k"} <= set(a.explicit)
