"""What `schemoe train` reports as it runs, on rank 0: the progress bar, the per-step metrics
(JSONL file, TensorBoard), the loss plot, and the summary's JSON-safe values."""

from __future__ import annotations

import json
import math
import sys
import time

from ..layer.metrics import load_summary
from ..layer.moe import MoELayer
from ..tuning.replan import Switch
from .config import TrainConfig

__all__ = ["Metrics", "Progress", "finite_or_none", "plot", "replan_line"]


class Progress:
    """A one-line text bar, redrawn with '\\r', only when stdout is a terminal."""

    def __init__(self, total: int, on: bool) -> None:
        self.total, self.on, self.t0, self.shown = total, on and sys.stdout.isatty(), None, 0

    def print(self, text: str) -> None:
        if self.on and self.shown:
            sys.stdout.write("\r" + " " * self.shown + "\r")
            self.shown = 0
        print(text, flush=True)

    def update(self, step: int, first: int, loss: float) -> None:
        if not self.on:
            return
        self.t0 = self.t0 or time.perf_counter()
        done = step - first + 1
        eta = (time.perf_counter() - self.t0) / max(1, done - 1) * (self.total - step)
        bar = "#" * (30 * step // self.total)
        text = f"[{bar:<30}] {step}/{self.total}  loss {loss:.4f}  eta {eta:.0f}s"
        sys.stdout.write("\r" + text.ljust(self.shown))
        sys.stdout.flush()
        self.shown = len(text)

    def close(self) -> None:
        if self.on and self.shown:
            print(flush=True)


class Metrics:
    """Rank 0's per-step metrics: a JSONL file (--log-file), TensorBoard scalars
    (--tensorboard) and the step line's load summary. Per MoE layer: tokens per expert, load
    fractions, dropped fraction and overload factor (schemoe.layer.metrics) of rank 0's own
    tokens (no collective), read every step with a file or TensorBoard (one host sync per layer,
    after the step's own), else only for the step lines (then over the steps since the last)."""

    def __init__(self, a: TrainConfig, moe: list[MoELayer]) -> None:
        self.moe = moe
        for m in self.moe:
            m.record_routing = True
        self.every_step = bool(a.log_file or a.tensorboard)
        self.file = open(a.log_file, "w", encoding="utf-8") if a.log_file else None  # noqa: SIM115
        self.tb = None
        if a.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional: checked up front

            self.tb = SummaryWriter(a.tensorboard)

    def write(self, step: int, loss: float, lr: float, gnorm: float, tps: float, parts: dict,
              *, line: bool = False, skipped: bool = False) -> str:  # fmt: skip
        """Record step `step`; returns the load summary for its step line when `line` ("" if
        none), e.g. "overload 1.42 drop 0.8%". `skipped`: the step's loss or gradient norm was
        not finite and no weight changed (non-finite values are written as null)."""
        if not (self.every_step or line):
            return ""
        per_layer = [m.take_load_metrics() for m in self.moe]
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm, "skipped": skipped,
               "tokens_per_s": tps, "step_ms": parts,
               "moe": [p.as_dict() if p else None for p in per_layer]}  # fmt: skip
        if self.file:
            self.file.write(json.dumps(finite_or_none(row)) + "\n")
            self.file.flush()
        if self.tb:
            for k in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.tb.add_scalar(f"train/{k}", row[k], step)
            for k, v in parts.items():
                self.tb.add_scalar(f"step_ms/{k}", v, step)
            for i, r in enumerate(per_layer):
                if r:
                    self.tb.add_scalar(f"moe{i}/dropped", r.dropped, step)
                    self.tb.add_scalar(f"moe{i}/max_load", max(r.load), step)
                    self.tb.add_scalar(f"moe{i}/overload", r.overload, step)
        return load_summary(per_layer) if line else ""

    def replan(self, step: int, switch: Switch) -> None:
        """A --replan row after step `step`: {"step", "replan": the switch (`Switch.as_dict()`:
        from which step, layer, old and new plan, predicted gain, measured gain or null)}. A
        switch is written when made and again when its gain is measured."""
        if self.file:
            row = {"step": step, "replan": switch.as_dict()}
            self.file.write(json.dumps(finite_or_none(row)) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def replan_line(switch: Switch) -> str:
    """The console line of a --replan switch (a `schemoe.tuning.replan.Switch`)."""

    def plan(d: dict) -> str:
        f = f" f={d['capacity_factor']:g}" if "capacity_factor" in d else ""
        return (
            f"{d.get('policy')} r={d.get('chunks')} {d.get('algorithm')} {d.get('compression')}{f}"
        )

    gain = switch.predicted_gain
    shown = "forced" if gain is None else f"predicted {100 * gain:.1f}% faster"
    # A plan with another f is taken for the drop budget, even when predicted slower.
    return (f"replan: MoE layer {switch.layer} runs {plan(switch.new)} from step {switch.step} "
            f"(was {plan(switch.old)}; {shown})")  # fmt: skip


def plot(losses: list[float], evals: list[list[float]], path: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, label="train")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="eval (held out)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title="schemoe train")
    ax.legend()
    fig.savefig(path, dpi=100)


def finite_or_none(v):
    """`v` with every non-finite float replaced by None: the summary line stays valid JSON."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite_or_none(x) for x in v]
    return v
