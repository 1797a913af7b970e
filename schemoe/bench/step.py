"""One full training step of the main job's model (`schemoe train`'s GPT), per candidate.

A sample is one step, and it is `schemoe train`'s step: `schemoe.train.step.train_step`, the
same function (zero_grad; per micro-batch of --grad-accum: forward, cross-entropy + aux,
backward, DDP syncing on the last; the loss mean over ranks, one all-reduce and one host sync;
average_expert_gradients; global-norm clipping; AdamW step, as `schemoe train` builds it).
Candidates are every combination of --policies x --chunks x --micro-chunks x --grad-syncs x
--grad-compressors (micro-chunks m > 1: the blocks run as a wavefront stack, schemoe/stack.py), and
with `--peer deepspeed` the same model (same dense parts, E, k, f) with DeepSpeed-MoE's layer
under DDP (its experts left out of DDP, as DeepSpeed's own engine does).

The step's parts, timed in the same run, interleaved with the candidates:
- compute: one rank at a time runs the same per-rank work with no network (the model on one-rank
  groups: all E experts, its own tokens, i.e. the rows a rank computes in the distributed step;
  no DDP) while the others wait: `compute1_ms`; `compute_ms` = compute1 x max(1, P / K) for P
  ranks on K cores, a bound on the step's compute (bench/parts.py says why);
- network: the step's collectives alone, back to back, with their real sizes: per MoE layer four
  all-to-alls of its dispatch buffer (--algorithm; every rank routes the same
  tokens, declared as `schemoe train` does, so no counts are exchanged),
  then the dense gradients' all-reduce (fp32, or bf16/fp16 for the rows that compress them),
  and the loss all-reduce: `network_ms` per gradient dtype.
Each row's `lower_bound_ms` = max(compute_ms, its network_ms) and `network_share` = network_ms /
the row's median. Neither part models what overlapping costs (CPU ranks' comm threads take cycles
from compute; see docs), so a bound is not always reachable.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import config as c
from .. import trace
from ..collectives import ALGORITHMS
from ..costmodel.plans import StepPlan
from ..dist.timing import measure
from ..layer.parallel import ddp_ignore_experts
from ..scheduling import POLICIES
from ..step.gradsync import COMPRESS, SYNCS, data_parallel
from ..train.model import GPT, GPTConfig
from ..train.setup import optimizer
from ..train.step import StepRecord, train_step
from ..tuning.auto import TUNED, AutoTuner
from . import autostep, bound, output, parts
from .layer import _deepspeed, check_optional

__all__ = ["add_arguments", "bench", "row_count", "timed_step", "validate"]


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--policies", type=_csv, default=["schemoe"], help="comma list of policies")
    a("--chunks", type=lambda s: [int(v) for v in _csv(s)], default=[2], help="comma list of r")
    a("--grad-syncs", dest="grad_sync", type=_csv, default=["ddp"],
      help=f"comma list of {', '.join(SYNCS)}")  # fmt: skip
    a("--grad-compressors", dest="grad_compress", type=_csv, default=["none"],
      help="comma list of none, bf16, fp16")  # fmt: skip
    a("--grad-algorithm", choices=("flat", "hier"), default="flat", help="scheduled sync")
    a("--bucket-mb", type=float, default=1.0, help="DDP bucket MiB for every row")
    a("--grad-windows", dest="grad_window", type=lambda s: [int(v) for v in _csv(s)], default=[1],
      help="comma list of buckets in flight at once (scheduled rows; DDP rows: 1)")  # fmt: skip
    a("--micro-chunks", type=lambda s: [int(v) for v in _csv(s)], default=[1],
      help="comma list of m, micro-chunks pipelined through the blocks")  # fmt: skip
    a("--peer", type=_csv, default=[], help="deepspeed: DeepSpeed-MoE's layer, same model")
    m = p.add_argument_group("the model (schemoe train's flags)").add_argument
    m("--model-dim", type=int, default=128, help="model dim M")
    m("--hidden-dim", type=int, default=256, help="expert and dense FFN hidden dim H")
    m("--experts", type=int, default=None, help="E (default: 2 per rank)")
    m("--top-k", type=int, default=2, help="k")
    m("--capacity-factor", type=float, default=1.25, help="f")
    m("--layers", type=int, default=4, help="blocks")
    m("--heads", type=int, default=4, help="attention heads")
    m("--moe-every", type=int, default=2, help="an MoE FFN in every n-th block")
    m("--seq-len", type=int, default=64, help="tokens per sequence")
    m("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    m("--grad-accum", type=int, default=1, help="micro-batches per step (as schemoe train's)")
    m("--algorithm", default="naive", help="all-to-all algorithm")
    t = p.add_argument_group("timing").add_argument
    t("--warmup", type=int, default=2, help="unmeasured rounds")
    t("--repeats", type=int, default=5, help="measured rounds")
    t("--trace", default=None, metavar="DIR",
      help="after timing, trace one step of each row: DIR/<row>.json + .png")  # fmt: skip
    t("--measured-bound", action="store_true",
      help="also measure each row's bound: a compute pass of the same rows on unshaped loopback "
      "first, the testbed's eth0 bytes per step / its rate (bench/bound.py)")  # fmt: skip
    autostep.add_arguments(p.add_argument_group("the step's cost model"))
    p.set_defaults(bound_pass=False, compute_measured=None)  # set by the launcher, no flags


def validate(args: argparse.Namespace) -> None:
    for name in args.policies:
        if name != "auto":
            POLICIES.get(name)
    ALGORITHMS.get(args.algorithm)
    for s in args.grad_sync:
        if s not in SYNCS:
            raise ValueError(f"--grad-syncs must be a list of {SYNCS}, got {s!r}")
    for s in args.grad_compress:
        if s not in COMPRESS:
            raise ValueError(f"--grad-compressors must list {sorted(COMPRESS)}, got {s!r}")
    if any(w < 1 for w in args.grad_window):
        raise ValueError(f"--grad-windows must be >= 1, got {args.grad_window}")
    if args.grad_accum < 1:
        raise ValueError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    if any(r < 1 for r in args.chunks):
        raise ValueError(f"--chunks must be >= 1, got {args.chunks}")
    if any(m < 1 or args.batch % m for m in args.micro_chunks):
        raise ValueError(
            f"--micro-chunks must be >= 1 and divide --batch {args.batch}, got {args.micro_chunks}"
        )
    if "deepspeed" in args.peer and args.top_k not in (1, 2):
        raise ValueError(f"--peer deepspeed needs --top-k 1 or 2, got {args.top_k}")
    for p in args.peer:
        if p != "deepspeed":
            raise ValueError(f"--peer must be deepspeed, got {p!r}")
    tuned = [name for name in args.policies if name in TUNED]
    if args.measured_bound and tuned:
        raise ValueError(
            f"--measured-bound with --policies {','.join(tuned)}: the loopback compute pass "
            "would tune for other links than the measured pass; list fixed policies"
        )
    autostep.validate(args)
    check_optional(args)


def row_count(args: argparse.Namespace) -> int:
    """The rows `_candidates` builds a model for: the grid (DDP rows once, not per window) and
    the peers."""
    syncs = sum(len(args.grad_window) if s == "scheduled" else 1 for s in args.grad_sync)
    grid = len(args.policies) * len(args.chunks) * len(args.micro_chunks) * len(args.grad_compress)
    return grid * syncs + len(args.peer)


def _moe_config(args, rpn: int, policy: str = "sequential", r: int = 1) -> c.MoEConfig:
    return c.MoEConfig(
        gate=c.GateConfig(
            num_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor
        ),
        experts=c.ExpertConfig(model_dim=args.model_dim, hidden_dim=args.hidden_dim),
        parallel=c.ParallelConfig(ranks_per_node=rpn, uniform_tokens=True),  # as schemoe train
        schedule=c.ScheduleConfig(policy=policy, chunks=r),
        collective=c.CollectiveConfig(algorithm=args.algorithm),
    )


def _gpt(args, moe: c.MoEConfig, group=None, micro: int = 1) -> GPT:
    torch.manual_seed(0)  # the same dense weights in every candidate and on every rank
    cfg = GPTConfig(
        seq_len=args.seq_len,
        layers=args.layers,
        heads=args.heads,
        moe_every=args.moe_every,
        micro_chunks=micro,
    )
    return GPT(cfg, moe, group=group, seed=0)


class _DeepSpeedFFN(nn.Module):
    """DeepSpeed's MoE as a (y, aux) FFN of the GPT's blocks."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, h):
        y, l_aux, _counts = self.moe(h)
        return y, l_aux


