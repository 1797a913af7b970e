"""The re-planner's records (replan.py): a `Switch` per plan change, the forced schedule that
replays a history, a plan's name and its span in a trace, and the checks of the re-planner's
arguments."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import trace
from ..config import MoEConfig
from ..layer.moe import NEEDS_TUNER, MoELayer

__all__ = ["Switch", "check_schedule", "number_in", "plan_name", "positive_int", "schedule_of",
           "trace_plans"]  # fmt: skip


@dataclass(frozen=True)
class Switch:
    """One plan change: `layer` (index in model order) runs `config` from `step` on.

    `old` and `new` are `MoEConfig.summary()`s (with "capacity_factor" when it changed);
    `predicted_gain` is 1 - predicted new / running step of the layer (None for a forced plan);
    `measured_gain` 1 - median forward call of the window after / before (None until measured,
    or when a window had no calls)."""

    step: int
    layer: int
    old: dict
    new: dict
    config: MoEConfig
    predicted_gain: float | None
    measured_gain: float | None = None

    def as_dict(self) -> dict:
        """The metrics file's record (without the full config)."""
        out = dataclasses.asdict(self)
        del out["config"]
        return out


def schedule_of(history: list[Switch]) -> dict[int, dict[int, MoEConfig]]:
    """The forced schedule that replays `history`'s switches at the same steps."""
    out: dict[int, dict[int, MoEConfig]] = {}
    for s in history:
        out.setdefault(s.step, {})[s.layer] = s.config
    return out


def plan_name(config: MoEConfig) -> str:
    """policy/r/algorithm/compression, and /fF in capacity mode: "schemoe/r4/naive/none/f1.25"."""
    s = config.summary()
    name = f"{s['policy']}/r{s['chunks']}/{s['algorithm']}/{s['compression']}"
    return name if config.gate.dropless else f"{name}/f{config.gate.capacity_factor:g}"


def trace_plans(layers: Sequence[MoELayer], since: float) -> float:
    """When a trace is recording (`schemoe.trace.record`), one span per layer from `since` to
    now on the resource "plan L<i>", named by the plan the layer runs (the re-planner calls it
    after each step, so the trace shows which plan ran when); returns now."""
    now = time.perf_counter()
    if (tracer := trace.active("plan")) is not None:
        for i, m in enumerate(layers):
            if m.running is not None:
                tracer.record(trace.Mark(f"L{i} {plan_name(m.running)}", f"plan L{i}"), since, now)
    return now


def number_in(v: object, lo: float, hi: float) -> bool:
    """Whether `v` is a number (not a bool) with lo <= v < hi."""
    return isinstance(v, int | float) and not isinstance(v, bool) and lo <= v < hi


def positive_int(name: str, v: object) -> int:
    """`v`, an int >= 1, else ValueError naming `name` and `v`."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


def check_schedule(schedule: object, layers: int) -> dict[int, dict[int, MoEConfig]]:
    """A forced schedule {step >= 1: {layer index < layers: MoEConfig of a fixed policy}}."""
    if schedule is None:
        return {}
    if not isinstance(schedule, Mapping):
        raise TypeError(
            f"schedule must be a dict {{step: {{layer: MoEConfig}}}}, got {type(schedule).__name__}"
        )
    for s, plans in schedule.items():
        positive_int("a schedule step", s)
        for i, cfg in plans.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers:
                raise ValueError(
                    f"schedule step {s}: layer {i!r} is not a MoE layer index (0..{layers - 1})"
                )
            if not isinstance(cfg, MoEConfig) or cfg.schedule.policy in NEEDS_TUNER:
                raise ValueError(
                    f"schedule step {s}, layer {i}: a plan is a MoEConfig with a fixed policy, "
                    f"got {cfg!r}"
                )
    return {s: dict(p) for s, p in schedule.items()}
