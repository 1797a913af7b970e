"""Per-layer expert load: the counts a layer tallies as it routes, and the figures made of them.

Legend: T tokens, k choices per token, E experts.

    counts = tally(counts, routing)              # device: E choices per expert, then the kept
    m = LoadMetrics.from_counts(counts.tolist())  # host (one sync, when someone asks)
    m.tokens, m.dropped, m.overload

A "choice" is one (token, choice) pair: T k of them per call. `tokens[e]` counts the choices that
picked expert e before any capacity drop (the load the router asked for); `kept` those that got a
buffer row. dropped = 1 - kept / choices; overload = max_e tokens[e] / mean_e tokens[e] (1: even
load; E: every choice on one expert).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .router import Routing

__all__ = ["LoadMetrics", "tally"]


@torch.no_grad()
def tally(counts_E1: torch.Tensor | None, routing: Routing) -> torch.Tensor:
    """`counts_E1` (None: zeros) plus this call's choices per expert and kept choices: long
    [E + 1] on the routing's device. No host sync."""
    E = routing.probs_TE.shape[1]
    ids = routing.expert_TK.reshape(-1).long()
    # scatter_add_, not bincount: CUDA's bincount sizes its output with a host sync (max().item()).
    chosen_E = torch.zeros(E, dtype=torch.long, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids)
    )
    kept = (routing.slot_TK >= 0).sum().reshape(1)
    counts = torch.cat([chosen_E, kept])
    return counts if counts_E1 is None else counts_E1 + counts


@dataclass(frozen=True)
class LoadMetrics:
    """One layer's expert load over the calls since it was last taken (one rank's tokens)."""

    tokens: tuple[int, ...]  # E: choices that picked each expert, before capacity drops
    kept: int  # choices that got a buffer row

    @classmethod
    def from_counts(cls, counts: Sequence[int | float]) -> LoadMetrics:
        """From a tally's [E + 1] values (`tally(...).tolist()`)."""
        return cls(tuple(int(c) for c in counts[:-1]), int(counts[-1]))

    @property
    def choices(self) -> int:
        return sum(self.tokens)

    @property
    def load(self) -> list[float]:
        """The fraction of the choices per expert (sums to 1; zeros without choices)."""
        n = self.choices
        return [t / n if n else 0.0 for t in self.tokens]

    @property
    def dropped(self) -> float:
        """The fraction of choices dropped past capacity (0 dropless; 0 without choices)."""
        n = self.choices
        return 1.0 - self.kept / n if n else 0.0

    @property
    def overload(self) -> float:
        """max load / mean load over the experts (1: even; 0 without choices)."""
        n = self.choices
        return max(self.tokens) * len(self.tokens) / n if n else 0.0

    def as_dict(self) -> dict[str, Any]:
        """{"tokens", "load", "dropped", "overload"}: the metrics file's per-layer record."""
        return {"tokens": list(self.tokens), "load": self.load, "dropped": self.dropped,
                "overload": self.overload}  # fmt: skip
