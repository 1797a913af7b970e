"""What the re-planner (replan.py) sees of one MoE layer's routing over a window of steps, and how
it prices that routing with a cost model that assumes uniform routing.

Legend: P ranks of the layer's expert-parallel group, E experts, El = E / P (rank d holds experts
d El .. (d + 1) El - 1), k choices per token, T tokens per rank per call.

    pic = Picture(counts_PE, calls_P, tokens_P)   # every rank's window, gathered (identical)
    pic.send_PP                                   # rows rank s sends to rank d, per call
    pic.priced_tokens(top_k, dropless)            # the T the cost model is asked about
    pic.dropped(f, top_k)                         # what capacity factor f would drop
    best, running_s, gain = plan_for(config, pic, hw, budget)

Pricing skew (the approximation, stated once here): the cost model (costmodel/model.py) assumes
every rank sends k T / P rows to every rank and every expert gets k T / E rows of every rank.
Under skew the step is set by the busiest rank, so the layer is priced at the token count whose
uniform per-rank volume equals the busiest rank's volume:

    V = max over ranks p of max(rows p sends, rows p receives) per call  (own rows included)
    T' = max(1, ceil(V / k))   dropless;   T' = T (the busiest rank's tokens per call) capacity

The received rows are the rows the rank's local expert group computes, so V prices both the
busiest rank's all-to-all volume and its expert compute (the hottest local expert group). In
capacity mode the buffers are padded to C rows per expert whatever the routing (skew drops rows
instead), so the volume is T's. What this leaves out: how the busiest rank's volume is spread
over its peers (a single hot pair prices as if spread evenly over P), the other ranks' idle time
(it is in the step, not in any rank's volume), expert-by-expert imbalance inside a rank's group
(a grouped GEMM costs about its total rows), and call-to-call variation inside the window (the
window's mean per call is priced).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import MoEConfig
from ..costmodel.hardware import Hardware
from ..costmodel.model import A2A_MODELS, LayerShape
from ..costmodel.prediction import Prediction, predict_config
from .choose import AUTO_CHUNKS, AUTO_SKIPS, as_config, explore, shortlist

__all__ = ["Picture", "on_grid", "plan_for", "running_step_s", "with_capacity"]


@dataclass(frozen=True)
class Picture:
    """One layer's routing over a window, every rank's row (all-gathered, so identical on every
    rank of the group).

    Args:
        counts_PE: choices of rank p's tokens that picked expert e (before capacity drops).
        calls_P: training calls rank p made in the window.
        tokens_P: tokens rank p routed in those calls.
    """

    counts_PE: tuple[tuple[int, ...], ...]
    calls_P: tuple[int, ...]
    tokens_P: tuple[int, ...]

    def __post_init__(self) -> None:
        P = len(self.counts_PE)
        if P < 1 or len(self.calls_P) != P or len(self.tokens_P) != P:
            raise ValueError(
                f"a Picture needs one row per rank in counts_PE, calls_P and tokens_P, got "
                f"{P}, {len(self.calls_P)} and {len(self.tokens_P)} rows"
            )
        E = len(self.counts_PE[0])
        if E % P or any(len(row) != E for row in self.counts_PE):
            raise ValueError(f"counts_PE must be P x E with E divisible by P, got {self.counts_PE}")
        if min(min(row) for row in self.counts_PE) < 0 or min(self.calls_P + self.tokens_P) < 0:
            raise ValueError(f"a Picture's counts must be >= 0, got {self}")

    @property
    def calls(self) -> int:
        """Calls per rank in the window (every rank of a group makes the same calls)."""
        return max(self.calls_P)

    @property
    def send_PP(self) -> list[list[float]]:
        """Rows rank s sends to rank d per call (d's experts' choices among s's tokens)."""
        P, E = len(self.counts_PE), len(self.counts_PE[0])
        El, n = E // P, max(self.calls, 1)
        return [[sum(row[d * El : (d + 1) * El]) / n for d in range(P)] for row in self.counts_PE]

    @property
    def load_E(self) -> list[int]:
        """Choices per expert over every rank's tokens."""
        return [sum(col) for col in zip(*self.counts_PE)]

    def busiest(self) -> float:
        """V: the most rows a rank sends or receives per call (its own rows included)."""
        s = self.send_PP
        sent = [sum(row) for row in s]
        received = [sum(col) for col in zip(*s)]
        return max(sent + received)

    def skew(self) -> float:
        """V over the mean rank's rows sent per call (1: even, P: everything to one rank)."""
        s = self.send_PP
        mean = sum(map(sum, s)) / len(s)
        return self.busiest() / mean if mean else 1.0

    def dropped(self, capacity_factor: float, top_k: int) -> float:
        """The fraction of the choices capacity factor f > 0 drops on this picture: rank p keeps
        min(c, C_p) of the c choices per call of each expert, C_p = min(ceil(f k T_p / E), T_p)
        (`routing.router.capacity`) at p's mean T_p tokens per call. Call-to-call variation is
        left out (the window's mean per call is priced)."""
        n, E = max(self.calls, 1), len(self.counts_PE[0])
        kept = total = 0.0
        for row, tokens in zip(self.counts_PE, self.tokens_P):
            T = tokens / n
            cap = min(math.ceil(capacity_factor * top_k * T / E), T)
            kept += sum(min(c / n, cap) for c in row)
            total += sum(row) / n
        return 1.0 - kept / total if total else 0.0

    def priced_tokens(self, top_k: int, dropless: bool) -> int:
        """T' of the module docstring: the tokens per rank per call the layer is priced at."""
        n = max(self.calls, 1)
        tokens = max(math.ceil(t / n) for t in self.tokens_P)
        if not dropless:
            return max(tokens, 1)
        return max(1, math.ceil(self.busiest() / top_k))


def on_grid(tokens: int, steps_per_octave: int = 16) -> int:
    """`tokens` rounded up to a geometric grid (2 ** (1 / steps_per_octave) apart, ~4.4%):
    windows whose pictures differ by routing noise are priced at the same T', so the search's
    cache (`plan_for`) serves them and a decision point costs no search. Rounding up prices the
    busiest rank a little high, never low. Below 2 * steps_per_octave tokens: exact."""
    if tokens < 2 * steps_per_octave:
        return tokens
    step = 2 ** (1 / steps_per_octave)
    i = math.ceil(math.log(tokens, step) - 1e-9)
    while math.ceil(step ** (i - 1)) >= tokens:  # the grid's points are ceil(step ** i)
        i -= 1
    return math.ceil(step**i)


def with_capacity(
    running: MoEConfig, pic: Picture, factors: tuple[float, ...], max_drop: float
) -> MoEConfig:
    """`running` with the capacity factor the drop budget picks among `factors` (ascending):
    the smallest whose `pic.dropped` is <= max_drop, else the largest. `running` itself when
    dropless, without factors (the opt-in is off) or when that is its own f."""
    g = running.gate
    if not factors or g.dropless:
        return running
    fits = [f for f in factors if pic.dropped(f, g.top_k) <= max_drop]
    f = fits[0] if fits else factors[-1]
    if f == g.capacity_factor:
        return running
    return dataclasses.replace(running, gate=dataclasses.replace(g, capacity_factor=f))


def _same_plan(config: MoEConfig, p: Prediction) -> bool:
    c = config
    return (
        c.schedule.policy == p.policy
        and c.schedule.chunks == p.chunks
        and c.collective.algorithm == p.algorithm
        and (c.compression.forward, c.compression.backward) == tuple(p.compressors)
    )


def running_step_s(config: MoEConfig, tokens: int, hw: Hardware, cache: dict | None) -> float:
    """The cost model's step (seconds) of `config` at `tokens` on `hw`, memoised in `cache`
    (a decision point asks it of every layer's running plan at every window)."""
    key = ("running", repr(config), tokens, hw.dumps())
    if cache is None or key not in cache:
        step_s = predict_config(config, tokens, hw).step_s
        if cache is None:
            return step_s
        cache[key] = step_s
    return cache[key]


def plan_for(
    running: MoEConfig,
    tokens: int,
    hw: Hardware,
    budget: str,
    cache: dict | None = None,
) -> tuple[MoEConfig, float, float] | None:
    """The cost model's best plan for a layer running `running` at `tokens` per rank per call
    (`Picture.priced_tokens`) on `hw` (already at the layer's topology): (its config, the
    running plan's predicted step in seconds, the predicted gain 1 - best / running, 0 when the
    best is the running plan). None when the running algorithm has no cost model.

    The candidates are `choose.explore`'s (r in AUTO_CHUNKS, every algorithm with a cost model
    but AUTO_SKIPS, every compressor `budget` allows), narrowed by `choose.shortlist`, without
    the `search` refinement: a plan must be reproducible from its MoEConfig alone (a forced
    schedule replays it). `cache` (a dict the caller keeps) memoises the search per shape."""
    if running.collective.algorithm not in A2A_MODELS:
        return None
    shape = LayerShape.of(running, tokens)
    key = (shape, hw.dumps(), budget)
    if cache is None or key not in cache:
        preds = explore(hw, shape, budget, refine=False, chunk_grid=AUTO_CHUNKS, skip=AUTO_SKIPS)
        best = shortlist(preds, 1)[0]
        if cache is not None:
            cache[key] = best
    else:
        best = cache[key]
    now = running_step_s(running, tokens, hw, cache)
    if _same_plan(running, best) or now <= 0:
        return running, now, 0.0
    return as_config(running, best), now, 1.0 - best.step_s / now
