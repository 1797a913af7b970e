"""`schemoe bench layer`'s expert rows: grouped vs per-expert-loop experts, dropless vs
capacity-padded, at several (E, k) with the same active FLOPs, and the dense bound of that work.

Selected by flags of `schemoe bench layer` (no flag: no rows):
  --experts-impl grouped,loop  one layer row per impl x mode x shape: the whole layer, forward +
                               backward, as the other rows (policy, algorithm, r: the first of
                               --policies, --algorithms, --chunks; no compression). Modes:
                               dropless (f=0) and capacity-padded at --capacity-factor (only
                               dropless when it is 0).
  --dedup                      also a "dropless dedup" row per impl and shape: dropless with
                               ParallelConfig.dedup (a token sent once per rank it reaches).
  --expert-shapes 8x2,64x6     E x k per shape. Every shape has the same active FLOPs per token:
                               its hidden dim is H_s = k_0 H / k_s, with H = --hidden-dim and
                               k_0 the first shape's k (k_s H_s = k_0 H).
  --dense-bound                per shape, the expert compute alone (forward + backward of all
                               E experts on N = k T rows, one rank at a time, counts from routing
                               this rank's tokens) for each impl, and the same FLOPs as one dense
                               FFN (one matmul per projection over all N rows, hidden H_s): the
                               machine's bound for that work.

The rows go into the printed table and the JSON line's "experts" object (not "results", whose
rows share one shape and one lower bound), with the ratios the issue names: dropless-grouped /
capacity-padded (each impl), the last shape / the first (dropless grouped), grouped expert
compute / dense bound; with --dedup, dedup / dropless (grouped) per shape and the last shape
/ the first with dedup.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import config as c
from ..cliargs import names
from ..dist.timing import Stats
from ..experts.ffn import BatchedFFN
from ..layer.moe import MoELayer
from ..routing.router import route
from . import parts

__all__ = ["Shape", "add_arguments", "candidates", "header", "report", "shapes", "validate"]

IMPLS = c.EXPERT_IMPLS


def _shape_list(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        e, _, k = item.strip().lower().partition("x")
        if not (e.isdigit() and k.isdigit()):
            raise argparse.ArgumentTypeError(f"expected ExK pairs like 8x2,64x6, got {item!r}")
        out.append((int(e), int(k)))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert rows (grouped vs loop, dropless vs padded, dense bound)")
    g.add_argument("--experts-impl", type=names,
                   default=[], help=f"comma list of: {', '.join(IMPLS)}; adds the expert rows")  # fmt: skip
    g.add_argument("--expert-shapes", type=_shape_list, default="8x2,64x6",
                   help="comma list of E x k; hidden dim scaled so k x H stays constant")  # fmt: skip
    g.add_argument("--dedup", action="store_true",
                   help="also dropless rows with token deduplication (ParallelConfig.dedup)")  # fmt: skip
    g.add_argument("--dense-bound", action="store_true",
                   help="also time the expert compute alone and one dense FFN of its FLOPs")  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """One (E, k, H) of the expert rows."""

    experts: int
    top_k: int
    hidden: int

    @property
    def name(self) -> str:
        return f"E{self.experts} k{self.top_k} H{self.hidden}"


def shapes(args: argparse.Namespace) -> list[Shape]:
    """The shapes, hidden dims scaled to the first shape's active FLOPs (ValueError if not whole)."""
    k0 = args.expert_shapes[0][1]
    out = []
    for e, k in args.expert_shapes:
        if (k0 * args.hidden_dim) % k:
            raise ValueError(
                f"--hidden-dim {args.hidden_dim}: the {e}x{k} shape of --expert-shapes needs "
                f"H = {k0} x {args.hidden_dim} / {k} to be whole; pick a --hidden-dim that "
                f"every k of --expert-shapes divides {k0} x H by"
            )
        out.append(Shape(e, k, k0 * args.hidden_dim // k))
    return out


def validate(args: argparse.Namespace, world: int | None = None) -> None:
    """The expert flags together (ValueError naming the flag); `world` once it is known."""
    if not args.experts_impl:
        for flag in ("dense_bound", "dedup"):
            if getattr(args, flag):
                raise ValueError(
                    f"--{flag.replace('_', '-')} times expert rows: add --experts-impl"
                )
        return
    if bad := [n for n in args.experts_impl if n not in IMPLS]:
        raise ValueError(f"--experts-impl: unknown {', '.join(bad)}; known: {', '.join(IMPLS)}")
    for s in shapes(args):
        if not 1 <= s.top_k <= s.experts:
            raise ValueError(f"--expert-shapes: k must be in 1..E, got {s.experts}x{s.top_k}")
        if world and s.experts % world:
            raise ValueError(
                f"--expert-shapes: E={s.experts} must be divisible by the {world} ranks"
            )


def header(args: argparse.Namespace) -> list[str]:
    """The header line of the expert rows: the shapes and what they hold constant."""
    if not args.experts_impl:
        return []
    ss = shapes(args)
    line = (
        f"# expert rows: {', '.join(s.name for s in ss)}: k x H = {ss[0].top_k * ss[0].hidden} "
        f"(same active FLOPs per token), M {args.model_dim}, {args.tokens} tokens per rank; "
        "experts-only and dense-bound rows are one rank's turn alone"
    )
    return [line]


def _layer_config(args, s: Shape, impl: str, f: float, rpn: int, dedup: bool) -> c.MoEConfig:
    return c.MoEConfig(
        gate=c.GateConfig(num_experts=s.experts, top_k=s.top_k, capacity_factor=f),
        experts=c.ExpertConfig(model_dim=args.model_dim, hidden_dim=s.hidden, impl=impl),
        parallel=c.ParallelConfig(ranks_per_node=rpn, uniform_tokens=True, dedup=dedup),
        schedule=c.ScheduleConfig(policy=args.policies[0], chunks=args.chunks[0]),
        collective=c.CollectiveConfig(algorithm=args.algorithms[0]),
    )


def _ffn_step(ffn: BatchedFFN, x_NM: torch.Tensor, g_NM: torch.Tensor, counts) -> Callable:
    def run() -> None:
        ffn.zero_grad(set_to_none=True)
        ffn(x_NM, counts).backward(g_NM)

    return run


def candidates(args, env, x, g, step: Callable, dtype) -> tuple[dict, list[dict]]:
    """{name: callable} to time with the other rows, and their row stubs ("_n": name, "_turns":
    P when the time is P one-rank turns). Collective (layers, one-rank turns)."""
    if not args.experts_impl:
        return {}, []
    world, rank = dist.get_world_size(), dist.get_rank()
    policy = args.policies[0]
    if policy in ("auto", "search"):
        policy = "sequential"  # the expert rows run a fixed order
    args = argparse.Namespace(**{**vars(args), "policies": [policy]})
    modes = [(0.0, False)] + ([(0.0, True)] if args.dedup else [])
    modes += [(args.capacity_factor, False)] if args.capacity_factor > 0 else []
    cands, rows = {}, []
    for s in shapes(args):
        for f, dedup in modes:
            for impl in args.experts_impl:
                cfg = _layer_config(args, s, impl, f, env.ranks_per_node, dedup)
                mode = "dropless dedup" if dedup else "dropless" if f == 0 else f"f={f}"
                name = f"experts:{s.name}/{impl}/{mode}"
                cands[name] = step(MoELayer(cfg).to(dtype), x, g)
                rows.append(_row(s, impl, mode, name, 1))
        if not args.dense_bound:
            continue
        # The expert compute alone, one rank at a time: every expert on this rank's k T rows.
        gate = c.GateConfig(num_experts=s.experts, top_k=s.top_k, capacity_factor=0.0)
        w_EM = torch.randn(s.experts, args.model_dim, generator=torch.Generator().manual_seed(5))
        counts = route(x.detach().float(), w_EM, gate).host_counts()
        N = sum(counts)
        x_NM = torch.randn(N, args.model_dim, dtype=dtype)
        g_NM = torch.randn_like(x_NM)
        for impl in args.experts_impl:
            ex = c.ExpertConfig(model_dim=args.model_dim, hidden_dim=s.hidden, impl=impl)
            ffn = BatchedFFN(ex, s.experts).to(dtype)
            name = f"experts:{s.name}/{impl}/compute"
            cands[name] = parts.one_at_a_time(_ffn_step(ffn, x_NM, g_NM, counts), rank, world)
            rows.append(_row(s, impl, "experts only", name, world))
        dense = BatchedFFN(
            c.ExpertConfig(model_dim=args.model_dim, hidden_dim=s.hidden, impl="loop"), 1
        ).to(dtype)
        name = f"experts:{s.name}/dense"
        cands[name] = parts.one_at_a_time(_ffn_step(dense, x_NM, g_NM, (N,)), rank, world)
        rows.append(_row(s, "dense bound", f"1 x {N} rows", name, world))
    return cands, rows


def _row(s: Shape, impl: str, mode: str, name: str, turns: int) -> dict:
    return {"policy": s.name, "algorithm": impl, "compressor": mode, "chunks": "-",
            "_n": name, "_turns": turns}  # fmt: skip


def report(rows: list[dict], stats: dict[str, Stats]) -> dict:
    """Fill the rows' times (one-rank turns: per rank); the JSON object with the ratios."""
    by = {}
    for row in rows:
        name, turns = row.pop("_n"), row.pop("_turns")
        row.update({k: v / turns for k, v in stats[name].row().items()})
        by[(row["policy"], row["algorithm"], row["compressor"])] = row["median_ms"]
    ratios = {}
    names = list(dict.fromkeys(r["policy"] for r in rows))
    for s in names:
        padded = [m for (p, _, m) in by if p == s and m.startswith("f=")]
        for impl in IMPLS:
            for m in padded:
                if (s, "grouped", "dropless") in by and (s, impl, m) in by:
                    ratios[f"{s}: dropless grouped / {impl} {m}"] = (
                        by[(s, "grouped", "dropless")] / by[(s, impl, m)]
                    )
        if (s, "grouped", "dropless dedup") in by and (s, "grouped", "dropless") in by:
            ratios[f"{s}: dedup grouped / dropless grouped"] = (
                by[(s, "grouped", "dropless dedup")] / by[(s, "grouped", "dropless")]
            )
        if (s, "grouped", "experts only") in by:
            dense = next(v for (p, a, _), v in by.items() if p == s and a == "dense bound")
            ratios[f"{s}: grouped experts / dense bound"] = (
                by[(s, "grouped", "experts only")] / dense
            )
    for mode in ("dropless", "dropless dedup"):
        if len(names) > 1 and all((s, "grouped", mode) in by for s in names):
            first, last = names[0], names[-1]
            ratios[f"{mode} grouped: {last} / {first}"] = (
                by[(last, "grouped", mode)] / by[(first, "grouped", mode)]
            )
    return {"rows": rows, "ratios": ratios}
