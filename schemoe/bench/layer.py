"""One MoE layer, forward and backward, per candidate configuration, plus its lower bound.

Each step is `zero_grad; y, aux = layer(x); (y * g).sum() + aux; backward` on T tokens per rank.
Candidates are every combination of --policies x --algorithms x --compressors x --chunks (a
compressor "a/b" means forward a, backward b; plain "a" means both), and with `--peer deepspeed`
DeepSpeed's `deepspeed.moe.layer.MoE` at the same E, k, f, M, H (gelu, no bias, no token noise).
With `--shared-hidden Hs` every candidate has one shared expert of hidden dim Hs and runs twice:
its S task where the policy places it (shared=scheduled, under the dispatch all-to-alls) and
before the dispatch (shared=before, no overlap, as running it outside the layer).

The lower bound and the all-to-all share come from two parts timed separately, interleaved with
the candidates in the same run, for the first --algorithms entry without compression
(bench/parts.py):
- compute: the same layer on a one-rank group (every rank builds all E experts and routes its own
  T tokens), one rank at a time while the others wait. Each rank computes the same shapes as in
  the distributed step: E experts x C rows, since E/P experts x P*C rows = E*C; its all-to-alls
  are local copies. `compute1_ms` is one rank's turn, `compute_ms` = compute1 x max(1, P / K)
  for P ranks on K cores.
- comm: the all-to-alls of one step alone: the counts exchange (dropless only: every rank routes
  --tokens tokens, declared with ParallelConfig(uniform_tokens=True)), then dispatch and combine forward
  and their two gradients backward, each [E*C, M] (dropless: [k*T, M]) split evenly over ranks.
lower_bound_ms = max(compute_ms, comm_ms): no candidate's step can beat it beyond noise;
a2a_share = comm / the first candidate's step time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import itertools
import logging
import os
import sys

import torch
import torch.distributed as dist

from .. import compression
from .. import config as c
from ..cliargs import Check, add_layer_shape, for_flag, int_list, names
from ..collectives import ALGORITHMS
from ..compression import COMPRESSORS
from ..costmodel import profiles
from ..costmodel.model import A2A_MODELS
from ..costmodel.prediction import predict_ms
from ..dist.devices import comm_device, control_zeros
from ..dist.timing import measure
from ..layer.moe import MoELayer
from ..routing.layout import Partition
from ..routing.router import capacity
from ..scheduling import POLICIES
from ..tuning.auto import TUNED, AutoTuner
from . import experts, output, parts

__all__ = ["CHECKS", "add_arguments", "bench", "check_world", "validate"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# Each flag's range, checked right after parsing (cliargs.Parser.add_checks), beyond the ones
# every command shares (cliargs.FLAG_CHECKS: --chunks, --tokens, --model-dim, --experts, ...).
CHECKS = {
    "--policies": Check(),
    "--algorithms": Check(),
    "--compressors": Check(),
    "--shared-hidden": Check(0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", type=names, default=["sequential"],
                   help=f"comma list of: {', '.join(POLICIES.names())}, auto")  # fmt: skip
    p.add_argument("--algorithms", type=names, default=["naive"],
                   help=f"comma list of: {', '.join(ALGORITHMS.names())}")  # fmt: skip
    p.add_argument("--compressors", type=names, default=["none"],
                   help=f"comma list, each a name or fwd/bwd: {', '.join(COMPRESSORS.names())}")  # fmt: skip
    p.add_argument("--chunks", type=int_list, default=[1],
                   help="comma list of r")  # fmt: skip
    p.add_argument("--peer", choices=["deepspeed"], action="append", default=[],
                   help="also time DeepSpeed-MoE's layer at the same shape (repeatable)")  # fmt: skip
    add_layer_shape(p.add_argument, tokens=1024, model_dim=256, hidden_dim=1024,
                    capacity_factor=1.25,
                    shared_help="one shared expert of hidden dim HS in every candidate, each run "
                                "with its task scheduled and before the dispatch (0: none)")  # fmt: skip
    p.add_argument("--dtype", choices=list(_DTYPES), default="fp32", help="activations and weights")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank (cuda:LOCAL_RANK), NCCL, CUDA-event timing",
    )
    p.add_argument("--warmup", type=int, default=2, help="unmeasured rounds")
    p.add_argument("--repeats", type=int, default=10, help="measured rounds")
    p.add_argument(
        "--predict",
        action="store_true",
        help="add the cost model's predicted_ms to each row (needs `schemoe profile` first)",
    )
    p.add_argument(
        "--profile", default=None, metavar="PATH", help="profile store for --predict and auto"
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="after timing, trace one step of each candidate: DIR/<name>.json + .png",
    )
    experts.add_arguments(p)


def validate(args: argparse.Namespace) -> None:
    """What the names and several flags together allow (ValueError naming the flag), before
    any rank starts; each flag's own range is its Check (CHECKS)."""
    with for_flag("--policies"):
        for name in args.policies:
            if name != "auto":
                POLICIES.get(name)  # unknown names list the known ones
    with for_flag("--algorithms"):
        for name in args.algorithms:
            ALGORITHMS.get(name)
    with for_flag("--compressors"):
        for spec in args.compressors:
            for name in spec.split("/"):
                compression.build(name)  # also: zfp without zfpy
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    if "deepspeed" in args.peer and args.top_k not in (1, 2):
        raise ValueError(
            f"--peer deepspeed needs --top-k 1 or 2 (DeepSpeed's gate), got {args.top_k}"
        )
    if args.predict and (bad := [a for a in args.algorithms if a not in A2A_MODELS]):
        raise ValueError(
            f"--predict: the cost model has no model of --algorithms {','.join(bad)} "
            f"(it models {', '.join(A2A_MODELS)})"
        )
    check_optional(args)
    experts.validate(args)


