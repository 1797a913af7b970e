"""`schemoe testbed up|run|down`: the emulated cluster from the command line."""

from __future__ import annotations

import argparse

from ..cliargs import Check, for_flag, guard
from . import launch, netns
from .units import parse_latency, parse_rate

__all__ = ["register"]

# Each flag's range, checked right after parsing (cliargs.Parser.add_checks).
CHECKS = {
    "--nodes": Check(1, 200),
    "--ranks-per-node": Check(1, 250),
    "--timeout": Check(0, 1e9, strict=True),
}


def _check_up(args: argparse.Namespace) -> None:
    """The flags of `up` that `netns.up` would refuse, named as typed, before it runs a command."""
    with for_flag("--rate"):
        parse_rate(args.rate)
    with for_flag("--latency"):
        parse_latency(args.latency)
    if args.intra_rate is None:
        given = [f"--ranks-per-node {args.ranks_per_node}"] if args.ranks_per_node else []
        given += [f"--intra-link {args.intra_link}"] if args.intra_link != "shared" else []
        if given:
            raise ValueError(f"{' and '.join(given)}: only with --intra-rate (rank namespaces)")
        return
    with for_flag("--intra-rate"):
        parse_rate(args.intra_rate)
    if args.nodes < 2:
        raise ValueError(f"--intra-rate with --nodes {args.nodes}: rank links need --nodes >= 2")
    if args.ranks_per_node is None:
        raise ValueError("--intra-rate gives each rank a namespace: give --ranks-per-node K")


def _up(args: argparse.Namespace) -> int:
    _check_up(args)
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
    with for_flag("the command after --"):
        launch.child_command(args.target)  # something to run, before any rank starts
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
    up.add_checks(CHECKS)
    up.set_defaults(func=guard("schemoe testbed", _up))

    run = sub.add_parser("run", help="launch ranks on every node (torchrun-style env)")
    run.add_argument("--ranks-per-node", type=int, required=True, help="ranks on each node")
    run.add_argument("--timeout", type=float, default=600.0, help="kill all ranks after S s")
    run.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        help="-- then a module (with or without -m) or a script, and its args",
    )
    run.add_checks(CHECKS)
    run.set_defaults(func=guard("schemoe testbed", _run))

    down = sub.add_parser("down", help="remove the testbed (idempotent)")
    down.set_defaults(func=guard("schemoe testbed", _down))
