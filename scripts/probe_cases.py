"""The probes of scripts/probes.py: what a hostile first week tries, one `Probe` each.

A probe runs `schemoe ARGS` (argv), a Python snippet (code: the API), or a scenario that signals
or kills the processes of a run (action, in scripts/probes.py). `expect` is "fail" (a clear
answer is exit != 0, no traceback, and a stderr line naming every entry of `names`: a string, or
a tuple of alternatives) or "ok" (a documented success: exit 0). `after` looks at what the run
left (a checkpoint that must still resume or export, a .tmp that must be gone) and returns a
verdict ("lost", "unclear") with why, or None.

Placeholders in argv and code: {d} the probe's own folder, {corpus} a 100 kB UTF-8 text corpus
in it (corpus.txt). A probe that `needs` "ckpt" finds in {d}/ck a copy of a 2-rank checkpoint
made once (step-00000002), before its setup runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from train_cases import TINY  # the tests' tiny model, as flags

Names = tuple  # each entry: a string, or a tuple of alternatives


@dataclass
class Probe:
    name: str
    kind: str  # input, api, run, signal, checkpoint, disk
    expect: str = "fail"  # or "ok"
    argv: list[str] | None = None
    code: str | None = None
    names: Names = ()
    forbid: tuple[str, ...] = ()  # text the answer must not contain (blaming the wrong thing)
    one_line: bool = True  # a clear failure is exactly one stderr line
    timeout: float = 90.0
    setup: Callable[[Path], None] | None = None
    after: Callable[[Path, str, str], tuple[str, str] | None] | None = None
    action: dict = field(default_factory=dict)  # signal scenarios: see probes.signal_probe
    needs: tuple[str, ...] = ()  # "ckpt" (the base checkpoint), "root" (mounts a tmpfs)


T = [*TINY, "--corpus", "{corpus}", "--nproc", "1", "--steps", "2"]
T2 = [*TINY, "--corpus", "{corpus}", "--nproc", "2", "--steps", "2"]


def _files(d: Path) -> None:
    (d / "small.txt").write_text("a line of text\n" * 80)  # 1200 bytes
    (d / "empty.txt").write_bytes(b"")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 200)
    (d / "a_file").write_text("not a folder")


def _train(flag_args: list[str], names: Names, *, base=T, **kw) -> Probe:
    label = " ".join(flag_args).replace("{d}/", "")
    return Probe(
        f"train {label}",
        "input",
        argv=["train", *base, *flag_args],
        names=names,
        setup=_files,
        **kw,
    )


def _cmd(argv: list[str], names: Names, **kw) -> Probe:
    label = " ".join(a if a else "''" for a in argv).replace("{d}/", "")
    return Probe(label, "input", argv=argv, names=names, setup=_files, **kw)


def input_probes() -> list[Probe]:
    """Bad values of every kind of flag, for train, bench, profile, simulate and export."""
    t = _train
    return [
        t(["--nproc", "0"], ("--nproc", "0"), base=T[:-4]),
        t(["--steps", "0"], ("--steps", "0"), base=T[:-2]),
        t(["--batch", "0"], ("--batch", "0")),
        t(["--seq-len", "0"], ("--seq-len", "0")),
        t(["--layers", "0"], ("--layers", "0")),
        t(["--heads", "3"], ("--heads", "3")),
        t(["--model-dim", "0"], ("--model-dim", "0")),
        t(["--hidden-dim", "-1"], ("--hidden-dim", "-1")),
        t(["--experts", "3"], ("--experts", "3"), base=T2),
        t(["--top-k", "0"], ("--top-k", "0")),
        t(["--top-k", "9"], ("--top-k", "9")),
        t(["--capacity-factor", "nan"], ("--capacity-factor", "nan")),
        t(["--lr", "nan"], ("--lr", "nan")),
        t(["--lr", "0"], ("--lr", "0")),
        t(["--min-lr-ratio", "2"], ("--min-lr-ratio", "2")),
        t(["--warmup", "-1"], ("--warmup", "-1")),
        t(["--warmup", "1000", "--steps", "3"], ("--warmup", "1000", "--steps")),
        t(["--clip", "-1"], ("--clip", "-1")),
        t(["--seed", str(2**70)], ("--seed", str(2**70))),
        t(["--threads", "100000"], ("--threads", "100000")),
        t(["--timeout", "1e-9"], ("--timeout", ("1e-9", "1e-09"))),
        t(["--compressor", "nope"], ("--compressor", "nope")),
        t(
            ["--compressor", "zfp", "--compressor-option", "zfp.rate=abc"],
            ("--compressor-option", "zfp.rate=abc"),
        ),
        t(
            ["--compressor", "int8", "--compressor-option", "fp16.x=1"],
            ("--compressor-option", "fp16.x=1"),
        ),
        t(["--compressor-option", "noequals"], ("--compressor-option", "noequals")),
        t(["--policy", "nope"], ("--policy", "nope")),
        t(["--policy", "auto", "--shortlist", "0"], ("--shortlist", "0", "--trials 0")),
        t(["--policy", "auto", "--trials", "-1"], ("--trials", "-1")),
        t(["--algorithm", "nope"], ("--algorithm", "nope")),
        t(["--chunks", "100000"], ("--chunks", "100000")),
        t(["--experts", "100000000"], ("--experts", "100000000", "GiB")),
        t(["--corpus", "{d}/small.txt"], ("--corpus", "small.txt", "1200")),
        t(["--corpus", "{d}/empty.txt"], ("--corpus", "empty"), forbid=("--seq-len",)),
        t(["--corpus", "{d}/binary.bin"], ("--corpus", "binary.bin", "not text")),
        t(["--corpus", "{d}/missing"], ("corpus", "missing")),
        t(["--corpus-bytes", "10"], ("--corpus-bytes", "10")),
        t(["--seq-len", "100000"], ("--seq-len", "100000")),
        t(["--micro-chunks", "3"], ("--micro-chunks", "3")),
        t(["--grad-algorithm", "hier"], ("--grad-algorithm", "hier")),
        t(["--save", "{d}/a_file"], ("--save", "a_file")),
        t(["--export", "{d}"], ("--export",)),
        t(["--resume", "{d}/nothing"], ("nothing",)),
        t(["--log-every", "0"], ("--log-every", "0")),
        t(["--eval-every", "-1"], ("--eval-every", "-1")),
        t(["--bucket-mb", "0"], ("--bucket-mb", "0")),
        t(["--device", "tpu"], ("--device", "tpu")),
        t(["--ep-size", "3"], ("--ep-size", "3")),
        t(["--ranks-per-node", "3"], ("--ranks-per-node", "3"), base=T2),
        t(["--stop-after", "-1"], ("--stop-after", "-1")),
        t(["--noise-std", "-1"], ("--noise-std", "-1")),
        t(["--z-loss-weight", "inf"], ("--z-loss-weight", "inf")),
        _cmd(["bench", "layer", "--model-dim", "0"], ("--model-dim", "0")),
        _cmd(["bench", "layer", "--hidden-dim", "-1"], ("--hidden-dim", "-1")),
        _cmd(["bench", "layer", "--experts", "3"], ("--experts", "3")),
        _cmd(["bench", "layer", "--top-k", "0"], ("--top-k", "0")),
        _cmd(["bench", "layer", "--capacity-factor", "nan"], ("--capacity-factor", "nan")),
        _cmd(["bench", "layer", "--warmup", "-1"], ("--warmup", "-1")),
        _cmd(["bench", "layer", "--repeats", "0"], ("--repeats", "0")),
        _cmd(["bench", "layer", "--policies", ""], ("--policies",)),
        _cmd(
            ["bench", "layer", "--predict", "--profile", "{d}/none.json"],
            ("--predict", "none.json", "schemoe profile"),
        ),
        _cmd(["bench", "layer", "--chunks", "1,100000"], ("--chunks", "100000")),
        _cmd(["bench", "layer", "--experts", "100000000"], ("--experts", "100000000", "GiB")),
        _cmd(["bench", "layer", "--timeout", "1e-9"], ("--timeout", ("1e-9", "1e-09"))),
        _cmd(["bench", "a2a", "--sizes", "0"], ("--sizes", "0")),
        _cmd(["bench", "a2a", "--algorithms", "nope"], ("--algorithms", "nope")),
        _cmd(["bench", "step", "--micro-chunks", "3"], ("--micro-chunks", "3")),
        _cmd(["bench", "step", "--experts", "100000000"], ("--experts", "100000000", "GiB")),
        _cmd(["bench", "compress", "--rows", "0"], ("--rows", "0")),
        _cmd(["profile", "--nproc", "0"], ("--nproc", "0")),
        _cmd(["profile", "--experts", "100000000"], ("--experts", "100000000", "GiB")),
        _cmd(["profile", "--timeout", "0.5"], ("--timeout", "0.5")),
        _cmd(["simulate", "--layers", "0"], ("--layers", "0")),
        _cmd(["simulate", "--profile", "{d}/none.json"], ("--profile", "none.json")),
        _cmd(["export", "{d}/nothing", "{d}/out.pt"], ("nothing",)),
    ]


_API = """import sys
sys.argv = ["probe"]
try:
    {stmt}
