"""Probe `schemoe train`, `bench`, `profile` and the Python API as a hostile first week would, and
classify every answer (issue 35's method, scripted).

    PYTHONPATH=$PWD python scripts/probes.py [--jobs 2] [-k SUBSTRING] [--kinds input,api]

Each probe (scripts/probe_cases.py: bad values of every flag, API misuse, torn and corrupted
checkpoints, divergence, a full disk on a small tmpfs, kill -9 of a rank, SIGINT / SIGTERM /
SIGKILL to the launcher) runs as a subprocess with a hard timeout, under a temp folder of its
own, and gets one verdict:

- clear: exit != 0, no traceback, a stderr line naming the flag / file / rank (exactly one line
  for a bad input); or a documented success (exit 0); or, for SIGKILL to the launcher, every
  rank gone within 10 s;
- unclear: a traceback, a message that does not name the thing (or names what it must not), a
  documented success that failed, more than one line for a bad input;
- silent: exit 0 where it should fail;
- hang: the timeout, or a run (or a rank) still alive 10 s after a signal or a kill;
- lost: the run's checkpoint no longer resumes.

Prints a table, the count per verdict, and one final JSON line
{"probes": N, "clear": .., "unclear": .., "silent": .., "hang": .., "lost": .., "skipped": ..}.
Writes only under a temp folder (removed at the end); the tmpfs of the disk-full probe is
unmounted in a finally, and that probe is skipped with a note when not root (or mount fails).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from probe_cases import ROOT, T2, Probe, all_probes

VERDICTS = ("clear", "unclear", "silent", "hang", "lost")
AFTER_SIGNAL_S = 10.0  # a signalled run (and all its ranks) must be gone within this


def _corpus(path: Path, size: int = 100_000) -> None:
    """~100 kB of UTF-8 text from the stdlib's sources (the tiny runs' --corpus)."""
    buf = bytearray()
    for name in ("argparse.py", "os.py", "typing.py", "dataclasses.py", "inspect.py"):
        src = Path(sysconfig.get_paths()["stdlib"]) / name
        if src.is_file():
            buf += src.read_bytes()
        if len(buf) >= size:
            break
    buf = buf[:size] if len(buf) >= 20_000 else bytearray(b"a line of text\n" * (size // 15))
    path.write_bytes(bytes(buf).decode("utf-8", "ignore").encode())


def _fill(text: str, d: Path) -> str:
    return text.replace("{d}", str(d)).replace("{corpus}", str(d / "corpus.txt"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _command(p: Probe, d: Path) -> list[str]:
    if p.code is not None:
        return [sys.executable, "-c", _fill(p.code, d)]
    return [sys.executable, "-m", "schemoe", *(_fill(a, d) for a in p.argv)]


def _names_ok(p: Probe, err: str) -> bool:
    """Some stderr line names every entry of p.names (a string or any of a tuple's)."""
    want = [(n,) if isinstance(n, str) else n for n in p.names]
    for line in err.lower().splitlines():
        if all(any(alt.lower() in line for alt in alts) for alts in want):
            return True
    return not want


def classify(p: Probe, rc: int | None, err: str, timed_out: bool) -> tuple[str, str]:
    """(verdict, why) of one answer, before any `after` check."""
    lines = [x for x in err.splitlines() if x.strip()]
    first = lines[0][:150] if lines else ""
    if timed_out:
        return "hang", f"no answer within {p.timeout:.0f} s"
    if p.expect == "ok":
        return ("clear", "documented success") if rc == 0 else ("unclear", f"exit {rc}: {first}")
    if rc == 0:
        return "silent", "exit 0"
    if "Traceback" in err:
        return "unclear", f"traceback; {first}"
    if not _names_ok(p, err) or any(f.lower() in err.lower() for f in p.forbid):
        return "unclear", f"does not name {p.names} (or names {p.forbid}): {first}"
    if p.one_line and len(lines) != 1:
        return "unclear", f"{len(lines)} stderr lines: {first}"
    return "clear", first


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            stat = Path(e.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(e.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def _alive(pids: set[int]) -> set[int]:
    live = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.add(pid)
    return live


def _ranks(pid: int) -> list[int]:
    """The rank processes of launcher `pid`, in start order (rank 0 first)."""
    found = []
    for k in sorted(_descendants(pid)):
        try:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            found.append(k)
    return found


def _start(p: Probe, d: Path) -> subprocess.Popen:
    """The probe's command in folder d, in a session of its own (its ranks with it)."""
    return subprocess.Popen(
        _command(p, d),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=d,
        start_new_session=True,
    )


def signal_probe(p: Probe, d: Path) -> tuple[int | None, str, str, bool, str]:
    """Start the run, wait for its second step line, signal the launcher or kill a rank, and
    wait AFTER_SIGNAL_S for it and every rank to go. (rc, out, err, timed_out, note)."""
    proc = _start(p, d)
    out: list[str] = []
    err: list[str] = []
    seen = threading.Event()

    def pump(stream, sink, watch):
        for line in stream:
            sink.append(line)
            if watch and line.lstrip().startswith("step") and "step    1 " not in line:
                seen.set()

    threads = [
        threading.Thread(target=pump, args=(proc.stdout, out, True), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, err, False), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        if not seen.wait(p.timeout):
            return None, "".join(out), "".join(err), True, "no second step line"
        everyone = _descendants(proc.pid) | {proc.pid}
        sig = getattr(signal, p.action["signal"])
        if p.action["target"] == "rank":
            ranks = _ranks(proc.pid)
            if len(ranks) < 2:
                return None, "".join(out), "".join(err), False, f"found ranks {ranks}"
            os.kill(ranks[1], sig)
        else:
            os.kill(proc.pid, sig)
        t0 = time.monotonic()
        while time.monotonic() - t0 < AFTER_SIGNAL_S and _alive(everyone):
            time.sleep(0.2)
        left = _alive(everyone)
        for t in threads:
            t.join(timeout=2)
        rc = proc.poll()
        note = f"{len(left)} process(es) alive {AFTER_SIGNAL_S:.0f} s after" if left else ""
        return rc, "".join(out), "".join(err), bool(left), note
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    with_pids = _descendants(proc.pid) | {proc.pid}
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _alive(with_pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run_one(p: Probe, d: Path) -> tuple[int | None, str, str, bool, str]:
    if p.action:
        return signal_probe(p, d)
    proc = _start(p, d)
    try:
        out, err = proc.communicate(timeout=p.timeout)
        return proc.returncode, out, err, False, ""
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return None, out, err, True, ""
    finally:
        _kill_group(proc)


def _mount_tmpfs(where: Path, size: str = "256k") -> str | None:
    """Mount a small tmpfs at `where`; None on success, else why it was skipped."""
    if os.geteuid() != 0:
        return "skipped: needs root to mount a tmpfs"
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    return None if r.returncode == 0 else f"skipped: mount failed: {r.stderr.strip()}"


def probe(i: int, p: Probe, base: Path, ckpt: Path | None) -> dict:
    d = base / f"probe-{i:03d}"
    d.mkdir()
    shutil.copy(base / "corpus.txt", d / "corpus.txt")
    row = {"probe": p.name, "kind": p.kind, "rc": None, "s": 0.0}
    mounted = False
    try:
        if "ckpt" in p.needs:
            if ckpt is None:
                return {**row, "verdict": "skipped", "why": "no base checkpoint"}
            shutil.copytree(ckpt, d / "ck")
        if "root" in p.needs:
            if why := _mount_tmpfs(d / "full"):
                return {**row, "verdict": "skipped", "why": why}
            mounted = True
        if p.setup:
            p.setup(d)
        t0 = time.monotonic()
        rc, out, err, timed_out, note = run_one(p, d)
        row.update(rc=rc, s=round(time.monotonic() - t0, 1))
        if p.expect == "gone":
            verdict, why = ("hang", note) if timed_out else ("clear", "every rank gone")
        else:
            verdict, why = classify(p, rc, err, timed_out)
            why = f"{note}; {why}" if note else why
        if p.after and verdict != "hang" and (found := p.after(d, out, err)):
            verdict, why = found[0], f"{found[1]} ({why})"
        return {**row, "verdict": verdict, "why": why}
    except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as e:
        # a broken probe (its setup, its after-check) is reported, not fatal to the others
        return {**row, "verdict": "unclear", "why": f"probe error {type(e).__name__}: {e}"}
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(d / "full")], check=False)


def _base_checkpoint(base: Path) -> Path | None:
    """A 2-rank checkpoint at step 2 (copied into each checkpoint probe's folder)."""
    d = base / "base"
    d.mkdir()
    shutil.copy(base / "corpus.txt", d / "corpus.txt")
    argv = [_fill(a, d) for a in ["train", *T2, "--save", "{d}/ck"]]
    r = subprocess.run(
        [sys.executable, "-m", "schemoe", *argv],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    if r.returncode != 0:
        print(f"# no base checkpoint: {r.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return d / "ck"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="probes run at once")
    ap.add_argument("-k", default="", help="only probes whose name contains this")
    ap.add_argument("--kinds", default="", help="comma list of kinds (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    a = ap.parse_args(argv)
    kinds = set(filter(None, a.kinds.split(",")))
    chosen = [p for p in all_probes() if a.k in p.name and (not kinds or p.kind in kinds)]
    base = Path(tempfile.mkdtemp(prefix="schemoe-probes-"))
    t0 = time.monotonic()
    try:
        _corpus(base / "corpus.txt")
        ckpt = _base_checkpoint(base) if any("ckpt" in p.needs for p in chosen) else None
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            rows = list(pool.map(lambda ip: probe(*ip, base, ckpt), enumerate(chosen)))
    finally:
        if a.keep:
            print(f"# kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'verdict':8} {'kind':10} {'rc':>4} {'s':>6}  probe: why")
    for r in rows:
        print(
            f"{r['verdict']:8} {r['kind']:10} {r['rc']!s:>4} {r['s']:6.1f}  {r['probe']}: "
            f"{r['why'][:160]}"
        )
    counts = {v: sum(r["verdict"] == v for r in rows) for v in (*VERDICTS, "skipped")}
    print(" ".join(f"{k}: {n}" for k, n in counts.items()))
    print(json.dumps({"probes": len(rows), **counts, "seconds": round(time.monotonic() - t0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
