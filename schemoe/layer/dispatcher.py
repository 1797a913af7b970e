"""The token dispatcher: owns the token path of one MoE layer, from routed tokens to the rows the
scheduled region exchanges, and back.

Legend: T tokens on this rank, M model dim, E experts, P ranks, El = E / P, N buffer rows.

    rows_NM, meta = dispatcher.dispatch(x_TM, routing)   # encode + counts + chunk plan
    ... the scheduled region turns rows_NM into out_NM (same rows, expert outputs) ...
    y_TM = dispatcher.combine(out_NM, meta)               # weighted sum in token order

`DispatchMeta` is frozen and holds everything combine needs; nothing is stashed on the dispatcher
between the two calls, so calls may interleave (micro-chunks, re-entrant layers).

How the receiver learns its splits ([P][El] rows each source rank sends to each local expert):
  * capacity mode with `uniform_tokens=True` (every rank of the group routes the same number of
    tokens T at every call, the usual training case, declared by the user): every expert buffer
    holds C = ceil(f k T / E) rows on every rank, so the splits follow from the config: no
    exchange and no host sync;
  * otherwise (dropless, or T that may differ between ranks): one tiny all-to-all of the counts,
    started before encode so it overlaps it, and one host sync (`.tolist()`) to read it: the
    chunk plan's splits must be known on the host. The exchange runs on the dispatcher's own
    communicator (tag "counts"), not on the default group.

Host syncs of one layer call (forward and backward; tests/test_dispatcher.py counts them):
  * capacity mode, uniform tokens: none (C follows from T, a shape);
  * dropless (or capacity with tokens that may differ between ranks): the received counts,
    here, once per call when P > 1; and, in dropless mode, the router's own counts
    (schemoe.routing.router reads its per-expert counts to size the sends). The experts add
    none: grouped experts build their group offsets from the plan's host counts (a
    host-to-device copy), and backward reuses the forward's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dist.devices import control_tensor
from ..dist.topology import Topology
from ..routing.layout import Chunk, Partition, build_plan, decode, encode
from ..routing.router import Routing

__all__ = ["DispatchMeta", "TokenDispatcher"]


@dataclass(frozen=True)
class DispatchMeta:
    """What combine needs of one dispatch: the routing (slots, weights), the input dtype, the
    rows per expert this rank sends (`counts`, E) and receives (`recv_counts`, [P][El]), and the
    chunk plan the region runs."""

    routing: Routing
    dtype: torch.dtype
    counts: tuple[int, ...]
    recv_counts: tuple[tuple[int, ...], ...]
    plan: tuple[Chunk, ...]


class TokenDispatcher:
    """Encodes tokens into the expert-major buffer, learns the splits and plans the chunks.

    Args:
        topology: the expert-parallel group's topology.
        num_experts: E (a multiple of P).
        chunks: r, the chunks of the scheduled region.
        partition: how the chunks cut the buffer (the policy's).
        uniform_tokens: every rank routes the same T at every call (capacity mode only): the
            splits follow from the config and no counts are exchanged.
    """

    def __init__(
        self,
        topology: Topology,
        num_experts: int,
        chunks: int,
        partition: Partition | str = Partition.CAPACITY,
        *,
        uniform_tokens: bool = False,
    ) -> None:
        if num_experts % topology.world:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the expert-parallel size "
                f"{topology.world}"
            )
        self.topology = topology
        self.num_experts = num_experts
        self.num_local = num_experts // topology.world
        self.chunks = chunks
        self.partition = Partition(partition)
        self.uniform_tokens = uniform_tokens
        # The counts exchange runs on a communicator of its own (never the default group DDP
        # all-reduces on); creating it is collective, like constructing the layer.
        P = topology.world
        self.group = topology.subgroup(tuple(range(P)), tag="counts") if P > 1 else None

    def _recv_counts(self, counts: tuple[int, ...], dropless: bool):
        """A function returning [P][El] (the exchange is started now, read when called)."""
        P, El = self.topology.world, self.num_local
        if P == 1:
            return lambda: (tuple(counts),)
        if self.uniform_tokens and not dropless:
            # Every rank's buffer has C rows per expert (C from the same T): no exchange.
            return lambda: ((counts[0],) * El,) * P
        send = control_tensor(counts, dtype=torch.long, group=self.group)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        buffers = (send, recv)  # both held by `wait` until the exchange has completed

        def wait() -> tuple[tuple[int, ...], ...]:
            work.wait()
            flat = buffers[1].tolist()  # host sync: the splits must be known on the host
            return tuple(tuple(flat[s * El : (s + 1) * El]) for s in range(P))

        return wait

    def dispatch(
        self, x_TM: torch.Tensor, routing: Routing, *, dropless: bool = False
    ) -> tuple[torch.Tensor, DispatchMeta]:
        """Tokens into this rank's dispatch buffer rows [N, M], and the metadata of the call.

        Collective over the group unless the splits follow from the config (see the module
        docstring): every rank must call it."""
        # 1. Start learning what every rank sends to this rank's experts.
        recv_counts = self._recv_counts(routing.counts, dropless)
        # 2. Scatter the tokens into the expert-major buffer meanwhile.
        rows_NM = encode(x_TM, routing)
        # 3. Cut the buffer into the region's chunks.
        recv = recv_counts()
        plan = build_plan(
            routing.counts, recv, self.topology.rank, self.chunks, self.partition, x_TM.device
        )
        meta = DispatchMeta(routing, x_TM.dtype, tuple(routing.counts), recv, tuple(plan))
        return rows_NM, meta

    def combine(self, rows_NM: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """The expert outputs back in token order, each token's k outputs weighted and summed
        (fp32 accumulation), as the input's dtype: y [T, M]."""
        return decode(rows_NM, meta.routing, meta.dtype)