except (ValueError, TypeError) as e:
    print(f"{{type(e).__name__}}: {{e}}", file=sys.stderr)
    sys.exit(2)
"""


def _api(name: str, stmt: str, names: Names) -> Probe:
    return Probe(f"api {name}", "api", code=_API.format(stmt=stmt), names=names, setup=_files)


def api_probes() -> list[Probe]:
    """The Python API's configs and loaders, as a user would call them."""
    c = "import schemoe.config as c; "
    return [
        _api("num_experts 0", c + "c.GateConfig(num_experts=0)", ("num_experts", "0")),
        _api("top_k 0", c + "c.GateConfig(num_experts=4, top_k=0)", ("top_k", "0")),
        _api("model_dim -1", c + "c.ExpertConfig(model_dim=-1, hidden_dim=8)", ("model_dim", "-1")),
        _api("chunks 0", c + "c.ScheduleConfig(chunks=0)", ("chunks", "0")),
        _api(
            "zfp rate abc",
            "from schemoe import compression; compression.build('zfp', {'zfp': {'rate': 'abc'}})",
            ("rate", "abc"),
        ),
        _api(
            "TrainConfig seed 2**70",
            "from schemoe.train.config import TrainConfig; TrainConfig(seed=2**70, device='cpu')",
            ("--seed",),
        ),
        _api(
            "TrainConfig threads",
            "from schemoe.train.config import TrainConfig; "
            "TrainConfig(threads=100000, device='cpu').validate(1)",
            ("--threads",),
        ),
        _api(
            "TrainConfig warmup",
            "from schemoe.train.config import TrainConfig; "
            "TrainConfig(steps=3, warmup=1000, device='cpu')",
            ("--warmup",),
        ),
        _api(
            "load_corpus binary",
            "from schemoe.train.model import load_corpus; load_corpus('{d}/binary.bin', 10**6)",
            ("binary.bin", "not text"),
        ),
    ]


