"""Measured trials for policy "auto": the cost model shortlists, the layer's first calls decide.

    trials = Trials(configs, samples=3)    # configs: tune.choose(..., n=4), best predicted first
    i = trials.next()                      # at each forward: the candidate this call runs, or
    trials.add(seconds)                    #   None when every sample is in; add() the call's
    best = trials.decide(reduce)           #   region time (forward, then backward)

Why measure at all: on the 2-node testbed the simulator's median error is ~9%, while the best
few configurations of a layer are often predicted within 1-3% of each other; its errors are
largest exactly where they differ (per-chunk costs, FasterMoE's uneven peer groups, CPU ranks
contending for cores). So the model narrows ~100 candidates to a few that differ in partition or
r (`tune.shortlist`), and the real layer, on the real data, picks among them.

Calls run the candidates round-robin: a first round unmeasured (schedules are built, caches and
buffers warm), then `samples` measured rounds, so slow drifts of a shared machine hit every
candidate alike. A sample is one call's time: the layer's forward call (routing and layout
included: the chunk plan depends on the candidate) plus its scheduled region's backward, when
that runs before the next forward call (the layout's and router's backward do not depend on the
choice). `decide` takes each candidate's median, lets `reduce` combine them across ranks (the
layer passes an all-reduce MAX, so every rank keeps the same configuration: the slowest rank
sets the step), and returns the index of the fastest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

__all__ = ["Trials"]

log = logging.getLogger("schemoe.costmodel")


def _summary(cfg) -> dict:
    f, b = cfg.compression.forward, cfg.compression.backward
    return {
        "policy": cfg.schedule.policy,
        "chunks": cfg.schedule.chunks,
        "algorithm": cfg.collective.algorithm,
        "compression": f if f == b else f"{f}/{b}",
    }


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
            {**_summary(cfg), "median_ms": round(m * 1e3, 3), "chosen": i == best}
            for i, (cfg, m) in enumerate(zip(self.configs, med))
        ]
        for row in self.report:
            log.info("auto trial: %s", row)
        return best
