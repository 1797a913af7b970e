"""`schemoe bench a2a|layer|step|replan|compress|report`, and where the ranks of a benchmark come from.

A multi-rank benchmark module provides `add_arguments(parser)` and `bench(args, env)`
(collective; it prints through `output.report`; what it returns a spawned rank returns). Its ranks come from one of three places:

- already launched (torchrun, Slurm, `schemoe testbed run -- schemoe.cli bench ...`): the launcher
  env (RANK, WORLD_SIZE, ...) is there, so this process is one rank and joins the group;
- `--testbed --ranks-per-node K`: this process launches K ranks per node of the testbed that
  `schemoe testbed up` started, each running `python -m schemoe.bench.cli <name> <args as JSON>`;
- otherwise `--nproc P` local ranks on plain loopback, spawned by `schemoe.dist.launch.spawn`.

`schemoe bench compress` is single-process: `schemoe.bench.compress` provides `add_arguments` and
`run(args) -> dict` (with a "results" list of rows), and this module prints header, table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from functools import partial

from ..cliargs import Check, Parser, guard
from ..config import GateConfig
from ..costmodel.profiles import cache_key
from ..dist.host import configure_rank
from ..dist.launch import spawn
from ..dist.links import Links
from ..dist.topology import launcher_local_rank
from ..train.checks import (
    TRAIN_BYTES_PER_PARAM,
    check_chunk_rows,
    fits_in_memory,
    moe_layer_params,
    train_params,
)
from . import a2a, autostep, bound, compress, layer, output, regen, replan, step

__all__ = ["BenchEnv", "register"]

_MULTI_RANK = {"a2a": a2a, "layer": layer, "step": step, "replan": replan}


@dataclass(frozen=True)
class BenchEnv:
    """Where a benchmark's ranks run: what the header says and the link rate for link fractions."""

    ranks_per_node: int
    testbed: object | None  # schemoe.testbed.Testbed when the ranks run on the testbed
    launched: bool = False  # ranks came from an outside launcher (torchrun, Slurm, testbed run)

    @property
    def links(self) -> Links:
        """The run's links: the testbed's rates on it, else unshaped. Read from the testbed
        itself, not from this process's rendezvous (`Links.of_run`): the launcher, which checks
        --predict's profile before any rank starts, has none."""
        bed = self.testbed
        if bed is None:
            return Links()
        intra = bed.intra_rate_bps or None
        return Links(bed.rate_bps, intra, bed.intra_link if intra else "shared")

    def profile_key(self, world: int) -> str:
        """The profile key of this run (`costmodel.profiles.cache_key`)."""
        return cache_key(world // self.ranks_per_node, self.ranks_per_node, self.links)

    @property
    def link_rate_gbps(self) -> float | None:
        return self.testbed.rate_bps / 1e9 if self.testbed else None

    def topology(self, world: int) -> str:
        if self.testbed:
            where = "testbed namespaces"
        elif self.launched:
            where = "from the launcher's env (links unknown)"
        else:
            where = "one host, loopback (unshaped)"
        return f"{world // self.ranks_per_node} node(s) x {self.ranks_per_node} rank(s), {where}"

    def link(self) -> str:
        if self.testbed:
            return self.testbed.describe() + " (tc: tbf, htb)"
        if self.launched:
            return "not shaped by schemoe; whatever the cluster has"
        return "none shaped; intra and inter-node pairs both on loopback"


# The flags of bench/step.py whose range its validate() does not check, beyond the ones every
# command shares (cliargs.FLAG_CHECKS: --nproc, --timeout, --model-dim, --experts, ...).
_STEP_CHECKS = {
    "--policies": Check(),
    "--grad-syncs": Check(),
    "--grad-compressors": Check(),
    "--seq-len": Check(1),
}
_CHECKS = {"a2a": a2a.CHECKS, "layer": layer.CHECKS, "step": _STEP_CHECKS, "replan": replan.CHECKS}


def _add_launch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the ranks run")
    g.add_argument("--testbed", action="store_true", help="on the testbed `testbed up` started")
    g.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node (testbed: required; loopback: splits --nproc into nodes)",
    )
    g.add_argument("--nproc", type=int, default=2, help="local ranks on loopback (no --testbed)")
    g.add_argument("--timeout", type=float, default=600.0, help="give up after S seconds")
    g.add_argument("--release-freed-memory", action="store_true",
                   help="glibc malloc's defaults in the ranks: freed memory goes back to the "
                   "kernel (default: kept, schemoe.dist.host)")  # fmt: skip