def check_world(args: argparse.Namespace, env, world: int) -> None:
    """--predict needs a profile of this run's topology and links (`schemoe profile` stores it):
    without one every row's predicted_ms would be null. The expert rows' E divide the ranks."""
    experts.validate(args, world)
    if not args.predict:
        return
    key = env.profile_key(world)
    if profiles.load(key, args.profile) is None:
        where = args.profile or profiles.DEFAULT_PATH
        held = ", ".join(profiles.keys(args.profile)) or "none"
        raise ValueError(
            f"--predict: no profile {key!r} in --profile {where} (it holds: {held}); run "
            "`schemoe profile` on this topology first, or drop --predict"
        )


def check_optional(args: argparse.Namespace) -> None:
    """The optional packages the flags need, before any rank starts (bench layer and step)."""
    if "deepspeed" in args.peer and importlib.util.find_spec("deepspeed") is None:
        raise ValueError("--peer deepspeed needs DeepSpeed: pip install deepspeed")
    if args.trace and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            f"--trace {args.trace} draws a Gantt PNG per row and needs matplotlib: "
            "pip install matplotlib"
        )


def import_deepspeed():
    """`deepspeed`, with its log messages on stderr: stdout carries the bench's header, table
    and JSON line. DeepSpeed's logger binds the stdout of the moment it is created (at import,
    where it already logs the accelerator it found), so the import runs with stdout pointed at
    stderr and any handler on stdout is moved to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed
        from deepspeed.utils.logging import logger
    for h in logger.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)
    return deepspeed


def _config(args, world: int, rpn: int, policy="sequential", algo="naive", comp="none", r=1):
    fwd, _, bwd = comp.partition("/")
    return c.MoEConfig(
        gate=c.GateConfig(
            num_experts=args.experts or 2 * world,
            top_k=args.top_k,
            capacity_factor=args.capacity_factor,
        ),
        experts=c.ExpertConfig(model_dim=args.model_dim, hidden_dim=args.hidden_dim),
        # Every rank routes --tokens tokens at every call: capacity mode needs no counts exchange.
        parallel=c.ParallelConfig(ranks_per_node=rpn, uniform_tokens=True),
        schedule=c.ScheduleConfig(policy=policy, chunks=r),
        collective=c.CollectiveConfig(algorithm=algo),
        compression=c.CompressionConfig(forward=fwd, backward=bwd or fwd),
    )


def _shared(cfg: c.MoEConfig, args, placement: str | None) -> c.MoEConfig:
    """`cfg` with --shared-hidden's shared expert placed as `placement` (None: as it is)."""
    if placement is None:
        return cfg
    shared = c.SharedExpertConfig(num=1, hidden_dim=args.shared_hidden, placement=placement)
    return dataclasses.replace(cfg, shared=shared)


