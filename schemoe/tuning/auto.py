"""Auto-tuning, outside the layer: `AutoTuner` decides what the MoE layers of a model run.

    tuner = AutoTuner(model)            # every MoELayer whose policy is "auto" or "search"
    for batch in data:                  # the first calls decide, the rest run the decision
        loss = model(batch); loss.backward(); ...
    tuner.tuning                        # False once every layer has settled
    tuner.report                        # each trial candidate's median and the choice

The tuner attaches forward hooks (PyTorch's own seam) and reconfigures layers with
`MoELayer.configure`; a layer never imports the cost model. On a layer's first call, with rank
0's token count (broadcast, so every rank decides the same):

  * the Hardware record to plan on: `hardware=` if given; else `planning.plan_record` under the
    run's key (`profiles.cache_key` of the layer's topology and the run's `Links`, by default
    `Links.of_run()`: the testbed's rates when on it, else unshaped): the stored profile, else a
    quick profile measured by the layer's group, stored and logged with what it took
    (`tuner.measured`). Never another topology's or link rate's record;
  * policy "search": the layer gets the CostModel of its shape on that record, and the search
    policy orders its tasks by it;
  * policy "auto": the cost model (`costmodel.tune`) shortlists the `shortlist` most promising
    configurations on that record; with trials > 0 the layer's next calls run them in turn,
    timed, and the fastest measured one is kept; trials = 0: the model's first choice,
    unmeasured.

Why measure at all: the simulator's error (docs/costmodel.md) is often larger than the gaps
between a layer's best few configurations, and largest exactly where they differ (per-chunk costs, FasterMoE's uneven peer groups, CPU ranks contending for cores). So the
model narrows ~100 candidates to a few that differ in partition or r (`tune.shortlist`), and the
real layer, on the real data, picks among them.

Calls run the candidates round-robin: a first round unmeasured (schedules are built, caches and
buffers warm), then `samples` measured rounds, so slow drifts of a shared machine hit every
candidate alike. A sample is one call's time: the layer's forward call (routing and layout
included: the chunk plan depends on the candidate) plus its backward (from the gradient of its
output arriving to the gradient of its input leaving, when the input requires grad), when that
runs before the next forward call. `decide` takes each candidate's median, combines them across
ranks with an all-reduce MAX (the slowest rank sets the step, and every rank keeps the same
configuration), and returns the index of the fastest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import trace
from ..costmodel import profiles
from ..costmodel.hardware import Hardware
from ..dist.devices import control_tensor
from ..dist.links import Links
from ..layer.moe import NEEDS_TUNER, MoELayer
from .plan import cost_model_for, plan_record, resolve

__all__ = ["AutoTuner", "Trials"]

log = logging.getLogger("schemoe.tuning.auto")

TUNED = NEEDS_TUNER


class Trials:
    """Round-robin timing of candidate configurations (see the module docstring).

    Args:
        configs: the candidates, best predicted first (two or more).
        samples: measured calls per candidate, after one warm-up call each.
    """

    def __init__(self, configs: Sequence, samples: int) -> None:
        if len(configs) < 2:
            raise ValueError(f"Trials needs >= 2 candidates, got {len(configs)}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be an int >= 1, got {samples!r}")
        self.configs = list(configs)
        self.samples = samples
        self.times: list[list[float]] = [[] for _ in self.configs]
        self._calls = 0
        self._open: tuple[int, float] | None = None  # (candidate, seconds so far) of this call
        self.report: list[dict] = []  # after decide(): each candidate, its median, the choice

    @property
    def calls(self) -> int:
        """Layer calls the trials take: a warm-up round and `samples` measured rounds."""
        return len(self.configs) * (self.samples + 1)

    def next(self) -> int | None:
        """Close the previous call's sample; the candidate index this call runs, or None when
        every sample is in (then call `decide`)."""
        if self._open is not None:
            i, seconds = self._open
            if self._calls > len(self.configs):  # past the warm-up round
                self.times[i].append(seconds)
            self._open = None
        if self._calls == self.calls:
            return None
        i = self._calls % len(self.configs)
        self._calls += 1
        self._open = (i, 0.0)
        return i

    def add(self, seconds: float) -> None:
        """Count `seconds` of region time toward the running call's sample."""
        if self._open is not None:
            i, so_far = self._open
            self._open = (i, so_far + seconds)

    def medians(self) -> list[float]:
        out = []
        for ts in self.times:
            s = sorted(ts)
            n = len(s)
            out.append(s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)
        return out

    def decide(self, reduce: Callable[[list[float]], list[float]] = lambda m: m) -> int:
        """The index of the fastest candidate by median sample after `reduce` (e.g. the max over
        ranks); logs every candidate's median."""
        if any(len(ts) < self.samples for ts in self.times):
            raise RuntimeError(f"decide() before every sample is in: {self.times}")
        med = reduce(self.medians())
        best = min(range(len(med)), key=lambda i: (med[i], i))
        self.report = [
            {**cfg.summary(), "median_ms": round(m * 1e3, 3), "chosen": i == best}
            for i, (cfg, m) in enumerate(zip(self.configs, med))
        ]
        for row in self.report:
            log.info("auto trial: %s", row)
        return best


@dataclass
class _State:
    """One tuned layer's progress."""

    decided: bool = False
    trials: Trials | None = None
    t0: float = 0.0  # this call's forward start (timed calls)
    backward_t0: float = 0.0