def timed_step(
    model: nn.Module,
    core: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    *,
    grad_accum: int = 1,
    clip: float = 1.0,
    ep=None,
    group=None,
) -> Callable[[], StepRecord]:
    """A sample: one call of `train_step` (schemoe train's step). `ep`: the expert layout (None:
    the MoE layers' own group); `group`: where the loss is averaged (None: every rank)."""

    def run() -> StepRecord:
        return train_step(
            model, core, opt, batches, ep, clip=clip, grad_accum=grad_accum, group=group
        )

    return run


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """schemoe train's AdamW (a small lr: the samples repeat the same tokens)."""
    return optimizer(model, lr=1e-4, weight_decay=0.1)


def _spans(core: GPT) -> list:
    """Hooks recording each block's attention and dense FFN, forward and backward, as trace
    marks on the compute row (only while a trace is being recorded)."""
    hooks = []
    for i, blk in enumerate(core.blocks):
        parts = [(f"AT.{i}", blk.attn)] + ([] if blk.moe else [(f"FFN.{i}", blk.ffn)])
        for name, mod in parts:
            t0 = [0.0]

            def begin(*_, t0=t0):
                t0[0] = time.perf_counter()

            def end(direction, name=name, t0=t0):
                def hook(*_):
                    rec = trace.active(direction)
                    if rec is not None:
                        rec.record(trace.Mark(name, "compute"), t0[0], time.perf_counter())

                return hook

            hooks += [
                mod.register_forward_pre_hook(begin),
                mod.register_forward_hook(end("forward")),
                mod.register_full_backward_pre_hook(begin),
                mod.register_full_backward_hook(end("backward")),
            ]
    return hooks