def _deepspeed(args, world: int, dtype: torch.dtype) -> torch.nn.Module:
    deepspeed = import_deepspeed()
    from deepspeed.moe.layer import MoE

    M, H = args.model_dim, args.hidden_dim
    expert = torch.nn.Sequential(
        torch.nn.Linear(M, H, bias=False), torch.nn.GELU(), torch.nn.Linear(H, M, bias=False)
    )
    # Its backend and group set-up print() to stdout ("... built successfully", "No existing
    # process group found ..."): stderr, as its log.
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="gloo")  # reuses the initialised default group
        moe = MoE(
            hidden_size=M,
            expert=expert,
            num_experts=args.experts or 2 * world,
            ep_size=world,
            k=args.top_k,
            capacity_factor=args.capacity_factor,
            min_capacity=0,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        moe.set_deepspeed_parallelism()  # creates its expert-parallel groups (collective)
    return moe.to(dtype)


def _step(module, x, g):
    def run():
        module.zero_grad(set_to_none=True)
        out = module(x)
        loss = (out[0] * g).sum() + out[1]
        loss.backward()

    return run


def _comm_only(gate: c.GateConfig, algo, args, world: int, dtype: torch.dtype):
    """The step's all-to-alls alone, with the layer's shapes, on `algo`."""
    rows = (
        gate.num_experts * capacity(gate, args.tokens)
        if not gate.dropless
        else gate.top_k * args.tokens
    )
    per = [rows // world + (d < rows % world) for d in range(world)]
    x = torch.randn(sum(per), args.model_dim, dtype=dtype)
    counts = control_zeros(gate.num_experts, dtype=torch.long)

    def run():
        if gate.dropless:  # capacity mode with uniform tokens exchanges no counts
            dist.all_to_all_single(torch.empty_like(counts), counts)
        for _ in range(4):  # dispatch, combine; then their gradients in backward
            algo.start(x, per, per).wait()

    return run


def _trace(folder: str, layers: dict, x: torch.Tensor, g: torch.Tensor) -> None:
    """One traced forward+backward step per candidate (collective: every rank takes part)."""
    os.makedirs(folder, exist_ok=True)
    for name, layer in layers.items():
        output.traced(_step(layer, x, g), folder, name)


def bench(args: argparse.Namespace, env) -> None:
    """Collective: every rank runs the candidates; tensors and layers on the backend's device."""
    with torch.device(comm_device()):
        _bench(args, env)


def _bench(args: argparse.Namespace, env) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(1234 + rank)
    x = torch.randn(args.tokens, args.model_dim, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    cands, rows, layers = {}, [], {}
    combos = list(itertools.product(args.policies, args.algorithms, args.compressors, args.chunks))
    if "auto" in args.policies:  # one row: the cost model picks algorithm, compressor and r
        combos = [c for c in combos if c[0] != "auto"] + [("auto", "naive", "none", 1)]
    placements = ("scheduled", "before") if args.shared_hidden else (None,)
    for (pol, algo, comp, r), place in itertools.product(combos, placements):
        if pol != "auto" and POLICIES.get(pol).partition == Partition.PEERS and r > world:
            continue  # the peers partition has at most P chunks
        cfg = _shared(_config(args, world, env.ranks_per_node, pol, algo, comp, r), args, place)
        layer = MoELayer(cfg).to(dtype)
        if not cands:
            first = layer
        name = f"{pol}/{algo}/{comp}/r{r}" + (f"/shared-{place}" if place else "")
        cands[name] = _step(layer, x, g)
        layers[name] = layer
        rows.append({"policy": pol, "algorithm": algo, "compressor": comp, "chunks": r, "_n": name})
        if place:
            rows[-1]["shared"] = place
    for peer in args.peer:
        cands[peer] = _step(_deepspeed(args, world, dtype), x, g)
        rows.append({"policy": peer, "algorithm": "deepspeed", "compressor": "none", "chunks": 1,
                     "_n": peer})  # fmt: skip
    expert_cands, expert_rows = experts.candidates(args, env, x, g, _step, dtype)
    cands |= expert_cands
    # The parts: one-rank groups (new_group is collective: every rank creates all of them).
    solo = [dist.new_group([q]) for q in range(world)][rank]
    single_cfg = _shared(_config(args, 1, 1, algo=args.algorithms[0]), args, placements[0])
    single = MoELayer(single_cfg, group=solo).to(dtype)
    cands["parts:compute1"] = parts.one_at_a_time(_step(single, x, g), rank, world)
    algo = parts.algorithm(args.algorithms[0], env.ranks_per_node)
    cands["parts:comm"] = _comm_only(first.config.gate, algo, args, world, dtype)
    tuners = {
        name: AutoTuner(layer, profile_path=args.profile, links=env.links)
        for name, layer in layers.items()
        if layer.config.schedule.policy in TUNED
    }
    for name, tuner in tuners.items():
        cands[name]()  # policy "search" decides on its first call
        while tuner.tuning:  # policy "auto": its trials run first (same calls on every rank)
            cands[name]()
    stats = measure(cands, warmup=args.warmup, repeats=args.repeats)
    if args.trace:
        _trace(args.trace, layers, x, g)

    for row in rows:
        name = row.pop("_n")
        row.update(stats[name].row())
        if row["policy"] == "auto":  # what it chose
            run = layers[name].running.summary()
            row.update(policy=f"auto:{run['policy']}", algorithm=run["algorithm"],
                       compressor=run["compression"], chunks=run["chunks"])  # fmt: skip
        if args.predict and name in layers:
            shape = (world // env.ranks_per_node, env.ranks_per_node)
            row["predicted_ms"] = predict_ms(
                layers[name].running, args.tokens, shape, env.links, path=args.profile
            )
    host_ranks = parts.host_ranks(env, world)
    compute1, compute = parts.compute_bound(stats["parts:compute1"].median_ms, world, host_ranks)
    comm = stats["parts:comm"].median_ms
    part_rows = [{"policy": "parts", "algorithm": "compute bound", "compressor": "-",
                  "chunks": "-", "median_ms": compute},
                 {"policy": "parts", "algorithm": "all-to-all only", "compressor": "-",
                  "chunks": "-", **stats["parts:comm"].row()}]  # fmt: skip
    config = {k: getattr(args, k) for k in ("tokens", "model_dim", "hidden_dim", "top_k", "dtype")}
    config |= {"experts": first.config.gate.num_experts, "f": args.capacity_factor,
               "warmup": args.warmup, "repeats": args.repeats}  # fmt: skip
    if args.shared_hidden:
        config["shared_hidden"] = args.shared_hidden
    head = output.header("schemoe bench layer", config, env.topology(world), env.link())
    head += experts.header(args)
    trials = [row for tuner in tuners.values() for row in tuner.report]
    measured = [row for tuner in tuners.values() for row in tuner.measured]
    head += [f"# auto profile (one-time, no profile stored): {m}" for m in measured]
    head += [f"# auto trial: {t}" for t in trials]
    head.append(
        f"# parts: compute1 {compute1:.1f} ms (one rank alone), compute bound {compute:.1f} ms "
        f"({host_ranks} ranks on {parts.host_cores()} cores); all-to-alls {comm:.1f} ms"
    )
    summary = {
        "results": rows,
        "lower_bound_ms": max(compute, comm),
        "a2a_share": comm / rows[0]["median_ms"],
        "compute1_ms": compute1,
        "compute_ms": compute,
        "comm_ms": comm,
        "link_rate_gbps": env.link_rate_gbps,
        "world_size": world,
        "ranks_per_node": env.ranks_per_node,
        "auto_trials": trials,
        "auto_profile": measured,
        "profile_key": env.profile_key(world),
    }
    if expert_rows:
        summary["experts"] = experts.report(expert_rows, stats)
    cols = ["policy", "algorithm", "compressor", "chunks", "median_ms", "p10_ms", "p90_ms"]
    if args.shared_hidden:
        cols.insert(4, "shared")
        cols += ["predicted_ms"] if args.predict else []
    output.report(head, rows + part_rows + expert_rows, cols, summary)