def _rank(rank: int, world: int, name: str, opts: dict, launched: bool = False) -> object:
    """One rank of benchmark `name` (also the entry point of testbed and spawned children)."""
    import torch

    # The box's cores are shared by all ranks; freed memory kept unless --release-freed-memory.
    configure_rank(1, keep_memory=not opts.get("release_freed_memory"))
    if opts.get("device") == "cuda":  # before the first collective: this rank's GPU
        torch.cuda.set_device(launcher_local_rank(rank))
    args = argparse.Namespace(**opts)
    rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    testbed = None
    if args.testbed or launched:
        from ..testbed import netns

        try:
            testbed = netns.load()
        except RuntimeError:
            if args.testbed:
                raise
        # Launched without --testbed: on the testbed iff the rendezvous is node 0's address.
        if testbed and not args.testbed and os.environ.get("MASTER_ADDR") != testbed.master_addr:
            testbed = None
        if testbed and world != testbed.nodes * rpn:
            raise ValueError(f"world size {world} != {testbed.nodes} testbed nodes x {rpn} ranks")
    env = BenchEnv(rpn, testbed, launched)
    if launched:  # no parent process checked this world: every rank does, alike
        _check_world(name, args, env, world)
    return _MULTI_RANK[name].bench(args, env)


def _backend(opts: dict) -> str:
    """NCCL for `--device cuda` (benchmarks that have the flag), else gloo."""
    return "nccl" if opts.get("device") == "cuda" else "gloo"


def _joined(name: str, opts: dict) -> None:
    """Run as a rank of a group whose launcher set RANK/WORLD_SIZE/MASTER_* (read only here)."""
    import torch.distributed as dist

    from ..dist.launch import joined

    with joined(_backend(opts), timeout_s=opts["timeout"]):
        _rank(dist.get_rank(), dist.get_world_size(), name, opts, launched=True)


def _check_world(name: str, args: argparse.Namespace, env: BenchEnv, world: int) -> None:
    """What the flags say about `world` ranks (ValueError naming the flag): --ranks-per-node
    divides them, so do --experts (default 2 per rank), --top-k <= the experts; then the
    benchmark's own (bench layer: --predict has a profile of this topology; bench replan: its
    runs' weights fit in memory)."""
    if world % env.ranks_per_node:
        raise ValueError(f"--ranks-per-node {env.ranks_per_node} must divide the {world} ranks")
    if hasattr(args, "top_k"):
        experts = args.experts or 2 * world
        if experts % world:
            raise ValueError(f"--experts {experts} must be divisible by the {world} ranks")
        if args.top_k > experts:
            raise ValueError(f"--top-k {args.top_k} must be <= the {experts} experts (--experts)")
        if name in ("layer", "step"):
            _check_size(name, args, experts, world)
    if name == "layer":
        layer.check_world(args, env, world)
    if name == "step":
        autostep.check_world(args, env.profile_key(world))
    if name == "replan":
        replan.check_world(args, env, world)


def _check_size(name: str, args: argparse.Namespace, experts: int, world: int) -> None:
    """The checks `schemoe train` makes of the same flags (train/checks.py): the weights and
    gradients of `world` ranks fit in this machine's memory (bench layer's compute part builds
    all E experts on every rank; bench step builds the trainer's model, with AdamW, once per
    row and once more, with all E experts, for its compute part), and no --chunks entry cuts a
    layer call into more chunks than it has rows."""
    sized = f"--experts {experts}, --model-dim {args.model_dim}, --hidden-dim {args.hidden_dim}"
    if name == "layer":
        params = moe_layer_params(args.model_dim, args.hidden_dim, experts, 1)
        each, held = 8, "fp32 weights and gradients"
        tokens, t_flags = args.tokens, f"--tokens {args.tokens}"
    else:  # the fewest tokens a layer call routes: the batch cut into the most micro-chunks
        rows = step.row_count(args)
        params = rows * train_params(args, experts, world) + train_params(args, experts, 1)
        each = TRAIN_BYTES_PER_PARAM
        held = f"{rows} rows' models and the compute part's: fp32 weights, gradients, AdamW state"
        sized += f", --layers {args.layers} and the grid's {rows} rows"
        m = max(args.micro_chunks)
        tokens = args.batch * args.seq_len // m
        t_flags = f"--batch {args.batch} x --seq-len {args.seq_len}" + (
            f" / --micro-chunks {m}" if m > 1 else ""
        )
    fits_in_memory(params, each, world, sized, held=held, device=getattr(args, "device", "cpu"))
    gate = GateConfig(num_experts=experts, top_k=args.top_k, capacity_factor=args.capacity_factor)
    for policy in args.policies:
        for r in args.chunks:
            check_chunk_rows(r, policy, gate, tokens, world, t_flags)


