"""Re-planning from live routing: `Replanner` changes what each MoE layer runs, between steps.

    replanner = Replanner(model, every=50, threshold=0.05)   # hardware= as AutoTuner's
    for step in range(1, steps + 1):
        ...forward, backward, optimizer step...
        replanner.step(step)                 # once per optimizer step, after it
    replanner.history                        # every switch (Switch records)

    forced = Replanner(model, schedule=schedule_of(replanner.history))   # the same plans, forced

What it watches (no host sync per call): each layer tallies its training calls' choices per
expert on the device (`MoELayer.record_routing`, read through `routing_total`, which metrics'
`take_load_metrics` does not reset); forward hooks count the calls and their tokens (shapes:
host values) and time each forward call (CPU: `time.perf_counter`; CUDA: a pair of events,
read at the decision point). Backward is not in the sample, nor the first call after a switch
(its warm-up). A forced switch between decision points puts calls of both plans in the window
after it.

Decision points, after the steps s with s % every == 0 (every rank calls `step`):

  1. Picture: each rank's window (the tally's difference since the last point, calls, tokens,
     the median forward time) is all-gathered over the layer's group, the layers of one group
     in one collective, in model order on every rank. Layers not configured yet are left out,
     and the whole point waits while `tuner` (an AutoTuner) is still trying plans.
  2. Plan: rank 0 of the group prices each layer's picture (`picture.plan_for`: the busiest
     rank's volume priced as uniform routing, stated in picture.py) and broadcasts the verdicts
     (`plan.from_rank0`), so every rank holds identical verdicts and applies the same rule.
  3. Switch (hysteresis): a layer switches, from step s + 1 on, when the same plan (other than
     the running one) has won with a predicted gain >= threshold at `confirm` consecutive
     decision points (default 2); any other verdict restarts the count. Each expert-parallel
     group decides from its own routing: a layer's replicas in other groups (expert data
     parallelism) may run other plans. With the opt-in
     `capacity_factors`, a capacity-mode layer's f comes from a drop budget (`max_drop`) and a
     plan with another f is wanted whatever its gain (more f is slower), with the same count.
  4. Record: each switch is a `Switch` in `history`; at the next decision point its measured
     gain is filled in: 1 - median forward call of the window after / of the window before
     (each the slowest rank's median).

Host syncs, all at decision points, none per call: the gathered table's `.tolist()` (with a gloo
control group on CUDA, also the tally's copy to the CPU before it), the CUDA events' elapsed
times, the verdicts' broadcast (pickled objects), and without `hardware` the first point's
record (`plan.plan_record`: the stored profile, else a quick profile measured then).

A forced `schedule` ({step: {layer index: MoEConfig}}, layer indices in `model.modules()` order)
applies its plans so that they run from that step on, through the same switch code; a Replanner
with a schedule takes no decision of its own (it still measures). Steps <= start + 1 are applied
at construction. Plans never use the `search` policy (it needs a cost model, and a schedule
replays a plan from its MoEConfig alone).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import MoEConfig
from ..costmodel import profiles
from ..costmodel.hardware import Hardware
from ..dist.devices import comm_device, control_tensor
from ..dist.links import Links
from ..dist.timing import percentile
from ..layer.moe import MoELayer
from ..layer.recompute import replaying
from .auto import AutoTuner
from .choose import BUDGETS
from .picture import Picture, on_grid, plan_for, running_step_s, with_capacity
from .plan import from_rank0, plan_record
from .switch import Switch, check_schedule, number_in, positive_int, schedule_of, trace_plans

__all__ = ["EVERY", "MAX_DROP", "Replanner", "Switch", "schedule_of"]

EVERY, MAX_DROP = 50, 0.01  # the defaults of Replanner's every and max_drop (and of the CLIs)

log = logging.getLogger("schemoe.tuning.replan")


@dataclass
class _Watch:
    """One layer's window so far and its decision state."""

    last_E1: torch.Tensor | None = None  # the tally at the last decision point
    calls: int = 0
    tokens: int = 0
    samples: list = dataclasses.field(default_factory=list)  # seconds, or CUDA event pairs
    t0: object = None
    pending: tuple[str, int] | None = None  # (repr of the winning config, wins in a row)
    before_s: float | None = None  # the last window's median (slowest rank)
    measuring: int | None = None  # history index of a switch awaiting its measured gain
    warm: bool = False  # the next call is the first after a switch: not sampled


