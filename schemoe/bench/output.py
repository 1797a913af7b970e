"""What every `schemoe bench` command prints (its timer is `schemoe.dist.timing.measure`, the
one timer the profiler and the auto tuner use too).

`report` prints, on rank 0 only: a header (config, topology, link, hardware, versions), a table,
and as the last line one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import trace
from ..dist.host import freed_memory_kept

__all__ = ["header", "report", "table", "traced"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(title: str, config: Mapping[str, Any], topology: str, link: str) -> list[str]:
    """The lines above every table: what ran, where, on what."""
    threads = torch.get_num_threads()
    mem = "freed memory kept" if freed_memory_kept() else "malloc defaults (freed memory returned)"
    return [
        f"# {title}",
        "# config: " + " ".join(f"{k}={v}" for k, v in config.items()),
        f"# topology: {topology}",
        f"# link: {link}",
        f"# hardware: {_cpu_model()}, {os.cpu_count()} cores, {threads} thread(s) per rank, {mem}",
        (
            f"# versions: torch {torch.__version__}, python {sys.version.split()[0]}, "
            f"{platform.system()} {platform.release()}"
        ),
    ]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[str]:
    """Rows as an aligned text table (right-aligned cells, '-' for None)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return lines


def report(
    head: Sequence[str], rows: Sequence[Mapping[str, Any]], columns: Sequence[str], summary: dict
) -> None:
    """Rank 0 prints header, table and the JSON line (the last line of output)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    print("\n".join([*head, *table(rows, columns), json.dumps(summary)]), flush=True)


def traced(step: Callable[[], None], folder: str, name: str) -> None:
    """Trace one steady-state call of `step` (one warm call first; collective: every rank takes
    part) into folder/<name>.json (+ .png), and say on stderr what was written."""
    step()
    dist.barrier()
    with trace.record() as tl:
        step()
    if written := tl.save(os.path.join(folder, name.replace("/", "_"))):
        print(f"trace: {', '.join(written)}", file=sys.stderr, flush=True)