def _main(name: str, args: argparse.Namespace) -> int:
    """Check every flag, then run: as one rank of a launched group, on the testbed, or on
    --nproc spawned local ranks (checked here, before any of them starts)."""
    opts = {k: v for k, v in vars(args).items() if k != "func"}
    mod = _MULTI_RANK[name]
    mod.validate(args)  # bad names fail here, before any rank starts
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        bound.check_launched(opts)
        _joined(name, opts)
        return 0
    if args.testbed:
        from ..testbed import launch, netns

        if not args.ranks_per_node:
            raise ValueError("--testbed needs --ranks-per-node K")
        bed = netns.load()  # a clear error if no testbed is up
        _check_world(
            name, args, BenchEnv(args.ranks_per_node, bed), bed.nodes * args.ranks_per_node
        )
        opts = _measured_compute(name, opts, bed.nodes * args.ranks_per_node, args.ranks_per_node)
        child = ["-m", "schemoe.bench.cli", name, json.dumps(opts)]
        return launch.run(child, args.ranks_per_node, timeout=args.timeout)
    _check_world(name, args, BenchEnv(args.ranks_per_node or args.nproc, None), args.nproc)
    opts = _measured_compute(name, opts, args.nproc, args.ranks_per_node or args.nproc)
    _spawn(args.nproc, name, opts)
    return 0


def _spawn(world: int, name: str, opts: dict) -> list:
    """`world` local ranks of benchmark `name` on loopback; their results by rank."""
    keep = not opts.get("release_freed_memory")
    return spawn(_rank, world, name, opts, timeout=opts["timeout"], backend=_backend(opts),
                 keep_freed_memory=keep)  # fmt: skip


def _measured_compute(name: str, opts: dict, world: int, ranks_per_node: int) -> dict:
    """With --measured-bound (bench step): first the compute pass, the same ranks on plain
    loopback (bench/bound.py); the measured pass gets its row medians in its options."""
    if not opts.get("measured_bound"):
        return opts
    local = bound.pass_options(opts, world, ranks_per_node)
    medians = _spawn(world, name, local)
    return bound.with_compute(opts, medians[0])


def _compress(args: argparse.Namespace) -> int:
    summary = compress.run(args)
    rows = summary.get("results", [])
    columns = list(rows[0]) if rows else []
    config = {k: v for k, v in vars(args).items() if k not in ("func", "command", "bench")}
    head = output.header("schemoe bench compress", config, "one process", "none (local codec)")
    output.report(head, rows, columns, summary)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: median, p10/p90, one JSON line")
    sub = p.add_subparsers(dest="bench", required=True, parser_class=Parser)
    for name, mod in _MULTI_RANK.items():
        sp = sub.add_parser(name, help=mod.__doc__.splitlines()[0])
        _add_launch_arguments(sp)
        mod.add_arguments(sp)
        sp.add_checks(_CHECKS[name])  # and cliargs.FLAG_CHECKS
        sp.set_defaults(func=guard("schemoe bench", partial(_main, name)))
    cp = sub.add_parser("compress", help=compress.__doc__.splitlines()[0])
    compress.add_arguments(cp)
    cp.add_checks(compress.CHECKS)
    cp.set_defaults(func=guard("schemoe bench", _compress))
    rp = sub.add_parser("report", help=regen.__doc__.splitlines()[0])
    regen.add_arguments(rp)
    rp.set_defaults(func=guard("schemoe bench", regen.run))


if __name__ == "__main__":  # a testbed child: python -m schemoe.bench.cli <name> <opts as JSON>
    _joined(sys.argv[1], json.loads(sys.argv[2]))