class Replanner:
    """Re-plans every MoELayer of `model` from its live routing (see the module docstring).

    Args:
        model: a module containing MoELayers (or a MoELayer).
        every: steps between decision points (>= 1).
        threshold: the predicted gain (fraction of the running plan's step, in [0, 1)) a plan
            needs to be considered.
        confirm: consecutive decision points the same plan must win before a switch (>= 1).
        budget: the compressors a plan may use ("lossless", "fp16", "lossy"; default each
            layer's `schedule.accuracy_budget`).
        hardware: the Hardware record to plan on (default: as AutoTuner, the stored profile of
            the run's key, else a quick profile measured at the first decision point).
        schedule: forced plans {step: {layer index: MoEConfig}}; then no decision of its own.
        start: optimizer steps already taken (a resumed run).
        tuner: an AutoTuner of the same model; decision points wait until it has settled.
        capacity_factors: opt-in (default none: f never changes, since changing f changes the
            results): the capacity factors a capacity-mode layer may switch between; each
            decision takes the smallest whose estimated drop (`Picture.dropped`) is <=
            `max_drop`, else the largest, and plans at it.
        max_drop: the drop fraction the capacity factor is chosen for.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = EVERY,
        threshold: float = 0.05,
        confirm: int = 2,
        budget: str | None = None,
        hardware: Hardware | None = None,
        schedule: Mapping[int, Mapping[int, MoEConfig]] | None = None,
        start: int = 0,
        tuner: AutoTuner | None = None,
        capacity_factors: tuple[float, ...] = (),
        max_drop: float = MAX_DROP,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Replanner needs an nn.Module, got {type(model).__name__}")
        self.every = positive_int("every", every)
        self.confirm = positive_int("confirm", confirm)
        if not number_in(threshold, 0, 1):
            raise ValueError(f"threshold must be a number in [0, 1), got {threshold!r}")
        if budget is not None and budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS} or None, got {budget!r}")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if hardware is not None and not isinstance(hardware, Hardware):
            raise TypeError(f"hardware must be a Hardware record, got {type(hardware).__name__}")
        fs = tuple(capacity_factors) if isinstance(capacity_factors, tuple | list) else None
        if fs is None or not all(number_in(f, 0, math.inf) and f > 0 for f in fs):
            raise ValueError(f"capacity_factors must be a tuple of numbers > 0, got "
                             f"{capacity_factors!r}")  # fmt: skip
        if not number_in(max_drop, 0, 1):
            raise ValueError(f"max_drop must be a number in [0, 1), got {max_drop!r}")
        self.capacity_factors, self.max_drop = tuple(sorted(fs)), max_drop
        self.threshold, self.budget, self.hardware, self.tuner = threshold, budget, hardware, tuner
        self.layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        self.schedule = check_schedule(schedule, len(self.layers))
        self.history: list[Switch] = []
        self.pictures: dict[int, Picture | None] = {}  # the last decision point's, by layer
        self.done = start
        self._watch = [_Watch() for _ in self.layers]
        self._records: dict[tuple, Hardware] = {}
        self._cache: dict = {}
        self._hooks, self._since = [], time.perf_counter()
        for i, m in enumerate(self.layers):
            m.record_routing = True
            total = m.routing_total  # the first window starts here (a device copy, no sync)
            self._watch[i].last_E1 = total.detach().clone() if total is not None else None
            self._hooks.append(m.register_forward_pre_hook(self._before(i)))
            self._hooks.append(m.register_forward_hook(self._after(i)))
        for s in sorted(k for k in self.schedule if k <= start + 1):
            self._force(s, start + 1)

    def remove(self) -> None:
        """Detach the hooks (the layers keep what they run)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---------------------------------------------------------------- hooks (per call, no sync)
    def _before(self, i: int):
        def hook(layer: MoELayer, args: tuple) -> None:
            if not layer.training or replaying():  # the calls the layer's tally counts
                return
            w, x = self._watch[i], args[0]
            w.calls += 1
            w.tokens += x.numel() // layer.config.experts.model_dim
            if x.device.type == "cuda":  # CUDA only: events, read at the decision point
                w.t0 = torch.cuda.Event(enable_timing=True)
                w.t0.record()
            else:
                w.t0 = time.perf_counter()

        return hook

    def _after(self, i: int):
        def hook(layer: MoELayer, args: tuple, out) -> None:
            w = self._watch[i]
            if w.t0 is None:
                return
            if w.warm:  # the first call of a new plan (its buffers, caches): left out
                w.warm = False
            elif isinstance(w.t0, float):
                w.samples.append(time.perf_counter() - w.t0)
            else:  # CUDA only
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                w.samples.append((w.t0, end))
            w.t0 = None

        return hook

    # ---------------------------------------------------------------- the step
    def step(self, step: int | None = None) -> list[Switch]:
        """Call on every rank after optimizer step `step` (default: the previous one + 1).
        Applies forced plans that run from step + 1, and at a decision point (step % every == 0)
        gathers the pictures, decides and measures (collective over each layer's group).
        Returns the Switch records made or measured in this call. While a trace records
        (`schemoe.trace.record`), adds a span per layer named by the plan it ran (`trace_plans`)."""
        step = self.done + 1 if step is None else step
        if isinstance(step, bool) or not isinstance(step, int) or step <= self.done:
            raise ValueError(f"step must be an int > the last one ({self.done}), got {step!r}")
        self.done = step
        self._since = trace_plans(self.layers, self._since)  # a span per layer while tracing
        n = len(self.history)
        changed: list[int] = []
        if step % self.every == 0 and (self.tuner is None or not self.tuner.tuning):
            changed = self._decision_point(step)
        if step + 1 in self.schedule:
            self._force(step + 1, step + 1)
        return [self.history[j] for j in sorted(set(changed) | set(range(n, len(self.history))))]

    def _force(self, at: int, runs_from: int) -> None:
        for i, cfg in sorted(self.schedule[at].items()):
            self._switch(i, cfg, runs_from, None)

    def _switch(self, i: int, cfg: MoEConfig, step: int, predicted: float | None) -> None:
        """The one switch path: layer i runs `cfg` from `step` on (every rank alike)."""
        layer = self.layers[i]
        old = layer.running
        layer.configure(cfg)
        was, new = (old.summary() if old else {}), cfg.summary()
        if old is not None and old.gate.capacity_factor != cfg.gate.capacity_factor:
            was["capacity_factor"] = old.gate.capacity_factor
            new["capacity_factor"] = cfg.gate.capacity_factor
        self.history.append(Switch(step, i, was, new, cfg, predicted))
        self._watch[i].measuring = len(self.history) - 1
        self._watch[i].pending = None
        self._watch[i].warm = True
        log.info("replan: step %d layer %d: %s -> %s (predicted gain %s)", step, i,
                 was, new, predicted)  # fmt: skip

    def _decision_point(self, step: int) -> list[int]:
        """Steps 1-4 of the module docstring; the history indices measured here."""
        groups: dict[int, list[int]] = {}
        for i, m in enumerate(self.layers):
            if m.running is not None:
                groups.setdefault(id(m.topology.group), []).append(i)
        measured, seen = [], {}
        for idx in groups.values():
            pictures, medians = self._gather(idx)
            for i, pic, med in zip(idx, pictures, medians):
                measured += self._measure(i, med)
                seen[i] = pic
        self.pictures = seen
        if not self.schedule:
            self.decide(step, seen)
        return measured

    def decide(self, step: int, pictures: Mapping[int, Picture | None]) -> None:
        """Steps 2-3 of the module docstring for the layers in `pictures` (index -> Picture,
        None: no calls seen), as the decision point after `step` does with the pictures it
        gathered; a switch runs from step + 1. Collective over each layer's group: call it on
        every rank with the same layers (tests and replays hand it scripted pictures)."""
        groups: dict[int, list[int]] = {}
        for i in sorted(i for i in pictures if self.layers[i].running is not None):
            groups.setdefault(id(self.layers[i].topology.group), []).append(i)
        for idx in groups.values():
            self._decide(step, idx, [pictures[i] for i in idx])

    def _gather(self, idx: list[int]) -> tuple[list[Picture | None], list[float | None]]:
        """Step 1: every rank's window of the layers `idx` (one group), one all_gather."""
        topo = self.layers[idx[0]].topology
        dev = comm_device(topo.group)
        rows, extras = [], []
        for i in idx:
            m, w = self.layers[i], self._watch[i]
            total = m.routing_total
            now = total.detach().clone() if total is not None else None
            if now is None:
                rows.append(torch.zeros(m.config.gate.num_experts, dtype=torch.float64, device=dev))
            else:
                prev = w.last_E1 if w.last_E1 is not None else torch.zeros_like(now)
                rows.append((now - prev)[:-1].to(dev, torch.float64))
            w.last_E1 = now
            extras += [float(w.calls), float(w.tokens), self._median(w.samples)]
            w.calls, w.tokens, w.samples = 0, 0, []
        mine = torch.cat(rows + [control_tensor(extras, dtype=torch.float64, group=topo.group)])
        if topo.world > 1:
            parts = [torch.empty_like(mine) for _ in range(topo.world)]
            dist.all_gather(parts, mine, group=topo.group)
        else:
            parts = [mine]
        table = [p.tolist() for p in parts]  # host sync: once per group per decision point
        pictures, medians, at = [], [], 0
        ends = sum(self.layers[i].config.gate.num_experts for i in idx)
        for j, i in enumerate(idx):
            E = self.layers[i].config.gate.num_experts
            counts = tuple(tuple(int(v) for v in row[at : at + E]) for row in table)
            calls, tokens, med = zip(*(row[ends + 3 * j : ends + 3 * j + 3] for row in table))
            at += E
            pic = Picture(counts, tuple(map(int, calls)), tuple(map(int, tokens)))
            pictures.append(pic if pic.calls else None)
            medians.append(max(med) if all(v >= 0 for v in med) else None)
        return pictures, medians

    @staticmethod
    def _median(samples: list) -> float:
        """The window's median forward call in seconds; -1 without samples."""
        if not samples:
            return -1.0
        if not isinstance(samples[0], float):  # CUDA only: the events' sync, here
            samples[-1][1].synchronize()
            samples = [a.elapsed_time(b) / 1e3 for a, b in samples]
        return percentile(samples, 50)

    def _measure(self, i: int, median: float | None) -> list[int]:
        """Step 4: fill in the measured gain of layer i's last switch; remember this window."""
        w, out = self._watch[i], []
        if w.measuring is not None and w.before_s is not None and median is not None:
            j = w.measuring
            gain = 1.0 - median / w.before_s if w.before_s > 0 else None
            self.history[j] = dataclasses.replace(self.history[j], measured_gain=gain)
            out.append(j)
        if w.measuring is not None:
            w.measuring = None
        w.before_s = median
        return out

    def _decide(self, step: int, idx: list[int], pictures: list[Picture | None]) -> None:
        """Steps 2-3: rank 0 prices, every rank applies the same verdicts."""
        topo = self.layers[idx[0]].topology
        if all(p is None for p in pictures):  # no calls in the window (the same on every rank)
            for i in idx:
                self._watch[i].pending = None
            return
        hw = self._hardware(idx[0], pictures)
        verdicts = from_rank0(lambda: [self._verdict(i, p, hw) for i, p in zip(idx, pictures)],
                              topo)  # fmt: skip
        for i, v in zip(idx, verdicts):
            w, running = self._watch[i], self.layers[i].running
            # A plan is wanted for its predicted gain, or for its capacity factor (the drop
            # budget chose it: raising f is slower and still wanted).
            wanted = v is not None and (
                v[0].gate != running.gate or (v[2] > 0 and v[2] >= self.threshold)
            )
            if not wanted:
                w.pending = None
                continue
            cfg, _, gain = v
            key = repr(cfg)
            wins = w.pending[1] + 1 if w.pending and w.pending[0] == key else 1
            w.pending = (key, wins)
            if wins >= self.confirm:
                self._switch(i, cfg, step + 1, gain)

    def _verdict(self, i: int, pic: Picture | None, hw: Hardware | None):
        if pic is None or hw is None:
            return None
        running = self.layers[i].running
        g = running.gate
        tokens = on_grid(pic.priced_tokens(g.top_k, g.dropless))  # cache hits across windows
        budget = self.budget or running.schedule.accuracy_budget
        base = with_capacity(running, pic, self.capacity_factors, self.max_drop)
        v = plan_for(base, tokens, hw, budget, self._cache)
        if v is None or base is running:
            return v
        cfg, base_s, gain = v  # the gain over the running plan at its own f
        now = running_step_s(running, tokens, hw, self._cache)
        return cfg, now, 1.0 - base_s * (1.0 - gain) / now if now > 0 else 0.0

    def _hardware(self, i: int, pictures: list[Picture | None]) -> Hardware | None:
        """The record to plan layer i's group on, at its topology (collective the first time
        when no `hardware` was given: as AutoTuner's, plan.plan_record)."""
        topo, cfg = self.layers[i].topology, self.layers[i].config
        if self.hardware is not None:
            return self.hardware.with_topology(topo.nodes, topo.ranks_per_node)
        key = profiles.cache_key(topo.nodes, topo.ranks_per_node, Links.of_run())
        if key not in self._records:
            seen = [p for p in pictures if p is not None]
            tokens = max(seen[0].tokens_P) // max(seen[0].calls, 1) if seen else 0
            hw, _ = plan_record(
                topo, Links.of_run(), None, model_dim=cfg.experts.model_dim,
                hidden=cfg.experts.hidden_dim, tokens=max(tokens, 1),
                experts=cfg.gate.num_experts,
            )  # fmt: skip
            self._records[key] = hw.with_topology(topo.nodes, topo.ranks_per_node)
        return self._records[key]
