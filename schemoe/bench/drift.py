"""The scenario of `schemoe bench replan`: a small stack of MoE layers (dropless or capacity mode)
trained through phases of drifting, skewed routing, with every run seeing the same inputs and the
same routing.

Legend: E experts, L MoE layers, T tokens per rank, M model dim.

    phases = parse_phases("zipf:1.2:rotate,balanced")
    bias_E = phase_bias(phases[0], step_in_phase, rotate_every, order_E)   # the router's push
    run = Run("fixed0", config, plan, layers=2, seed=0, lr=1e-3)           # a model, its SGD
    run.prepare(x_TM, bias_E); run.step()                                  # one training step
    times = drive([fixed, replan], phases, steps, args, rank, order_E)     # interleaved, timed
    run.dropped()                                   # per step, over layers and ranks (collective)

How the routing is driven: every layer has a router logit bias (GateConfig(logit_bias=True),
`MoELayer.gate_bias` [E]) that the scenario sets before each step and the optimizer never
updates. A phase "zipf:s" sets it to log w with w_i = (i + 1)^-s, the Zipf(s) weight of the i-th
hottest expert, over `order_E` (a seeded permutation of the experts, the same on every rank);
"zipf:s:rotate" shifts the permutation by one position every `rotate_every` steps of the phase
(the hot set moves to other experts, usually other ranks); "balanced" sets it to zero. Top-k
selection on logits + bias concentrates the load more than the weights w themselves would.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import MoEConfig
from ..dist.timing import measure
from ..layer.moe import MoELayer
from ..tuning.replan import Replanner
from ..tuning.switch import plan_name

__all__ = [
    "Phase",
    "Run",
    "drive",
    "inputs",
    "parse_phases",
    "phase_bias",
    "plan_name",
    "start_plan",
]


@dataclass(frozen=True)
class Phase:
    """One phase of the routing: "balanced", or Zipf(s) skew, its hot set rotating or not."""

    kind: str
    s: float = 0.0
    rotate: bool = False

    @property
    def name(self) -> str:
        if self.kind == "balanced":
            return "balanced"
        return f"zipf:{self.s:g}" + (":rotate" if self.rotate else "")


def parse_phases(text: str) -> list[Phase]:
    """ "zipf:1.2:rotate,balanced" -> two Phases. Each entry is `balanced`, `zipf:S` or
    `zipf:S:rotate` with S > 0 finite; ValueError naming the entry otherwise."""
    out = []
    for entry in (t.strip() for t in text.split(",")):
        parts = entry.split(":")
        if parts == ["balanced"]:
            out.append(Phase("balanced"))
            continue
        ok = parts[0] == "zipf" and len(parts) in (2, 3) and parts[2:] in ([], ["rotate"])
        try:
            s = float(parts[1]) if ok else math.nan
        except ValueError:
            s = math.nan
        if not (math.isfinite(s) and s > 0):
            raise ValueError(
                f"phase {entry!r}: expected balanced, zipf:S or zipf:S:rotate with S > 0"
            )
        out.append(Phase("zipf", s, len(parts) == 3))
    return out


def phase_bias(phase: Phase, step: int, rotate_every: int, order_E: list[int]) -> torch.Tensor:
    """The logit bias [E] of `phase` at its 0-based `step` (see the module docstring)."""
    E = len(order_E)
    bias_E = torch.zeros(E)
    if phase.kind == "balanced":
        return bias_E
    shift = step // rotate_every if phase.rotate else 0
    for i in range(E):
        bias_E[order_E[(i + shift) % E]] = -phase.s * math.log(i + 1)
    return bias_E


def inputs(seed: int, rank: int, step: int, tokens: int, model_dim: int) -> torch.Tensor:
    """x [T, M] of `step` on `rank`: the same in every run (a generator per step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 100_003 + step)
    return torch.randn(tokens, model_dim, generator=g)


