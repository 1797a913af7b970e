"""The part of a layer call torch.compile does not trace: split sizes, chunk plan and region.

Legend: T tokens on this rank, M model dim, E experts, N dispatch-buffer rows.

Under `torch.compile(model)` a MoELayer call is three pieces: routing and encode (traced), this
function (run eagerly: one graph break), and decode plus the shared experts' sum (traced). It is
kept out of the graph on purpose, for two reasons:
  * the scheduled region (schemoe.layer.region) is a Python executor that posts asynchronous
    collectives and builds each chunk's expert graph itself, forward and backward (an autograd
    Function whose backward runs its own schedule); dynamo cannot trace waits on c10d work
    handles or the region's saved per-chunk graphs, and the region is where the time goes, in
    kernels that compilation would not change;
  * the chunk plan needs the split sizes on the host: in dropless mode a read of data-dependent
    counts, which would otherwise break the graph a second time (and recompile for every new
    set of counts).
Every tensor it takes and returns is a plain activation, so autograd chains through the break.
"""

from __future__ import annotations

import torch

from ..routing.router import Routing, capacity
from .recompute import selective
from .region import run_region

__all__ = ["expert_parallel"]


_WHY = "schemoe's scheduled expert-parallel region runs eagerly (schemoe/layer/opaque.py)"


def _eager(fn):
    """torch.compiler.disable(fn), with the reason dynamo reports where the torch has it."""
    try:
        return torch.compiler.disable(fn, reason=_WHY)
    except TypeError:  # torch < 2.8: no `reason`
        return torch.compiler.disable(fn)


@_eager
def expert_parallel(
    layer, rows_NM: torch.Tensor | None, x_TM: torch.Tensor, routing: Routing
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The expert-parallel step of `layer` (a MoELayer) on this rank's dispatch buffer rows
    [N, M]: learn the splits (the router's device counts in dropless mode; in capacity mode they
    follow from T), plan the chunks, run the scheduled region.

    Returns (combined rows [N, M], shared experts' output [T, M] or None). With token
    deduplication (rows_NM None) the dispatcher builds the unique rows from x_TM once it has read
    the counts, and the result is y [T, M] itself, each token's unique rows summed. Collective
    unless the splits follow from the config; in a checkpointed block's recomputation
    (recompute.py) the first forward's outputs, nothing run."""
    rows = x_TM.shape[0] if layer.dispatcher.dedup else routing.rows
    return selective(layer, rows, lambda wrap: _run(layer, rows_NM, x_TM, routing, wrap))


def _run(layer, rows_NM: torch.Tensor | None, x_TM: torch.Tensor, routing: Routing, wrap):
    cfg = layer.running
    dispatcher = layer.dispatcher
    call = None
    if dispatcher.dedup:
        rows_NM, _, _, plan, call = dispatcher.dispatch_unique(x_TM, routing)
    else:
        E = cfg.gate.num_experts
        counts = None if routing.counts_E is not None else (capacity(cfg.gate, x_TM.shape[0]),) * E
        exchange = dispatcher.start_counts(counts, routing.counts_E, cfg.gate.dropless)
        _, _, plan = dispatcher.plan_chunks(exchange, rows_NM.device)
    region = wrap(layer.region_of(plan, call))
    out = run_region(region, rows_NM, None if layer.shared is None else x_TM)
    out, s_TM = (out, None) if layer.shared is None else out
    if call is not None:
        out = call.combine(out, x_TM.dtype)
    return out, s_TM
