r"""`schemoe bench step --measured-bound`: each row's bound measured in the same invocation, next
to the estimated one (bench/parts.py: `lower_bound_ms`), which it does not replace.

- compute (`compute_measured_ms`): the same rows (same ranks, same --ranks-per-node split, same
  shape, same candidates) run first on plain loopback with no shaping: a compute pass the
  launcher spawns before the measured pass (`pass_options`), whose row medians it hands to the
  measured pass in the ranks' options (`with_compute`). The pass includes what a step's CPU
  ranks spend moving the data, which the estimate leaves out. With --nproc the measured pass is
  itself on loopback, so its `bound_ratio` is the two passes' ratio: 1 up to run-to-run noise.
- network (`network_measured_ms`): on the testbed (one namespace per node), local rank 0 of each
  node reads its namespace's eth0 counters (`link_bytes`; a process in the namespace sees them
  as its own, and a node's intra-node pairs use its loopback, so eth0 carries the node's
  inter-node bytes only) right before and after each call of each row (`counted`): the start
  is aligned by the timer's barrier before every sample, the end is rank 0's own step end. The
  median over a row's timed calls of the busiest node direction (tx or rx; headers included,
  as the link carries them; `busiest_bytes`), x 8 / the testbed's rate = network_ms. Off the
  testbed nothing is shaped: None ("-"), and the header says so; so too on a testbed with rank
  namespaces (--intra-rate), where eth0 is the rank link and the node uplink's counters are in
  a namespace no rank runs in.
- `measured_bound_ms` = max(compute, network or 0); `bound_ratio` = median_ms / it, every row.

Only a launcher this command controls can run the compute pass (--nproc, --testbed); ranks
started by an outside launcher are refused (`check_launched`). The two passes take about twice
one pass's time; --timeout bounds each.

The runs at issues 16/17's shape (M=256 H=512), on the testbed, as root (`schemoe bench report
--testbed --only step_bound_600mbit_m256,step_bound_200mbit_m256` runs the same: bench/figures.py):

    schemoe testbed up --nodes 2 --rate 600mbit
    schemoe bench step --testbed --ranks-per-node 2 --policies sequential,schemoe --chunks 1,4 \
        --micro-chunks 1,2 --grad-syncs ddp,scheduled --grad-compressors none,bf16 \
        --grad-algorithm hier --peer deepspeed --model-dim 256 --hidden-dim 512 --repeats 5 \
        --timeout 1200 --measured-bound > step_bound_600mbit_m256_2x2.txt
    schemoe bench step --testbed --ranks-per-node 1 ...(the same) > step_bound_600mbit_m256_2x1.txt
    schemoe testbed down

and the same with --rate 200mbit (files step_bound_200mbit_m256_2x2.txt, _2x1.txt).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..dist.timing import percentile

__all__ = [
    "COUNTERS",
    "add_columns",
    "busiest_bytes",
    "check_launched",
    "count_rows",
    "counted",
    "header_line",
    "link_bytes",
    "pass_options",
    "with_compute",
]

COUNTERS = "/sys/class/net/eth0/statistics"  # inside a testbed namespace: that node's eth0

Deltas = list[tuple[int, int]]  # (tx, rx) bytes of each call, in call order


def link_bytes(folder: str = COUNTERS) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) read from a sysfs statistics folder (its two files, one integer
    each). OSError if a file is missing, ValueError naming the file if it holds no integer."""
    out = []
    for name in ("tx_bytes", "rx_bytes"):
        path = os.path.join(folder, name)
        with open(path) as f:
            text = f.read().strip()
        try:
            out.append(int(text))
        except ValueError:
            raise ValueError(f"{path}: expected a byte count, got {text!r}") from None
    return out[0], out[1]


def counted(fn: Callable[[], object], folder: str = COUNTERS) -> tuple[Callable[[], None], Deltas]:
    """`fn` wrapped to append each call's (tx, rx) counter difference to the returned list.
    The two reads are inside the timed call (two small file reads, microseconds)."""
    deltas: Deltas = []

    def run() -> None:
        tx0, rx0 = link_bytes(folder)
        fn()
        tx1, rx1 = link_bytes(folder)
        deltas.append((tx1 - tx0, rx1 - rx0))

    return run, deltas