class AutoTuner:
    """Decides, from outside, what every MoELayer of `model` with policy "auto" or "search" runs
    (see the module docstring).

    Args:
        model: a module containing MoELayers (or a MoELayer).
        hardware: the Hardware record to plan on (default: the profile stored under the run's
            key, else a quick profile measured on the first call and stored; see above).
        profile_path: the profile store (default `costmodel.profiles.DEFAULT_PATH`).
        links: the links the run's ranks talk over, for its key (default `Links.of_run()`).

    After the first calls, `measured` lists each quick profile this tuner took: its key, the
    seconds it took (rank 0's) and what it measured.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        hardware: Hardware | None = None,
        profile_path: str | None = None,
        links: Links | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"AutoTuner needs an nn.Module, got {type(model).__name__}")
        self.hardware, self.profile_path = hardware, profile_path
        self.links = links if links is not None else Links.of_run()
        self.measured: list[dict] = []
        self._records: dict[str, Hardware] = {}  # by key: one read or measurement per tuner
        self.layers = [
            m
            for m in model.modules()
            if isinstance(m, MoELayer) and m.config.schedule.policy in TUNED
        ]
        self._state = {m: _State() for m in self.layers}
        self.report: list[dict] = []
        self._hooks = []
        for m in self.layers:
            self._hooks.append(m.register_forward_pre_hook(self._before))
            self._hooks.append(m.register_forward_hook(self._after))

    @property
    def tuning(self) -> bool:
        """True until every tuned layer has settled on a configuration."""
        return any(not s.decided or s.trials is not None for s in self._state.values())

    def remove(self) -> None:
        """Detach the hooks (the layers keep what they run)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---------------------------------------------------------------- hooks
    def _first_call(self, layer: MoELayer, x: torch.Tensor, st: _State) -> None:
        cfg, topo = layer.config, layer.topology
        tokens = x.numel() // cfg.experts.model_dim
        if topo.world > 1:  # every rank decides on rank 0's shape
            t = control_tensor([tokens], dtype=torch.int64, group=topo.group)
            dist.broadcast(t, topo.global_rank(0), group=topo.group)
            tokens = int(t.item())  # host sync, once per layer
        tokens = max(tokens, 1)
        st.decided = True
        hw = self._hardware(layer, tokens)
        if cfg.schedule.policy == "search":
            costs = cost_model_for(cfg, tokens, topo, hw)
            if costs is None:  # an algorithm without a cost model: nothing to search with
                log.warning(
                    "autotune: no cost model for algorithm %r; policy 'search' runs the "
                    "schemoe order",
                    cfg.collective.algorithm,
                )
                cfg = dataclasses.replace(
                    cfg, schedule=dataclasses.replace(cfg.schedule, policy="schemoe")
                )
            layer.configure(cfg, costs=costs)
            return
        n = cfg.schedule.shortlist if cfg.schedule.trials else 1
        picks = resolve(cfg, tokens, topo, hw, n)
        if len(picks) == 1:
            layer.configure(picks[0])
        else:
            st.trials = Trials(picks, cfg.schedule.trials)

    def _hardware(self, layer: MoELayer, tokens: int) -> Hardware:
        """The record to plan `layer` on (collective over its group; see the module docstring)."""
        if self.hardware is not None:
            return self.hardware
        topo, cfg = layer.topology, layer.config
        key = profiles.cache_key(topo.nodes, topo.ranks_per_node, self.links)
        if key not in self._records:
            hw, row = plan_record(
                topo, self.links, self.profile_path, model_dim=cfg.experts.model_dim,
                hidden=cfg.experts.hidden_dim, tokens=tokens, experts=cfg.gate.num_experts,
            )  # fmt: skip
            if row is not None:
                self.measured.append(row)
            self._records[key] = hw
        return self._records[key]

    def _before(self, layer: MoELayer, args: tuple):
        st = self._state[layer]
        x = args[0]
        if not st.decided:
            self._first_call(layer, x, st)
        if st.trials is None:
            return None
        i = st.trials.next()
        if i is None:  # every sample is in: decide (collective)
            best = st.trials.decide(lambda medians: self._slowest(layer, medians, x.device))
            layer.configure(st.trials.configs[best])
            self.report += st.trials.report
            st.trials = None
            return None
        layer.configure(st.trials.configs[i])
        st.t0 = trace.clock(x.device)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return None
        # The end of this layer's backward: the gradient of its input leaving.
        x = x.view_as(x)
        x.register_hook(lambda g: self._backward_done(st, g))
        return (x, *args[1:])

    def _after(self, layer: MoELayer, args: tuple, out):
        st = self._state[layer]
        if st.trials is None or not st.t0:
            return
        st.trials.add(trace.clock(args[0].device) - st.t0)
        st.t0 = 0.0
        y = out[0]
        if torch.is_grad_enabled() and y.requires_grad:

            def started(g):
                st.backward_t0 = trace.clock(g.device)

            y.register_hook(started)

    @staticmethod
    def _backward_done(st: _State, g: torch.Tensor) -> None:
        if st.trials is not None and st.backward_t0:
            st.trials.add(trace.clock(g.device) - st.backward_t0)
            st.backward_t0 = 0.0

    @staticmethod
    def _slowest(layer: MoELayer, medians: list[float], device) -> list[float]:
        if layer.topology.world == 1:
            return medians
        t = control_tensor(medians, dtype=torch.float64, group=layer.topology.group)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=layer.topology.group)
        return t.tolist()