def _ckpt_step(ck: Path) -> Path:
    return ck / (ck / "latest").read_text().strip()


def _edit(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    """A setup that edits the probe's copy of the checkpoint ({d}/ck) with fn(its step folder)."""
    return lambda d: fn(_ckpt_step(d / "ck"))


def _truncate(name: str) -> Callable[[Path], None]:
    def go(step: Path) -> None:
        f = step / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    return go


def _flip(name: str) -> Callable[[Path], None]:
    def go(step: Path) -> None:
        f = step / name
        b = bytearray(f.read_bytes())
        mid = len(b) // 2
        b[mid : mid + 64] = bytes(x ^ 0xFF for x in b[mid : mid + 64])
        f.write_bytes(bytes(b))

    return go


def _meta(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def go(step: Path) -> None:
        meta = json.loads((step / "meta.json").read_text())
        fn(meta)
        (step / "meta.json").write_text(json.dumps(meta))

    return go


def _resume(extra=()) -> list[str]:
    return ["train", *T2[:-2], "--steps", "4", "--resume", "{d}/ck", *extra]


def _ck(name: str, setup, names: Names, argv=None) -> Probe:
    return Probe(
        f"checkpoint {name}",
        "checkpoint",
        argv=argv or _resume(),
        names=names,
        setup=_edit(setup) if setup else None,
        needs=("ckpt",),
        timeout=150,
    )


def checkpoint_probes() -> list[Probe]:
    """Torn, corrupted, edited and incomplete checkpoints, resumed or exported."""

    def rm(name):
        return lambda step: (step / name).unlink()

    def no_digests(meta):
        meta.pop("files", None)

    def step_edited(meta):
        meta["step"] = meta.get("step", 2) + 5

    export = ["export", "{d}/ck", "{d}/out.pt"]
    return [
        _ck("torn .metadata", _truncate(".metadata"), (".metadata",)),
        _ck("flipped bytes in __0_0.distcp", _flip("__0_0.distcp"), ("__0_0.distcp",)),
        _ck("torn __1_0.distcp", _truncate("__1_0.distcp"), ("__1_0.distcp",)),
        _ck("truncated meta.json", _truncate("meta.json"), ("meta.json",)),
        _ck("edited step in meta.json", _meta(step_edited), ("meta.json",)),
        _ck("without digests", _meta(no_digests), (("digest", "sha-256", "sha256"),)),
        _ck("missing shard", rm("__1_0.distcp"), ("__1_0.distcp",)),
        Probe(
            "checkpoint latest names nothing",
            "checkpoint",
            argv=_resume(),
            names=("latest",),
            setup=lambda d: (d / "ck" / "latest").write_text("step-00000099"),
            needs=("ckpt",),
            timeout=150,
        ),
        _ck(
            "export of a torn __0_0.distcp",
            _truncate("__0_0.distcp"),
            ("__0_0.distcp",),
            argv=export,
        ),
        Probe(
            "checkpoint resumes", "checkpoint", "ok", argv=_resume(), needs=("ckpt",), timeout=150
        ),
        Probe(
            "checkpoint with a stale .tmp resumes",
            "checkpoint",
            "ok",
            argv=_resume(),
            needs=("ckpt",),
            timeout=150,
            setup=lambda d: (d / "ck" / "step-00000003.tmp").mkdir(),
        ),
    ]


def _resumes(d: Path, out: str, err: str) -> tuple[str, str] | None:
    """After a failed run with --save {d}/ck: its latest checkpoint must resume at a sane LR."""
    ck = d / "ck"
    if not (ck / "latest").exists():
        return None  # nothing saved: nothing to lose
    argv = [*T[:-2], "--steps", "8", "--resume", str(ck), "--lr", "3e-3"]
    cmd = [sys.executable, "-m", "schemoe", "train"]
    cmd += [a.replace("{corpus}", str(d / "corpus.txt")) for a in argv]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    if r.returncode != 0:
        return "lost", f"its latest checkpoint does not resume: {r.stderr.strip()[-160:]}"
    return None


def _no_tmp(d: Path, out: str, err: str) -> tuple[str, str] | None:
    left = [str(p) for p in (d / "full").rglob("*.tmp")]
    return ("unclear", f"left {left} on the full disk") if left else None


def _run(name: str, kind: str, argv: list[str], names: Names = (), **kw) -> Probe:
    """A whole run: its answer may follow step lines (not one line), checked after by `after`."""
    kw = {"one_line": False, "timeout": 150, "after": _resumes, **kw}
    return Probe(name, kind, argv=["train", *argv], names=names, **kw)


def _signal(name: str, target: str, sig: str, names: Names = (), **kw) -> Probe:
    """Signal `target` (the launcher, or rank 1) of a long 2-rank run after its second step."""
    argv = [*T2[:-2], "--steps", "100000", "--log-every", "1", "--save", "{d}/ck",
            "--save-every", "1"]  # fmt: skip
    return _run(name, "signal", argv, names, action={"target": target, "signal": sig}, **kw)


def run_probes() -> list[Probe]:
    """Whole runs: a success, divergence, a full disk, kills and signals."""
    save = ["--save", "{d}/ck", "--save-every", "1"]
    four = [*T[:-2], "--steps", "4", *save]
    nonfinite = (("non-finite", "nan", "inf"),)
    return [
        _run("run tiny on two ranks", "run", T2, expect="ok", after=None),
        _run(
            "run --policy auto --trials 0",
            "run",
            [*T, "--policy", "auto", "--trials", "0"],
            expect="ok",
            after=None,
        ),
        _run("run --lr 1e6 diverges", "run", [*four, "--lr", "1e6"], nonfinite),
        _run(
            "run --lr 1e30 --clip 0 diverges",
            "run",
            [*four, "--lr", "1e30", "--warmup", "1", "--clip", "0"],
            nonfinite,
        ),
        _run(
            "disk full at save",
            "disk",
            [*T, "--save", "{d}/full/ck"],
            (("no space", "ENOSPC"),),
            needs=("root",),
            after=_no_tmp,
        ),
        _signal(
            "kill -9 of rank 1", "rank", "SIGKILL", ("rank 1", ("SIGKILL", "signal 9", "killed"))
        ),
        _signal("SIGINT to the launcher", "launcher", "SIGINT", (("SIGINT", "interrupt"),)),
        _signal("SIGTERM to the launcher", "launcher", "SIGTERM", (("SIGTERM", "terminat"),)),
        _signal("SIGKILL to the launcher", "launcher", "SIGKILL", expect="gone"),
    ]


def all_probes() -> list[Probe]:
    return [*input_probes(), *api_probes(), *checkpoint_probes(), *run_probes()]