def _trace(folder: str, steps: dict, cores: dict) -> None:
    """One traced step per row (collective: every rank takes part)."""
    os.makedirs(folder, exist_ok=True)
    for name, step in steps.items():
        hooks = _spans(cores[name])
        output.traced(step, folder, name)
        for h in hooks:
            h.remove()


def _candidates(args, world: int, rpn: int, batches) -> tuple[dict, list[dict], dict]:
    """Every row's sample (name -> timed_step), its row and its model (name -> core): the
    combinations of the flags, then the peers."""
    cands, rows, cores = {}, [], {}
    combos = itertools.product(
        args.policies, args.chunks, args.micro_chunks, args.grad_sync, args.grad_compress,
        args.grad_window,
    )  # fmt: skip
    for pol, r, mc, sync, comp, win in combos:
        if sync == "ddp" and win != args.grad_window[0]:
            continue  # DDP's buckets have no window: one row
        win = win if sync == "scheduled" else 1
        core = _gpt(args, _moe_config(args, rpn, pol, r), micro=mc)
        if pol in TUNED:
            AutoTuner(core)
        model, _ = data_parallel(
            ddp_ignore_experts(core),
            sync=sync,
            compress=comp,
            algorithm=args.grad_algorithm if sync == "scheduled" else "flat",
            bucket_mb=args.bucket_mb,
            window=win,
            ranks_per_node=rpn,
        )
        name = StepPlan(pol, r, mc, sync, comp).name + (f"/w{win}" if win != 1 else "")
        cands[name] = timed_step(model, core, _optimizer(core), batches, grad_accum=args.grad_accum)
        cores[name] = core
        rows.append({"policy": pol, "chunks": r, "grad_sync": sync, "grad_compress": comp,
                     "micro_chunks": mc, "grad_window": win, "_n": name})  # fmt: skip
    for peer in args.peer:
        core = _gpt(args, _moe_config(args, rpn))
        for blk in core.blocks:
            if blk.moe:
                blk.ffn = _DeepSpeedFFN(_deepspeed(_peer_args(args), world, torch.float32))
        skip = [n for n, p in core.named_parameters() if getattr(p, "allreduce", True) is False]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(core, skip)
        model, _ = data_parallel(core, bucket_mb=args.bucket_mb)
        cands[peer] = timed_step(model, core, _optimizer(core), batches, grad_accum=args.grad_accum)
        rows.append({"policy": peer, "chunks": 1, "grad_sync": "ddp", "grad_compress": "none",
                     "micro_chunks": 1, "grad_window": 1, "_n": peer})  # fmt: skip
    return cands, rows, cores


