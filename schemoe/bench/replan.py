"""Re-planning under drifting routing: a fixed plan, the Replanner, and the best fixed plans.

A stack of --layers MoE layers (dropless, or capacity mode at --capacity-factor F > 0) trains
(forward, backward, SGD step) through --phases, --phase-steps steps each (one count for every
phase, or one per phase), with routing driven by the router's logit bias (bench/drift.py: Zipf(s)
skew over a seeded expert order whose hot set rotates every --rotate-every steps, or balanced).
Every run sees the same inputs and the same biases at the same step. The runs:

0. fixed0, the plan auto takes at step 0 seeing step 0's routing: the cost model's choice for
   balanced routing at --tokens on the planning record (what auto with --trials 0 takes, unless a
   `search` order wins there: a Replanner never runs one, so its candidates are taken here too),
   then a Replanner's decision on one training step with the first phase's routing (threshold 0,
   one window): with --capacity-factors, f is the smallest of them whose drop on that routing is
   <= --max-drop. The plan of the layer that needs the most (largest f, then the busiest
   routing) runs in every layer.
1. fixed0, all the way.
2. replan: the same start with a Replanner (--replan-every/-threshold/-confirm,
   --capacity-factors, --max-drop, the same planning record). 1 and 2 run interleaved, step by
   step (alternating which goes first).
3. hindsight: a candidate set, each plan in every layer, fixed over all phases, interleaved with
   each other after 1-2: fixed0 (its times from 1), every plan the replanner switched to, and the
   cost model's --candidates best plans for the busiest layer's picture at each phase's last
   decision point (at the f the drop budget picks for it). Per phase the fastest of them whose
   drop in that phase is <= --max-drop (dropless plans drop nothing); hindsight = the sum of those
   phase times.
4. overhead: balanced routing only, --overhead-steps steps, each layer running the plan the replan
   run ended with, without and with a Replanner deciding every --overhead-every steps (default: the
   Replanner's own, 50): the cost of watching and deciding when there is nothing to switch (a
   switch, if any, is reported).

Time: `dist.timing.measure` (barrier, host clock, the slowest rank) of each training step, the
replanner's step included; median_ms is a phase's median step, phase_ms the SUM of its step times
(so a switch's first, slower step counts). drop: the fraction of the phase's choices (every layer,
every rank) capacity mode dropped. Ratios: replan/fixed0 = fixed0 phase_ms / replan phase_ms
(> 1: re-planning is faster); replan/hindsight = replan / hindsight phase_ms; overhead = replan /
fixed0 step-time sum on balanced routing. predicted_ms (fixed0 and replan rows): the median over
the phase's steps of the cost model's step (costmodel.prediction, summed over the layers) for the
plan each layer ran, priced at the replanner's picture of that step's window
(`Picture.priced_tokens`, as the replanner prices it); ratio = predicted / measured median. It
models the MoE layers only (the loss and SGD step are in the measured time).

Decision points cost the replan run: rank 0 prices each layer's picture (`picture.plan_for`: a
simulation of ~100 candidates, cached per priced token count) while the other ranks wait; the
`decision` and `other` rows split the replan run's step times into the steps that end at a
decision point and the rest.

On the emulated cluster, 2 nodes x 2 ranks, at a link rate where the layer spends about half of
its step on the network (the `bench layer` line checks it: its header prints the all-to-alls'
time and the compute bound), capacity mode, a skewed start that settles:

    schemoe testbed up --nodes 2 --rate 1500mbit
    schemoe bench layer --testbed --ranks-per-node 2 --tokens 1024 --model-dim 512 \
        --hidden-dim 512 --experts 8 --top-k 2 --capacity-factor 1.25 --repeats 5
    schemoe bench replan --testbed --ranks-per-node 2 --tokens 1024 --model-dim 512 \
        --hidden-dim 512 --experts 8 --top-k 2 --layers 2 --capacity-factor 1.25 \
        --capacity-factors 1,1.25,1.5,2,2.5,3,4 --phases zipf:1.2:rotate,balanced \
        --phase-steps 30,120 --rotate-every 10 --replan-every 2
    schemoe testbed down

(docs/results/replan_2026-12-06/replan_testbed.sh runs these with a stored profile.)
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from .. import config as c
from ..cliargs import Check, float_list, for_flag, int_list
from ..costmodel.model import LayerShape
from ..costmodel.prediction import predict_config
from ..dist.topology import layer_topology
from ..train.checks import fits_in_memory, moe_layer_params
from ..tuning.choose import AUTO_CHUNKS, AUTO_SKIPS, as_config, explore, shortlist
from ..tuning.picture import with_capacity
from ..tuning.plan import from_rank0, plan_record
from ..tuning.replan import MAX_DROP
from . import output
from .drift import Phase, Run, drive, parse_phases, plan_name, start_plan

__all__ = ["CHECKS", "add_arguments", "bench", "check_world", "validate"]

# Each flag's range, checked right after parsing, beyond cliargs.FLAG_CHECKS (--layers, --seed,
# --tokens, --model-dim, ...); --replan-threshold < 1 is validate's.
CHECKS = {
    "--phase-steps": Check(1),
    "--rotate-every": Check(1),
    "--replan-every": Check(1),
    "--replan-threshold": Check(0),
    "--replan-confirm": Check(1),
    "--capacity-factors": Check(0, strict=True),
    "--max-drop": Check(0, 0.99),
    "--overhead-steps": Check(1),
    "--overhead-every": Check(1),
    "--candidates": Check(1),
    "--lr": Check(0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phases", default="zipf:1.2:rotate,balanced",
                   help="comma list of phases: balanced, zipf:S (Zipf(S) skew) or zipf:S:rotate "
                        "(its hot set moving every --rotate-every steps)")  # fmt: skip
    p.add_argument("--phase-steps", type=int_list, default=[30],
                   help="training steps per phase: one count, or one per phase (each a multiple "
                        "of --replan-every)")  # fmt: skip
    p.add_argument("--rotate-every", type=int, default=10, help="steps between hot-set moves")
    p.add_argument("--layers", type=int, default=2, help="MoE layers in the stack")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    p.add_argument("--model-dim", type=int, default=512, help="model dim M")
    p.add_argument("--hidden-dim", type=int, default=512, help="expert hidden dim H")
    p.add_argument("--experts", type=int, default=None, help="E (default: 2 per rank)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token k")
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="f of capacity mode (0: dropless); with --capacity-factors, fixed0's f "
                        "comes from step 0's routing instead")  # fmt: skip
    p.add_argument("--capacity-factors", type=float_list, default=None,
                   help="capacity mode: the fs the replanner (and fixed0) may take, each "
                        "decision the smallest whose drop is <= --max-drop")  # fmt: skip
    p.add_argument("--max-drop", type=float, default=MAX_DROP,
                   help="the drop fraction --capacity-factors are chosen for, and the most a "
                        "hindsight plan may drop in a phase")  # fmt: skip
    p.add_argument("--replan-every", type=int, default=5, help="steps between decision points")
    p.add_argument("--replan-threshold", type=float, default=0.05,
                   help="predicted gain a plan needs, in [0, 1)")  # fmt: skip
    p.add_argument("--replan-confirm", type=int, default=2,
                   help="decision points in a row a plan must win before a switch")  # fmt: skip
    p.add_argument("--overhead-steps", type=int, default=100,
                   help="steps of the balanced-only overhead comparison")  # fmt: skip
    p.add_argument("--overhead-every", type=int, default=None,
                   help="the overhead run's steps between decision points (default: the "
                        "Replanner's, 50)")  # fmt: skip
    p.add_argument("--candidates", type=int, default=2,
                   help="the cost model's best plans per phase added to the hindsight set")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights, inputs and the expert order")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="profile store of the planning record (none stored: a quick profile)")  # fmt: skip


def phase_steps(args: argparse.Namespace) -> list[int]:
    """--phase-steps as one count per phase."""
    n = len(parse_phases(args.phases))
    return args.phase_steps * n if len(args.phase_steps) == 1 else list(args.phase_steps)


def validate(args: argparse.Namespace) -> None:
    """What several flags allow together (ValueError naming the flag), before any rank starts."""
    with for_flag("--phases"):
        phases = parse_phases(args.phases)
    if args.replan_threshold >= 1:
        raise ValueError(f"--replan-threshold must be < 1, got {args.replan_threshold:g}")
    if len(args.phase_steps) not in (1, len(phases)):
        raise ValueError(
            f"--phase-steps {','.join(map(str, args.phase_steps))}: give one count or one per "
            f"phase ({len(phases)} in --phases {args.phases})"
        )
    for n in args.phase_steps:
        if n % args.replan_every:
            raise ValueError(
                f"--phase-steps {n} must be a multiple of --replan-every {args.replan_every} "
                "(each phase a whole number of decision windows)"
            )
    if args.capacity_factors and not args.capacity_factor:
        raise ValueError(
            f"--capacity-factors {','.join(f'{f:g}' for f in args.capacity_factors)} needs "
            "capacity mode: give --capacity-factor F > 0 (dropless layers have no f to choose)"
        )


def check_world(args: argparse.Namespace, env, world: int) -> None:
    """The weights and gradients of the runs alive at once fit in this machine's memory: fixed0,
    replan and up to 1 + --candidates x phases + L x phases hindsight models (an upper bound)."""
    experts = args.experts or 2 * world
    phases = len(parse_phases(args.phases))
    models = 2 + 1 + (args.candidates + args.layers) * phases
    params = moe_layer_params(args.model_dim, args.hidden_dim, experts, world) * args.layers
    sized = (f"--experts {experts}, --model-dim {args.model_dim}, --hidden-dim "
             f"{args.hidden_dim}, --layers {args.layers} x {models} runs")  # fmt: skip
    fits_in_memory(params * models, 8, world, sized, held="fp32 weights and gradients")


def _config(args, world: int, rpn: int) -> c.MoEConfig:
    return c.MoEConfig(
        gate=c.GateConfig(
            num_experts=args.experts or 2 * world,
            top_k=args.top_k,
            capacity_factor=args.capacity_factor,
            logit_bias=True,
        ),
        experts=c.ExpertConfig(model_dim=args.model_dim, hidden_dim=args.hidden_dim),
        parallel=c.ParallelConfig(ranks_per_node=rpn, uniform_tokens=True),
        schedule=c.ScheduleConfig(policy="auto"),
    )


def _best(config: c.MoEConfig, tokens: int, hw, n: int) -> list[c.MoEConfig]:
    """The cost model's n best plans at `tokens` (the replanner's candidates: no `search`)."""
    preds = explore(hw, LayerShape.of(config, tokens), config.schedule.accuracy_budget,
                    refine=False, chunk_grid=AUTO_CHUNKS, skip=AUTO_SKIPS)  # fmt: skip
    return [as_config(config, p) for p in shortlist(preds, n)]


def _candidates(config, fixed0, replan: Run, ends: list[int], hw, args) -> list:
    """The hindsight set (module docstring, 3), fixed0 first, without repeats."""
    out = [fixed0]
    out += [s.config for s in replan.replanner.history]
    k, fs = config.gate.top_k, tuple(sorted(args.capacity_factors or ()))
    for end in ends:
        pics = [v for v in replan.pictures.get(end, {}).values() if v is not None]
        if pics:
            pic = max(pics, key=lambda p: p.busiest())
            base = with_capacity(fixed0, pic, fs, args.max_drop)
            out += _best(base, pic.priced_tokens(k, base.gate.dropless), hw, args.candidates)
    seen, unique = set(), []
    for cfg in out:
        if (key := plan_name(cfg)) not in seen:
            seen.add(key)
            unique.append(cfg)
    return unique


def _predicted(run: Run, pictures: dict, steps: range, every: int, hw, k: int, cache: dict):
    """The median over `steps` (1-based) of the predicted step in ms, summed over the layers, of
    the plans `run` ran, at `pictures` (the replanner's, by decision step) of each step's window;
    None when no step of `steps` has a picture of every layer."""
    per_step = []
    for s in steps:
        pics = pictures.get(-(-s // every) * every, {})
        total = 0.0
        for i, plan in enumerate(run.running[s - 1]):
            pic = pics.get(i)
            if pic is None:
                break
            key = (plan_name(plan), pic.priced_tokens(k, plan.gate.dropless))
            if key not in cache:
                cache[key] = predict_config(plan, key[1], hw).step_s * 1e3
            total += cache[key]
        else:
            per_step.append(total)
    return statistics.median(per_step) if per_step else None


def _phase_rows(name: str, times: list[float], drops: list[float], run: Run, phases,
                spans: list[range]) -> list[dict]:  # fmt: skip
    rows = []
    for phase, span in zip(phases, spans):
        t = times[span.start - 1 : span.stop - 1]
        plans = {plan_name(cfg) for per in run.running[span.start - 1 : span.stop - 1]
                 for cfg in per}  # fmt: skip
        rows.append({"run": name, "phase": phase.name, "steps": len(t),
                     "median_ms": statistics.median(t), "phase_ms": sum(t),
                     "drop": statistics.fmean(drops[span.start - 1 : span.stop - 1]),
                     "plans": "+".join(sorted(plans))})  # fmt: skip
    return rows


def bench(args: argparse.Namespace, env) -> None:
    """Collective: every rank runs every run of the module docstring; rank 0 reports."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(args.seed)
    config = _config(args, world, env.ranks_per_node)
    E = config.gate.num_experts
    topo = layer_topology(None, env.ranks_per_node)
    hw, quick = plan_record(topo, env.links, args.profile, model_dim=args.model_dim,
                            hidden=args.hidden_dim, tokens=args.tokens, experts=E)  # fmt: skip
    hw_t = hw.with_topology(topo.nodes, topo.ranks_per_node)
    phases, steps = parse_phases(args.phases), phase_steps(args)
    order_E = torch.randperm(E, generator=torch.Generator().manual_seed(args.seed)).tolist()
    kw = {"layers": args.layers, "seed": args.seed, "lr": args.lr}
    rp = {"every": args.replan_every, "threshold": args.replan_threshold,
          "confirm": args.replan_confirm, "hardware": hw, "max_drop": args.max_drop,
          "capacity_factors": tuple(args.capacity_factors or ())}  # fmt: skip
    start = from_rank0(lambda: _best(config, args.tokens, hw_t, 1)[0], topo)
    fixed0 = start_plan(config, start, args, rank, order_E, phases[0], rp)

    # 1-2. fixed0 and replan, interleaved.
    fixed, replan = (
        Run("fixed0", config, fixed0, **kw),
        Run("replan", config, fixed0, **kw, replan=rp),
    )
    times = drive([fixed, replan], phases, steps, args, rank, order_E)
    # 3. The hindsight set, fixed over all phases (fixed0's times from 1).
    ends = [sum(steps[: p + 1]) for p in range(len(phases))]
    cands = from_rank0(lambda: _candidates(config, fixed0, replan, ends, hw_t, args), topo)
    hind = [Run(f"fixed:{plan_name(cfg)}", config, cfg, **kw) for cfg in cands[1:]]
    times |= drive(hind, phases, steps, args, rank, order_E) if hind else {}
    hind_runs = [fixed] + hind
    drops = {r.name: r.dropped() for r in [fixed, replan] + hind}  # collective
    # 4. Overhead on balanced routing: the replan run's last plans, watched and not.
    last = [m.running for m in replan.layers]
    o_rp = {k: v for k, v in rp.items() if k != "every"}  # the Replanner's default every
    o_rp |= {"every": args.overhead_every} if args.overhead_every else {}
    o_fixed = Run("overhead:fixed0", config, last, **kw)
    o_replan = Run("overhead:replan", config, last, **kw, replan=o_rp)
    o_times = drive([o_fixed, o_replan], [Phase("balanced")], [args.overhead_steps], args, rank,
                     order_E)  # fmt: skip
    _report(args, env, world, fixed0, phases, (fixed, replan, hind_runs, o_replan),
            times, drops, o_times, hw_t, quick)  # fmt: skip


def _report(args, env, world, fixed0, phases, runs, times, drops, o_times, hw_t, quick) -> None:
    fixed, replan, hind_runs, o_replan = runs
    steps, k = phase_steps(args), args.top_k
    spans = [range(sum(steps[:p]) + 1, sum(steps[: p + 1]) + 1) for p in range(len(phases))]
    rows = []
    for r in hind_runs[:1] + [replan] + hind_runs[1:]:
        rows += _phase_rows(r.name, times[r.name], drops[r.name], r, phases, spans)
    cache: dict = {}
    if dist.get_rank() == 0:  # the cost model on rank 0 only: it prints
        for row in rows:
            if row["run"] in ("fixed0", "replan"):
                p = next(i for i, ph in enumerate(phases) if ph.name == row["phase"])
                run = fixed if row["run"] == "fixed0" else replan
                # fixed0 saw the same routing: priced at the replanner's pictures too.
                row["predicted_ms"] = _predicted(run, replan.pictures, spans[p],
                                                 args.replan_every, hw_t, k, cache)  # fmt: skip
                if row["predicted_ms"] is not None:
                    row["ratio"] = row["predicted_ms"] / row["median_ms"]
    by = {(r["run"], r["phase"]): r for r in rows}
    hindsight, speed = [], []
    for ph in phases:
        phase_rows = [by[(r.name, ph.name)] for r in hind_runs]
        within = [r for r in phase_rows if r["drop"] <= args.max_drop] or phase_rows
        best = min(within, key=lambda r: r["phase_ms"])
        hindsight.append({"run": "hindsight", "phase": ph.name, "steps": best["steps"],
                          "phase_ms": best["phase_ms"], "drop": best["drop"],
                          "plans": best["plans"]})  # fmt: skip
        f, r = by[("fixed0", ph.name)]["phase_ms"], by[("replan", ph.name)]["phase_ms"]
        speed.append({"run": "replan/fixed0", "phase": ph.name, "ratio": f / r})
    total = {n: sum(times[n]) for n in times}
    hind_ms = sum(h["phase_ms"] for h in hindsight)
    over = sum(o_times["overhead:replan"]) / sum(o_times["overhead:fixed0"])
    ratios = speed + [
        {"run": "replan/fixed0", "phase": "all", "ratio": total["fixed0"] / total["replan"]},
        {"run": "replan/hindsight", "phase": "all", "ratio": total["replan"] / hind_ms},
        {"run": "overhead replan/fixed0", "phase": "balanced", "ratio": over,
         "steps": args.overhead_steps},
    ]  # fmt: skip
    every = args.replan_every
    at = [t for i, t in enumerate(times["replan"], 1) if i % every == 0]
    rest = [t for i, t in enumerate(times["replan"], 1) if i % every]
    split = [{"run": "replan", "phase": part, "steps": len(t), "median_ms": statistics.median(t),
              "phase_ms": sum(t)} for part, t in (("decision", at), ("other", rest)) if t]  # fmt: skip
    switches = [s.as_dict() for s in replan.replanner.history]
    o_switches = [s.as_dict() for s in o_replan.replanner.history]
    config = {k: getattr(args, k) for k in ("tokens", "model_dim", "hidden_dim", "top_k",
                                           "layers", "phases", "phase_steps", "rotate_every")}  # fmt: skip
    config |= {"experts": fixed0.gate.num_experts, "f": args.capacity_factor,
               "capacity_factors": args.capacity_factors, "max_drop": args.max_drop,
               "every": args.replan_every, "overhead_every": o_replan.replanner.every,
               "threshold": args.replan_threshold, "confirm": args.replan_confirm,
               "overhead_steps": args.overhead_steps, "seed": args.seed}  # fmt: skip
    head = output.header("schemoe bench replan", config, env.topology(world), env.link())
    head += [f"# planning record: {hw_t.name}" + (f" (quick profile: {quick})" if quick else "")]
    head += [f"# fixed0: {plan_name(fixed0)}; hindsight set: "
             + ", ".join(plan_name(r.running[0][0]) for r in hind_runs)]  # fmt: skip
    head += [f"# replan switch: step {s['step']} layer {s['layer']}: {s['old']} -> {s['new']} "
             f"(predicted gain {s['predicted_gain']}, measured {s['measured_gain']})"
             for s in switches] or ["# replan switch: none"]  # fmt: skip
    head += [f"# overhead run switched (not expected): {s}" for s in o_switches]
    head.append(
        "# phase_ms = sum of the phase's step times (each the slowest rank's); "
        "predicted_ms: the cost model's median step, at the replanner's pictures"
    )
    summary = {
        "runs": {
            n: [r for r in rows if r["run"] == n] for n in dict.fromkeys(r["run"] for r in rows)
        },
        "hindsight": hindsight,
        "replan_steps": split,
        "step_ms": {n: [round(v, 3) for v in t] for n, t in (times | o_times).items()},
        "totals_ms": total | {"hindsight": hind_ms},
        "speedup_vs_fixed0": total["fixed0"] / total["replan"],
        "replan_vs_hindsight": total["replan"] / hind_ms,
        "overhead_pct": (over - 1) * 100,
        "overhead_ms": {n: sum(t) for n, t in o_times.items()},
        "switches": switches,
        "overhead_switches": o_switches,
        "fixed0": plan_name(fixed0),
        "phases": [p.name for p in phases],
        "timing": "phase_ms: sum of step times (slowest rank); median_ms: median step",
        "link_rate_gbps": env.link_rate_gbps,
        "world_size": world,
        "ranks_per_node": env.ranks_per_node,
        "profile_key": env.profile_key(world),
        "auto_profile": quick,
    }
    cols = ["run", "phase", "steps", "median_ms", "phase_ms", "drop", "predicted_ms", "ratio",
            "plans"]  # fmt: skip
    output.report(head, rows + split + hindsight + ratios, cols, summary)
