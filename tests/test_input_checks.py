"""The input checks behind `schemoe train`, `bench` and `profile` (train/checks.py, cliargs'
shared flag table, the corpus reader): hand-computed sizes, the corpus rules, and one flag
refused in the same words by every command that has it."""

from __future__ import annotations

import sysconfig

import pytest

from schemoe import cli
from schemoe.cliargs import FLAG_CHECKS, flag_problem
from schemoe.config import GateConfig
from schemoe.train import checks
from schemoe.train.config import TrainConfig
from schemoe.train.model import corpus_files, read_corpus, text_problem
from train_cases import tiny


def _error_line(argv: list[str], capsys) -> str:
    """The error message of `schemoe ARGV` after its "PROG: error: " prefix."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err.split(": error: ", 1)[1]


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--timeout", "0.5"],
        ["bench", "layer", "--timeout", "0.5"],
        ["bench", "a2a", "--timeout", "0.5"],
        ["profile", "--timeout", "0.5"],
    ],
    ids=["train", "bench layer", "bench a2a", "profile"],
)
def test_a_timeout_below_one_second_is_refused_in_the_same_words_by_every_command(argv, capsys):
    want = flag_problem("--timeout", 0.5)
    assert want and "got 0.5" in want
    assert _error_line(argv, capsys).strip() == want


def test_a_seed_past_two_to_the_32_is_refused_by_the_python_api_naming_the_flag():
    want = "--seed must be >= 0 and <= 4294967295, got 1180591620717411303424"
    with pytest.raises(ValueError, match=want):
        TrainConfig(seed=2**70, device="cpu")


def test_an_int_past_floats_range_is_out_of_range_not_an_overflow_error():
    assert "got 1" in flag_problem("--seed", 10**400)


def test_the_shortlist_error_says_trials_zero_is_how_to_skip_timing_and_trials_zero_is_accepted():
    line = flag_problem("--shortlist", 0)
    assert "--trials 0" in line and "got 0" in line
    assert tiny("--policy", "auto", "--trials", "0").trials == 0


@pytest.mark.parametrize(("warmup", "ok"), [("2", True), ("3", False), ("1000", False)])
def test_a_warmup_as_long_as_the_run_is_refused_naming_both_flags(warmup, ok):
    if ok:
        tiny("--warmup", warmup, "--steps", "3")
        return
    with pytest.raises(ValueError, match=f"--warmup {warmup} must be < --steps 3"):
        tiny("--warmup", warmup, "--steps", "3")


def test_text_problem_finds_a_nul_byte_and_a_byte_that_is_not_utf8_at_its_offset():
    assert text_problem(b"ab\0c", utf8=False) == (
        "it holds a NUL byte at offset 2 (a binary file?)"
    )
    assert text_problem(b"ab\xffc", utf8=True) == "byte 0xff at offset 2 is not UTF-8"
    assert text_problem(b"ab\xffc", utf8=False) is None  # legacy encodings are text
    assert text_problem("x\u00e9".encode()[:-1], utf8=True) is None  # a character cut at the end


def test_a_corpus_folder_takes_legacy_encodings_but_names_a_file_with_nul_bytes(tmp_path):
    (tmp_path / "a.py").write_bytes("# caf\u00e9\n".encode("latin-1") * 2000)
    assert len(read_corpus(str(tmp_path), 100_000)) == 7 * 2000
    (tmp_path / "b.txt").write_bytes(b"x\0" * 10)
    with pytest.raises(ValueError, match=r"corpus file '.*b\.txt' is not text: .*NUL byte at"):
        read_corpus(str(tmp_path), 100_000)


def test_the_default_corpus_is_the_stdlib_without_installed_packages(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    for rel in ("os.py", "json/__init__.py", "site-packages/torch/x.py", "dist-packages/y.txt"):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(rel)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    root, files = corpus_files(None)
    assert [f.relative_to(root).as_posix() for f in files] == ["json/__init__.py", "os.py"]
    named = corpus_files(str(lib))[1]  # a folder the user names is read whole
    assert len(named) == 4


def test_a_corpus_read_only_up_to_corpus_bytes_is_not_refused_for_what_comes_after(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"text " * 4000 + b"\0\0\0")
    assert len(read_corpus(str(f), 20_000)) == 20_000


def test_an_empty_corpus_is_blamed_on_the_corpus_not_on_seq_len(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    cfg = tiny("--corpus", str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError) as e:
        cfg.validate(2)
    assert "--corpus" in str(e.value) and "is empty" in str(e.value)
    assert "--seq-len" not in str(e.value)


def test_moe_layer_params_count_the_gate_and_the_local_experts_by_hand():
    # E=8, M=4, H=6 on 2 ranks: gate 8*4 = 32; 4 local experts x 2*4*6 = 192.
    assert checks.moe_layer_params(4, 6, 8, 2) == 32 + 192
    # swiglu has three matrices; biases add H + M per expert; 3 experts on 2 ranks: 2 local.
    assert checks.moe_layer_params(4, 6, 3, 2, swiglu=True, bias=True) == 12 + 2 * (72 + 10)


def test_fits_in_memory_refuses_with_the_estimate_and_the_limit(monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda: 2**30)  # 1 GiB
    checks.fits_in_memory(2**24, 16, 4, "--experts 8", held="x")  # 4 x 256 MiB = 1 GiB: fits
    with pytest.raises(ValueError) as e:
        checks.fits_in_memory(2**24, 16, 5, "--experts 8", held="x")
    msg = str(e.value)
    assert msg.startswith("--experts 8: 16,777,216 parameters per rank need ~0.2 GiB")
    assert "x 5 local ranks = 1.2 GiB, more than the 1.0 GiB" in msg


def test_available_memory_reads_a_positive_number_of_bytes():
    assert checks.available_memory() > 0


@pytest.mark.parametrize(
    ("chunks", "f", "refused"),
    [(80, 1.25, False), (81, 1.25, True), (128, 0.0, False), (129, 0.0, True)],
)
def test_chunks_are_refused_past_the_rows_an_expert_takes(chunks, f, refused):
    # T = 128 tokens, k = 2, E = 4: C = ceil(1.25 * 2 * 128 / 4) = 80; dropless: at most T.
    gate = GateConfig(num_experts=4, top_k=2, capacity_factor=f)
    if not refused:
        checks.check_chunk_rows(chunks, "schemoe", gate, 128, 2, "--tokens 128")
        return
    with pytest.raises(ValueError, match=f"--chunks {chunks} is more than the"):
        checks.check_chunk_rows(chunks, "schemoe", gate, 128, 2, "--tokens 128")


def test_the_peers_partition_refuses_more_chunks_than_ranks_and_auto_is_not_checked():
    gate = GateConfig(num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="--chunks 3 is more than the 2 expert-parallel ranks"):
        checks.check_chunk_rows(3, "fastermoe", gate, 128, 2, "--tokens 128")
    checks.check_chunk_rows(10**6, "auto", gate, 128, 2, "--tokens 128")


def test_threads_past_the_usable_cores_are_refused_not_capped():
    n = checks.usable_cores()
    tiny("--threads", str(n)).validate(2)
    with pytest.raises(ValueError, match=f"--threads {n + 1} is more than the {n} CPU cores"):
        tiny("--threads", str(n + 1)).validate(2)


def test_every_shared_flag_check_has_a_bound_or_refuses_an_empty_list():
    for name, check in FLAG_CHECKS.items():
        assert name.startswith("--")
        assert check.problem(-(10**12)) or check.problem([]), name


def _probes():
    """scripts/probes.py, imported as the harness runs it (scripts/ on the path)."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        return importlib.import_module("probes")
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize(
    ("rc", "err", "timed_out", "verdict"),
    [
        (2, "schemoe train: error: --seed must be >= 0, got -1\n", False, "clear"),
        (0, "", False, "silent"),
        (None, "", True, "hang"),
        (1, "Traceback (most recent call last):\n  ...\nValueError: --seed\n", False, "unclear"),
        (2, "schemoe train: error: bad value\n", False, "unclear"),
        (2, "schemoe train: error: --seed -1\nmore\n", False, "unclear"),
    ],
    ids=["one line naming it", "exit 0", "timeout", "traceback", "names nothing", "two lines"],
)
def test_the_probe_harness_classifies_an_answer_by_its_exit_its_lines_and_what_they_name(
    rc, err, timed_out, verdict
):
    probes = _probes()
    p = probes.Probe("seed", "input", argv=["train"], names=("--seed", "-1"))
    assert probes.classify(p, rc, err, timed_out)[0] == verdict