class _Stack(nn.Module):
    """L MoE layers with residuals; the router biases are driven, not learned."""

    def __init__(self, config: MoEConfig, layers: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the gate weights: the same in every run and on every rank
        self.moe = nn.ModuleList(MoELayer(config, seed=seed + i) for i in range(layers))
        for m in self.moe:
            m.gate_bias.requires_grad_(False)

    def forward(self, x_TM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h_TM, aux = x_TM, x_TM.new_zeros(())
        for m in self.moe:
            y_TM, a = m(h_TM)
            h_TM, aux = h_TM + y_TM, aux + a
        return h_TM, aux


class Run:
    """One run of the benchmark: a model running `plan` in every layer (or plan[i] in layer i),
    its SGD, and optionally a Replanner (`replan`: Replanner keyword arguments). `prepare` then
    `step` is one training step (forward, backward, optimizer step, the replanner's step); only
    `step` is timed. Every layer tallies its routing (`MoELayer.routing_total`, on the device):
    `dropped` reads what capacity mode dropped in each step."""

    def __init__(
        self,
        name: str,
        config: MoEConfig,
        plan: MoEConfig | list[MoEConfig],
        *,
        layers: int,
        seed: int,
        lr: float,
        replan: dict | None = None,
    ) -> None:
        self.name = name
        self.model = _Stack(config, layers, seed)
        self.layers = list(self.model.moe)
        plans = plan if isinstance(plan, list) else [plan] * layers
        for m, p in zip(self.layers, plans, strict=True):
            m.configure(p)
            m.record_routing = True
        self.tallies: list[list[torch.Tensor]] = []  # after each step: each layer's routing_total
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(params, lr=lr)
        self._replan = replan
        self.replanner: Replanner | None = None  # attached by `warm`
        self.done = 0
        self.running: list[list[MoEConfig]] = []  # per step: each layer's plan
        self.pictures: dict[int, dict] = {}  # decision step -> the replanner's pictures
        self._x_TM: torch.Tensor | None = None
        self._warm_tally: list[torch.Tensor] | None = None

    def warm(self, x_TM: torch.Tensor) -> None:
        """One untimed training step (buffers, caches) before the measured ones, then the
        Replanner is attached (its first window starts after this step)."""
        assert self.replanner is None and self.done == 0
        self._train(x_TM)
        self._warm_tally = [m.routing_total for m in self.layers]
        if self._replan is not None:
            self.replanner = Replanner(self.model, **self._replan)

    def prepare(self, x_TM: torch.Tensor, bias_E: torch.Tensor) -> None:
        """The next step's input and routing bias (outside the timed step)."""
        with torch.no_grad():
            for m in self.layers:
                m.gate_bias.copy_(bias_E)
        self._x_TM = x_TM
        self.running.append([m.running for m in self.layers])

    def step(self) -> None:
        """One timed training step; the replanner's step (a decision point or not) included."""
        self._train(self._x_TM)
        self.done += 1
        self.tallies.append([m.routing_total for m in self.layers])  # a new tensor per call
        if self.replanner is not None:
            self.replanner.step(self.done)
            if self.done % self.replanner.every == 0:
                self.pictures[self.done] = dict(self.replanner.pictures)

    def _train(self, x_TM: torch.Tensor) -> None:
        h_TM, aux = self.model(x_TM)
        loss = h_TM.pow(2).mean() + aux
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def dropped(self, group=None) -> list[float]:
        """The fraction of the choices each timed step dropped, over every layer and every rank
        of `group` (collective; 0.0 every step when dropless)."""

        def sums(per: list[torch.Tensor]) -> torch.Tensor:  # choices and kept, over the layers
            return torch.stack([sum(t[:-1].sum() for t in per), sum(t[-1] for t in per)])

        marks = [sums(per).double() for per in [self._warm_tally] + self.tallies]
        steps_2 = torch.stack([b - a for a, b in itertools.pairwise(marks)])
        if dist.is_initialized():
            dist.all_reduce(steps_2, group=group)
        return [1.0 - kept / chosen if chosen else 0.0 for chosen, kept in steps_2.tolist()]


def start_plan(
    config: MoEConfig, start: MoEConfig, args, rank: int, order_E, phase: Phase, rp: dict
) -> MoEConfig:
    """The plan a Replanner takes after one training step of `phase`, starting from `start`
    (threshold 0, one window; `rp`: its other keyword arguments): of the layer that needs the
    most (the largest f, then the busiest routing). `args`: bench replan's flags."""
    probe = Run("probe", config, start, layers=args.layers, seed=args.seed, lr=args.lr,
                replan=rp | {"every": 1, "confirm": 1, "threshold": 0.0})  # fmt: skip
    probe.warm(inputs(args.seed, rank, 0, args.tokens, args.model_dim))
    probe.prepare(inputs(args.seed, rank, 1, args.tokens, args.model_dim),
                  phase_bias(phase, 0, args.rotate_every, order_E))  # fmt: skip
    probe.step()
    pics = probe.replanner.pictures

    def need(i: int):
        pic = pics.get(i)
        return (probe.layers[i].running.gate.capacity_factor, pic.busiest() if pic else 0.0)

    return probe.layers[max(range(len(probe.layers)), key=need)].running


def drive(runs: list[Run], phases: list[Phase], steps: list[int], args, rank: int, order_E):
    """Every run through `phases`, step by step interleaved; each run's step times (ms)."""
    x_TM = inputs(args.seed, rank, 0, args.tokens, args.model_dim)
    for r in runs:
        r.warm(x_TM)
    times = {r.name: [] for r in runs}
    s = 0
    for phase, n in zip(phases, steps):
        for j in range(n):
            s += 1
            x_TM = inputs(args.seed, rank, s, args.tokens, args.model_dim)
            bias_E = phase_bias(phase, j, args.rotate_every, order_E)
            for r in runs:
                r.prepare(x_TM, bias_E)
            turn = runs if s % 2 else runs[::-1]  # neither run always goes first
            stats = measure({r.name: r.step for r in turn}, warmup=0, repeats=1)
            for r in runs:
                times[r.name].append(stats[r.name].median_ms)
    return times