def bench(args: argparse.Namespace, env) -> dict[str, float]:
    """Time every row and print the report (rank 0); return each row's median (name -> ms), as
    the compute pass of --measured-bound returns it to its launcher, printing nothing."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rpn = env.ranks_per_node
    args.experts = args.experts or 2 * world
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
    targets = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
    accum = args.grad_accum

    def batches() -> tuple[torch.Tensor, torch.Tensor]:
        return tokens, targets  # every micro-batch the same tokens: the timing does not care

    cands, rows, cores = _candidates(args, world, rpn, batches)
    first = next(iter(cores.values()))
    # The parts. new_group is collective: every rank creates every one-rank group.
    solo = [dist.new_group([q]) for q in range(world)][rank]
    single = _gpt(args, _moe_config(args, 1), group=solo)
    opt = _optimizer(single)
    compute = timed_step(single, single, opt, batches, grad_accum=accum, group=solo)
    cands["parts:compute1"] = parts.one_at_a_time(compute, rank, world)
    algo = parts.algorithm(args.algorithm, rpn)  # what a tuned (auto) first row has no name for
    for comp in dict.fromkeys(args.grad_compress):
        dtype = COMPRESS[comp] or torch.float32
        cands[f"parts:network:{comp}"] = parts.network(args, first, algo, world, dtype)
    counts = bound.count_rows(args, env, rank, cands, [r["_n"] for r in rows])
    stats = measure(cands, warmup=args.warmup, repeats=args.repeats)
    medians = {r["_n"]: stats[r["_n"]].median_ms for r in rows}
    if args.bound_pass:  # the compute pass of --measured-bound: the launcher takes the medians
        return medians
    if counts is not None:  # collective: before the trace calls the steps again
        counts = bound.busiest_bytes(counts, args.repeats)
    if args.trace:
        _trace(args.trace, {n: cands[n] for n in cores}, cores)

    host_ranks = parts.host_ranks(env, world)
    compute1, compute_ms = parts.compute_bound(stats["parts:compute1"].median_ms, world, host_ranks)
    for row in rows:
        row.update(stats[row["_n"]].row())
    keys = ("model_dim", "hidden_dim", "experts", "top_k", "layers", "heads", "moe_every")
    config = {k: getattr(args, k) for k in keys}
    config |= {"f": args.capacity_factor, "seq_len": args.seq_len, "batch": args.batch,
               "grad_accum": args.grad_accum, "algorithm": args.algorithm,
               "bucket_mb": args.bucket_mb,
               "grad_algorithm": args.grad_algorithm, "warmup": args.warmup,
               "repeats": args.repeats}  # fmt: skip
    if args.auto_step:
        auto, auto_line = autostep.annotate(args, config, rows, env.profile_key(world))
    if args.measured_bound:
        rate = env.testbed.rate_bps if counts is not None else None
        bound.add_columns(rows, args.compute_measured, counts, rate)
    for row in rows:
        del row["_n"]
        net = stats[f"parts:network:{row['grad_compress']}"].median_ms
        row["network_ms"] = net
        row["lower_bound_ms"] = max(compute_ms, net)
        row["network_share"] = net / row["median_ms"]
    base = rows[0]["median_ms"]
    for row in rows:
        row["speedup"] = base / row["median_ms"]
    head = output.header("schemoe bench step", config, env.topology(world), env.link())
    nets = {k.split(":")[-1]: v.median_ms for k, v in stats.items() if k.startswith("parts:net")}
    head.append(
        f"# parts: compute1 {compute1:.1f} ms (one rank alone), compute bound {compute_ms:.1f} ms "
        f"({host_ranks} ranks on {parts.host_cores()} cores); network "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in nets.items())
    )
    if args.measured_bound:
        head.append(bound.header_line(env, world, counts is not None))
    if args.auto_step:
        head.append(auto_line)
    summary = {
        "results": rows,
        "compute1_ms": compute1,
        "compute_ms": compute_ms,
        "network_ms": nets,
        "link_rate_gbps": env.link_rate_gbps,
        "profile_key": env.profile_key(world),
        "world_size": world,
        "ranks_per_node": rpn,
    }
    if args.auto_step:
        summary["auto_step"] = auto
    cols = ["policy", "chunks", "micro_chunks", "grad_sync", "grad_compress", "grad_window", "median_ms",
            "p10_ms", "p90_ms", "lower_bound_ms", "network_share", "speedup"]  # fmt: skip
    if args.measured_bound:
        cols += ["compute_measured_ms", "network_measured_ms", "measured_bound_ms", "bound_ratio"]
    cols += ["predicted_ms"] if args.auto_step else []
    output.report(head, rows, cols, summary)
    return medians


def _peer_args(args) -> argparse.Namespace:
    """bench layer's DeepSpeed builder reads these names."""
    return argparse.Namespace(
        model_dim=args.model_dim,
        hidden_dim=args.hidden_dim,
        experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
    )
