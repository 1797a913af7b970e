"""All-to-all time and bandwidth per algorithm over message sizes.

`bytes` is what each rank sends in one all-to-all (its whole send buffer, self included), split
evenly over the ranks. algbw_gbps = bytes x 8 / time (Gbit/s, per rank). On the testbed,
link_fraction = the inter-node bytes each node sends / (time x link rate): 1.0 means the shaped
link was busy the whole time (the node's uplink, when ranks have links of their own). limit_ms is
what no algorithm can beat by overlapping the two links: max(intra_ms, inter_ms), the time of the
intra-node pairs alone and of the inter-node pairs alone, both measured with `naive` in the same
interleaved run (the other link's splits set to zero) and printed on every row of their size.
"""

from __future__ import annotations

import argparse
import re

import torch

from ..cliargs import Check, for_flag, names
from ..collectives import ALGORITHMS, build
from ..dist.timing import measure
from ..dist.topology import Topology
from . import output

__all__ = ["CHECKS", "add_arguments", "bench", "parse_size", "validate"]

_ROW = 256  # bytes per row: 64 fp32 values; sizes are rounded to whole rows per peer
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'64K' -> 65536, '4M' -> 4194304 (binary units), '1000' -> 1000."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMG]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"size {text!r}: expected a positive integer with optional K, M or G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _sizes(text: str) -> list[int]:
    """--sizes: a comma list of `parse_size` sizes (argparse names the flag and the value)."""
    try:
        return [parse_size(t) for t in names(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Each flag's range, checked right after parsing (cliargs.Parser.add_checks), beyond
# cliargs.FLAG_CHECKS (--warmup, --repeats).
CHECKS = {"--algorithms": Check(), "--sizes": Check(1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--algorithms",
        type=names,
        default=["naive"],
        help=f"comma-separated, from: {', '.join(ALGORITHMS.names())}",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=[2**16, 2**20, 2**23],
        help="bytes per rank, e.g. 64K,1M,8M",
    )
    p.add_argument("--warmup", type=int, default=2, help="unmeasured rounds")
    p.add_argument("--repeats", type=int, default=10, help="measured rounds")


def validate(args: argparse.Namespace) -> None:
    """The names (ValueError listing the known ones); each flag's range is its Check."""
    with for_flag("--algorithms"):
        for name in args.algorithms:
            ALGORITHMS.get(name)


def _splits(topo: Topology, rows: int, keep: str) -> list[int]:
    """rows per peer, zeroed for the peers not on `keep` ("all", "intra" or "inter")."""
    return [
        rows if keep == "all" or (keep == "intra") == topo.same_node(d) else 0
        for d in range(topo.world)
    ]


def bench(args: argparse.Namespace, env) -> None:
    topo = Topology.from_group(None, env.ranks_per_node)
    algos = {name: build(name, topo) for name in args.algorithms}
    naive = build("naive", topo)
    inter_peers = topo.world - topo.ranks_per_node
    rows_out, limits = [], []
    for size in args.sizes:
        per_peer = max(1, size // (_ROW * topo.world))
        x = torch.randn(per_peer * topo.world, _ROW // 4)
        nbytes = x.numel() * x.element_size()

        def run(algo, keep="all", x=x, per_peer=per_peer):
            s = _splits(topo, per_peer, keep)
            return lambda: algo.start(x[: sum(s)], s, s).wait()

        cands = {name: run(a) for name, a in algos.items()}
        if topo.nodes > 1:
            cands["naive[intra]"] = run(naive, "intra")
            cands["naive[inter]"] = run(naive, "inter")
        stats = measure(cands, warmup=args.warmup, repeats=args.repeats)
        parts = {"limit_ms": None, "intra_ms": None, "inter_ms": None}
        if topo.nodes > 1:
            intra, inter = stats["naive[intra]"].median_ms, stats["naive[inter]"].median_ms
            parts = {"limit_ms": max(intra, inter), "intra_ms": intra, "inter_ms": inter}
            limits.append({"bytes": nbytes, **parts})
        # Inter-node bytes one node sends: each of its ranks, to every rank of the other nodes.
        node_inter_bits = 8 * topo.ranks_per_node * inter_peers * per_peer * _ROW
        for name in algos:
            st = stats[name]
            secs = st.median_ms / 1e3
            frac = None
            if env.link_rate_gbps and topo.nodes > 1:
                frac = node_inter_bits / (secs * env.link_rate_gbps * 1e9)
            rows_out.append(
                {
                    "algorithm": name,
                    "bytes": nbytes,
                    **st.row(),
                    "algbw_gbps": nbytes * 8 / secs / 1e9,
                    "link_fraction": frac,
                    **parts,
                }
            )
    config = {
        "algorithms": ",".join(args.algorithms),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "dtype": "float32",
        "row_bytes": _ROW,
    }
    head = output.header("schemoe bench a2a", config, env.topology(topo.world), env.link())
    cols = [
        "algorithm",
        "bytes",
        "median_ms",
        "p10_ms",
        "p90_ms",
        "algbw_gbps",
        "link_fraction",
        "intra_ms",
        "inter_ms",
        "limit_ms",
    ]
    summary = {
        "results": rows_out,
        "link_rate_gbps": env.link_rate_gbps,
        "limits": limits,
        "world_size": topo.world,
        "ranks_per_node": topo.ranks_per_node,
    }
    output.report(head, rows_out, cols, summary)
