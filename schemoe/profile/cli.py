"""`schemoe profile` (fit the cost model here), `simulate` (plan on a preset), `validate`
(validate.py).

    schemoe profile [--nproc 4 --ranks-per-node 2] [--link-rate 400mbit [--intra-rate 100mbit
        [--intra-link separate]]] [--path FILE]
    schemoe testbed run --ranks-per-node 2 -- -m schemoe.cli profile
    schemoe simulate --preset paper-32gpu --layers 12 --tokens 4096 --model-dim 2048 \\
        --hidden-dim 2048 [--experts 32 --top-k 2 --capacity-factor 1.2] [--budget lossy] [--png F]
    schemoe simulate --ctmoe [--preset paper-32gpu]     (simctmoe.py)
    schemoe validate BENCH.txt=PROFILE.json ... [--png sim_vs_measured.png]

A profile is stored under the key of the topology and links it was measured under
(`costmodel.profiles.cache_key`): on the testbed the ranks read its rates (`Links.of_run`),
elsewhere they are "unshaped" unless --link-rate / --intra-rate say what the network is.
`validate` uses only the record of the key each bench output names, and refuses a profile
file without it (naming both keys).

All three end with one JSON line. simulate's: {"preset", "results": [{"policy", "algorithm",
"compressor", "chunks", "predicted_ms"}, ...] (one row per policy at its best configuration),
"chosen": {...}}, plus "systems" with --systems (each system as it ships: tutel and fastermoe
uncompressed on naive, schemoe on pipe + zfp at r = 2, as in the paper) and "ablation" with
--ablation (the paper's ablation ladder: naive, + ZFP, + Pipe-A2A, + scheduling at r = 2).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from ..cliargs import Check, add_layer_shape, for_flag, guard
from ..costmodel import profiles
from ..costmodel.hardware import preset
from ..costmodel.model import LayerShape
from ..costmodel.prediction import predict
from ..dist.host import configure_rank
from ..dist.launch import joined, spawn
from ..dist.links import Links
from ..dist.topology import Topology, launcher_local_rank
from ..testbed.units import parse_rate
from ..trace import gantt
from ..train.checks import fits_in_memory, moe_layer_params
from ..tuning import measure
from ..tuning.choose import explore
from . import simctmoe, simstep, validate

__all__ = ["register"]

POLICY_ROWS = ("sequential", "tutel", "fastermoe", "schemoe", "search")

# Each flag's range, checked right after parsing (cliargs.Parser.add_checks); one table for
# `profile` and `simulate` (and simstep's flags), each taking the flags it has, beyond the ones
# every command shares (cliargs.FLAG_CHECKS: --nproc, --timeout, --model-dim, --experts, ...).
CHECKS = {
    "--nodes": Check(1),
    "--shared-hidden": Check(0),
    "--seq-len": Check(0),  # 0: no attention (simulate); --step needs >= 1 (simstep)
    "--max-chunks": Check(1),
    "--micro-chunks": Check(1),
    "--grad-syncs": Check(),
    "--grad-compressors": Check(),
}


def _rank(rank: int, world: int, opts: dict) -> dict | None:

    configure_rank(1)  # the ranks share the host's cores, as in `schemoe bench`
    if opts["device"] == "cuda":  # profile the GPU and NCCL this rank trains on
        torch.cuda.set_device(launcher_local_rank(rank))
    topo = Topology.from_group(None, opts["ranks_per_node"])
    hw, pts = measure.measure(
        topo,
        model_dim=opts["model_dim"],
        hidden=opts["hidden"],
        tokens=opts["tokens"],
        experts=opts["experts"],
        links=opts["links"] or Links.of_run(),
        quick=opts["quick"],
    )
    if dist.get_rank() != 0:
        return None
    key = profiles.save(hw, opts["path"])
    print(
        f"# schemoe profile: {topo.nodes} node(s) x {topo.ranks_per_node} rank(s), "
        f"saved as {key!r} in {opts['path'] or profiles.DEFAULT_PATH}"
    )
    print(
        f"intra: alpha {hw.intra.alpha * 1e6:.1f} us, {hw.intra.beta / 1e9:.3f} GB/s; "
        f"inter (per node): alpha {hw.inter.alpha * 1e6:.1f} us, {hw.inter.beta / 1e9:.3f} GB/s"
    )
    print(
        f"experts: {hw.flops / 1e9:.2f} GFLOP/s, {hw.gemm_alpha * 1e6:.1f} us per GEMM; "
        f"memory {hw.memory / 1e9:.2f} GB/s, stream {hw.stream_rate / 1e9:.2f} GB/s"
    )
    print(
        f"layer: per task {hw.task_overhead * 1e6:.1f} us, per step {hw.step_overhead * 1e3:.2f} "
        f"ms, compute x{hw.compute_factor:.2f}, a communicating rank keeps {hw.comm_cpu:.2f} "
        f"core busy, an all-to-all waits {hw.skew * 1e3:.2f} ms for the last rank, compute "
        f"under a transfer x{1 + hw.overlap:.2f}"
    )
    print(json.dumps({"key": key, "hardware": hw.to_json(), "points": pts}))
    return hw.to_json()


def _links(args: argparse.Namespace) -> Links | None:
    """The links --link-rate / --intra-rate / --intra-link describe, or None (the run's own)."""
    if args.link_rate is None:
        if args.intra_rate or args.intra_link:
            raise ValueError("--intra-rate / --intra-link describe the links with --link-rate")
        return None
    intra = parse_rate(args.intra_rate, "--intra-rate") if args.intra_rate else None
    return Links(parse_rate(args.link_rate, "--link-rate"), intra, args.intra_link or "shared")


def _check_profile(args: argparse.Namespace, world: int) -> None:
    """What the flags say about `world` ranks, before any starts (ValueError naming the flag)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    if args.ranks_per_node is not None and world % args.ranks_per_node:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node} must divide the {world} ranks")
    if args.experts is not None and args.experts % world:
        raise ValueError(f"--experts {args.experts} must be divisible by the {world} ranks")
    experts = args.experts or 2 * world
    fits_in_memory(  # two experts per rank are timed; the layers measured hold E / world each
        moe_layer_params(args.model_dim, args.hidden, experts, world),
        8,
        world,
        f"--experts {experts}, --model-dim {args.model_dim}, --hidden-dim {args.hidden}",
        held="fp32 weights and gradients",
        device=args.device,
    )
    if args.path and os.path.isdir(args.path):
        raise ValueError(f"--path {args.path!r} is a folder; give the profile store's file name")


def _profile(args: argparse.Namespace) -> int:
    opts = {
        "ranks_per_node": args.ranks_per_node,
        "model_dim": args.model_dim,
        "hidden": args.hidden,
        "tokens": args.tokens,
        "experts": args.experts,
        "quick": args.quick,
        "path": args.path,
        "links": _links(args),
        "device": args.device,
    }
    backend = "nccl" if args.device == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched (torchrun, testbed)
        if args.device == "cuda":
            torch.cuda.set_device(launcher_local_rank())
        with joined(backend, timeout_s=args.timeout):
            _check_profile(args, dist.get_world_size())
            _rank(dist.get_rank(), dist.get_world_size(), opts)
        return 0
    _check_profile(args, args.nproc)
    if args.ranks_per_node is None:
        opts["ranks_per_node"] = max(1, args.nproc // 2)
    spawn(_rank, args.nproc, opts, timeout=args.timeout, backend=backend)
    return 0


def _shape(args, hw):
    return simstep.shape_of(LayerShape, args, hw)


def _systems(hw, shape, layers: int, dense: float) -> list[dict]:
    """Each system as it ships (the paper's baselines): tutel, fastermoe uncompressed on a plain
    all-to-all at their best r; schemoe with Pipe-A2A and ZFP at the paper's r = 2."""

    rows = []
    for pol in ("tutel", "fastermoe"):
        rs = range(1, min(8, hw.world) + 1)
        best = min(
            (predict(hw, shape, pol, "naive", ("none", "none"), r) for r in rs),
            key=lambda p: p.step_s,
        )
        rows.append(best)
    rows.append(predict(hw, shape, "schemoe", "pipe", ("zfp", "zfp"), 2))
    return [{**p.row(), "predicted_ms": round(layers * (p.step_s + dense) * 1e3, 3)} for p in rows]


ABLATION = (
    ("naive", "sequential", "naive", "none", 1),
    ("+ zfp", "sequential", "naive", "zfp", 1),
    ("+ pipe", "sequential", "pipe", "zfp", 1),
    ("+ scheduling", "schemoe", "pipe", "zfp", 2),
)


def _ablation(hw, shape, layers: int, dense: float) -> list[dict]:
    """The paper's ablation ladder (the ScheMoE paper's ablation): each step adds one ScheMoE part."""

    rows = []
    for step, pol, alg, comp, r in ABLATION:
        p = predict(hw, shape, pol, alg, (comp, comp), r)
        ms = round(layers * (p.step_s + dense) * 1e3, 3)
        rows.append({"step": step, **p.row(), "predicted_ms": ms})
    return rows


def _simulate(args: argparse.Namespace) -> int:
    if args.profile:
        hw = _only_or_keyed(args.profile, args.key)
    else:
        with for_flag("--preset"):
            hw = preset(args.preset)
    if args.nodes or args.ranks_per_node:
        hw = hw.with_topology(args.nodes or hw.nodes, args.ranks_per_node or hw.ranks_per_node)
    if args.ctmoe:
        return simctmoe.run(args, hw)
    if args.model_dim is None or args.hidden is None:
        raise ValueError("simulate needs --model-dim and --hidden-dim (or --ctmoe)")
    if args.step:
        return simstep.run(args, hw)
    if args.tokens is None:
        raise ValueError("simulate needs --tokens (tokens per rank), or --step for a whole step")
    shape = _shape(args, hw)
    # Attention (not simulated by the MoE model): 8 D^2 + 4 L D FLOP per token forward, x3.
    dense = 0.0
    if args.seq_len:
        dense = 3 * shape.tokens * (8 * shape.model_dim**2 + 4 * args.seq_len * shape.model_dim)
        dense /= hw.flops
    preds = explore(hw, shape, args.budget, max_chunks=args.max_chunks)
    rows = []
    for pol in POLICY_ROWS:
        best = next(p for p in preds if p.policy == pol)
        rows.append(
            {**best.row(), "predicted_ms": round(args.layers * (best.step_s + dense) * 1e3, 3)}
        )
    chosen = preds[0]
    print(
        f"# schemoe simulate: preset {hw.name}, {hw.nodes} x {hw.ranks_per_node} ranks, "
        f"{args.layers} layer(s), T={shape.tokens}/rank D={shape.model_dim} "
        f"H={shape.hidden_dim} E={shape.experts} k={shape.top_k} f={shape.capacity_factor}, "
        f"C={shape.capacity}, budget {args.budget}, attention {dense * 1e3:.3f} ms/layer"
    )
    print(f"{'policy':>10} {'algorithm':>9} {'compressor':>10} {'r':>2} {'step ms':>10}")
    for row in rows:
        print(
            f"{row['policy']:>10} {row['algorithm']:>9} {row['compressor']:>10} "
            f"{row['chunks']:>2} {row['predicted_ms']:>10.3f}"
        )
    chosen_ms = round(args.layers * (chosen.step_s + dense) * 1e3, 3)
    out = {
        "preset": hw.name,
        "results": rows,
        "chosen": {**chosen.row(), "predicted_ms": chosen_ms},
    }
    print(f"chosen: {out['chosen']}")
    if shape.shared_hidden:  # the chosen configuration, the shared expert's task placed both ways
        out["shared"] = [
            {"shared": place, "predicted_ms": round(args.layers * (p.step_s + dense) * 1e3, 3)}
            for place in ("scheduled", "before")
            for p in [predict(hw, shape, *chosen_args(chosen), shared=place)]
        ]
        print(f"shared expert: {out['shared']}")
    if args.systems:
        out["systems"] = _systems(hw, shape, args.layers, dense)
        for row in out["systems"]:
            print(f"as shipped: {row}")
    if args.ablation:
        out["ablation"] = _ablation(hw, shape, args.layers, dense)
        for row in out["ablation"]:
            print(f"ablation: {row}")
    if args.png:
        events: list = []
        predict(
            hw,
            shape,
            chosen.policy,
            chosen.algorithm,
            chosen.compressors,
            chosen.chunks,
            events=events,
        )
        gantt(
            events,
            args.png,
            f"simulated: {chosen.policy} {chosen.algorithm} "
            f"{chosen.compressor} r={chosen.chunks} on {hw.name}",
        )
        print(f"wrote {args.png}")
    print(json.dumps(out))
    return 0


def chosen_args(p) -> tuple:
    """predict()'s positional arguments after (hw, shape) for prediction `p`."""
    return p.policy, p.algorithm, p.compressors, p.chunks


def _only_or_keyed(path: str, key: str | None):
    """The record stored under `key` in `path`, or its only record when key is None."""
    if not os.path.isfile(path):
        raise ValueError(f"--profile {path!r} is not a file (write one with `schemoe profile`)")
    stored = profiles.keys(path)
    if key is None and len(stored) == 1:
        key = stored[0]
    hw = profiles.load(key, path) if key else None
    if hw is None and not stored:
        raise ValueError(f"--profile {path!r} holds no profile (write one with `schemoe profile`)")
    if hw is None:
        want = f"--key {key!r} is not" if key else "several profiles are"
        raise ValueError(f"{want} in --profile {path!r} (it holds {stored}); pass --key KEY")
    return hw


def _validate(args: argparse.Namespace) -> int:
    """validate.run, once every file the arguments name is there (named as typed)."""
    for spec in args.runs:
        for path in filter(None, spec.partition("=")[::2]):
            if not os.path.isfile(path):
                raise ValueError(f"RUNS {spec!r}: {path!r} is not a file")
    if args.profile and not os.path.isfile(args.profile):
        raise ValueError(f"--profile {args.profile!r} is not a file")
    return validate.run(args)


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="fit the cost model's constants on this cluster")
    p.add_argument("--nproc", type=int, default=4, help="local ranks when not launched")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: nproc / 2")
    p.add_argument("--link-rate", default=None, help="the inter-node rate for the key, e.g. "
                   "1gbit (default: the testbed's when run on it, else unshaped)")  # fmt: skip
    p.add_argument("--intra-rate", default=None, help="with --link-rate: the intra-node rate")
    p.add_argument("--intra-link", choices=("shared", "separate"), default=None,
                   help="with --intra-rate: what a rank link shapes (testbed --intra-link)")  # fmt: skip
    p.add_argument("--path", default=None, help="cache file (default ~/.cache/schemoe/...)")
    p.add_argument("--model-dim", type=int, default=512, help="the layer shape to fit at")
    p.add_argument("--hidden-dim", dest="hidden", type=int, default=1024, help="expert hidden dim")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--experts", type=int, default=None, help="E (default: 2 per rank)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available()
                   else "cpu", help="cuda: NCCL, one GPU per rank, CUDA-event timing")  # fmt: skip
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_checks(CHECKS)
    p.set_defaults(func=guard("schemoe profile", _profile))

    s = subparsers.add_parser("simulate", help="predicted step time per policy on a preset")
    s.add_argument("--preset", default="paper-32gpu", help="local, paper-32gpu, h100-64gpu")
    s.add_argument("--profile", default=None, help="a profile cache file instead of a preset")
    s.add_argument("--key", default=None, help="with --profile: the record's key (default: the "
                   "file's only one)")  # fmt: skip
    s.add_argument("--nodes", type=int, default=None, help="override the preset's node count")
    s.add_argument("--ranks-per-node", type=int, default=None, help="override the preset's")
    s.add_argument("--layers", type=int, default=1,
                   help="MoE layers per step (--step: the GPT's blocks, as in schemoe train)")  # fmt: skip
    add_layer_shape(s.add_argument, tokens=None, model_dim=None, hidden_dim=None,
                    capacity_factor=1.0, hidden_dest="hidden",
                    tokens_help="tokens per rank (B x L); not with --step",
                    shared_help="one shared expert of hidden dim HS: its task in the schedule; "
                                "the chosen configuration is also predicted with it before the "
                                "dispatch")  # fmt: skip
    s.add_argument("--seq-len", type=int, default=0, help="> 0 adds attention FLOPs per layer")
    s.add_argument(
        "--activation",
        default="gelu",
        choices=["relu", "gelu", "swiglu"],
        help="expert FFN activation",
    )
    s.add_argument("--dtype-bytes", type=int, default=4, choices=[2, 4], help="bytes per value")
    s.add_argument(
        "--budget",
        default="lossless",
        choices=["lossless", "fp16", "lossy"],
        help="compressors the tuner may choose",
    )
    s.add_argument("--max-chunks", type=int, default=8, help="largest r tried")
    s.add_argument("--systems", action="store_true", help="also each system as it ships")
    s.add_argument("--ablation", action="store_true", help="also the paper's ablation ladder")
    s.add_argument("--png", default=None, help="Gantt chart of the chosen configuration")
    simstep.add_arguments(s)
    simctmoe.add_arguments(s)
    s.add_checks(CHECKS)
    s.record_explicit = True  # --ctmoe refuses the shape flags it does not use
    s.set_defaults(func=guard("schemoe simulate", _simulate))

    v = subparsers.add_parser("validate", help="simulated vs measured `schemoe bench layer` rows")
    v.add_argument("runs", nargs="+", help="saved bench outputs, each BENCH.txt[=PROFILE.json]")
    v.add_argument("--profile", default=None, help="profile cache for runs without =PROFILE")
    v.add_argument("--png", default=None, help="predicted-vs-measured scatter plot")
    v.set_defaults(func=guard("schemoe validate", _validate))