def busiest_bytes(deltas_per_row: Sequence[Deltas | None], repeats: int) -> list[float]:
    """Per row, the busiest node direction's bytes per step: on each counting rank the median of
    the last `repeats` calls (the timed ones; warm-up calls come first) of tx and of rx, then the
    max over both directions and every rank (None: this rank does not count). Collective: every
    rank calls it with the same number of rows (one all_reduce)."""
    mine = [
        0.0 if d is None else max(percentile([t for t, _ in d[-repeats:]], 50),
                                  percentile([r for _, r in d[-repeats:]], 50))
        for d in deltas_per_row
    ]  # fmt: skip
    t = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def add_columns(
    rows: Sequence[dict],
    compute_ms: Mapping[str, float],
    link_bytes_per_step: Sequence[float] | None,
    rate_bps: float | None,
) -> None:
    """Add the measured columns to each row (in place; rows carry their name in "_n").
    `link_bytes_per_step`/`rate_bps` None: no shaped link was counted (network "-")."""
    for i, row in enumerate(rows):
        compute = compute_ms[row["_n"]]
        net = None
        if link_bytes_per_step is not None and rate_bps:
            row["link_bytes"] = link_bytes_per_step[i]
            net = link_bytes_per_step[i] * 8 / rate_bps * 1e3
        bound = max(compute, net or 0.0)
        row.update(compute_measured_ms=compute, network_measured_ms=net, measured_bound_ms=bound,
                   bound_ratio=row["median_ms"] / bound)  # fmt: skip


def count_rows(args, env, rank: int, cands: dict, names: list[str]) -> list | None:
    """--measured-bound on the testbed (a namespace per node): each row's sample wrapped to
    count its node's eth0 bytes on local rank 0 (`counted`), the others' entries None;
    None where nothing is counted (not the measured pass, loopback, rank namespaces)."""
    bed = env.testbed
    if not args.measured_bound or args.bound_pass or bed is None or bed.per_rank:
        return None
    if rank % env.ranks_per_node:
        return [None] * len(names)
    counts = []
    for name in names:
        cands[name], deltas = counted(cands[name], COUNTERS)
        counts.append(deltas)
    return counts


def header_line(env, world: int, link_counted: bool) -> str:
    """The header line that says what the measured columns are."""
    line = (
        f"# measured bound: compute = the same rows on unshaped loopback ({world} ranks, "
        f"{env.ranks_per_node} per node), run first; network = "
    )
    if link_counted:
        return line + (
            f"the busiest node's eth0 bytes per step (tx or rx) / {env.testbed.rate_bps / 1e6:g} "
            "Mbit/s; bound_ratio = median / max(compute, network)"
        )
    why = "rank namespaces: the node uplink is not counted" if env.testbed else "no shaped link"
    return line + f"- ({why}); bound_ratio = median / compute"


def check_launched(opts: Mapping[str, object]) -> None:
    """ValueError naming --measured-bound when ranks come from an outside launcher."""
    if opts.get("measured_bound"):
        raise ValueError(
            "--measured-bound needs a launcher of its own (--nproc P or --testbed "
            "--ranks-per-node K) to run the compute pass; this process is one rank of an "
            "outside launcher (RANK/WORLD_SIZE are set)"
        )


def pass_options(opts: Mapping[str, object], world: int, ranks_per_node: int) -> dict:
    """The compute pass's options: the same flags on `world` loopback ranks split into nodes of
    `ranks_per_node`, no trace, nothing printed (the ranks return the row medians)."""
    return dict(opts, testbed=False, nproc=world, ranks_per_node=ranks_per_node, trace=None,
                bound_pass=True)  # fmt: skip


def with_compute(opts: Mapping[str, object], medians: Mapping[str, float]) -> dict:
    """The measured pass's options: `opts` with the compute pass's row medians (name -> ms)."""
    return dict(opts, compute_measured=dict(medians))
