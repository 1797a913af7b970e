"""`schemoe testbed up|run|down`: the emulated cluster from the command line."""

from __future__ import annotations

import argparse

from ..cliargs import guard
from . import launch, netns

__all__ = ["register"]


def _up(args: argparse.Namespace) -> int:
    bed = netns.up(
        args.nodes, args.rate, args.latency, args.intra_rate, args.ranks_per_node, args.intra_link
    )
    print(bed.describe())
    for ns, addr in zip(bed.host_ns(), bed.addresses):
        print(f"  namespace {ns}: {netns.IFNAME} {addr}")
    print(f"state: {netns.STATE_FILE}; remove with `schemoe testbed down`")
    return 0


def _down(args: argparse.Namespace) -> int:
    removed = netns.down()
    print(f"removed {', '.join(removed)}" if removed else "no testbed was up")
    return 0


def _run(args: argparse.Namespace) -> int:
    return launch.run(args.target, args.ranks_per_node, timeout=args.timeout)


def register(subparsers) -> None:
    p = subparsers.add_parser("testbed", help="emulated multi-node cluster (root, Linux)")
    sub = p.add_subparsers(dest="testbed_command", required=True)

    up = sub.add_parser("up", help="create the namespaces and shaped links")
    up.add_argument("--nodes", type=int, required=True, help="number of emulated nodes")
    up.add_argument("--rate", required=True, help="link rate each way, e.g. 400mbit, 1gbit")
    up.add_argument("--latency", default=None, help="one-way node-to-node latency, e.g. 1ms")
    up.add_argument(
        "--intra-rate",
        default=None,
        help="give each rank its own namespace, linked to its node's bridge at this rate each "
        "way (default: a node's ranks share its namespace and talk over loopback)",
    )
    up.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="with --intra-rate: rank namespaces per node (runs must use the same K)",
    )
    up.add_argument(
        "--intra-link",
        choices=netns.INTRA_LINKS,
        default="shared",
        help="with --intra-rate: the rank link shapes all of a rank's bytes (shared, default) "
        "or only those to/from its own node (separate: inter-node pairs see only the uplink)",
    )
    up.set_defaults(func=guard("schemoe testbed", _up))

    run = sub.add_parser("run", help="launch ranks on every node (torchrun-style env)")
    run.add_argument("--ranks-per-node", type=int, required=True, help="ranks on each node")
    run.add_argument("--timeout", type=float, default=600.0, help="kill all ranks after S s")
    run.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        help="-- then a module (with or without -m) or a script, and its args",
    )
    run.set_defaults(func=guard("schemoe testbed", _run))

    down = sub.add_parser("down", help="remove the testbed (idempotent)")
    down.set_defaults(func=guard("schemoe testbed", _down))
