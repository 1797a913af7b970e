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
  * otherwise (dropless, or T that may differ between ranks): one tiny all-to-all of the counts
    (`dispatch` starts it before encode so it overlaps it; MoELayer.forward, which encodes in
    the compiled graph, starts it after, see schemoe/layer/opaque.py) and one host sync
    (`.tolist()`) to read it: the chunk plan's splits must be known on the host. The exchange
    runs on the dispatcher's own communicator (tag "counts"), not on the default group;
  * with token deduplication (`dedup`, dropless; schemoe/routing/dedup.py): the same exchange
    and read, carrying each rank's unique rows per chunk too, then one all-to-all of every
    expanded row's unique row and combine weight (sizes known: no second sync), and in backward
    one of the weights' gradients (`Dedup`). The buffer the region moves is the unique rows.

Host syncs of one layer call (forward and backward; tests/test_dispatcher.py counts them):
  * capacity mode, uniform tokens: none (C follows from T, a shape);
  * dropless (or capacity with tokens that may differ between ranks): one, here, per call: the
    received counts after the exchange, read together with this rank's own counts in dropless
    mode (the router keeps those on the device, `Routing.counts_E`, and sizes the buffer as
    T k rows without reading them); on one process the counts alone. The experts add none:
    grouped experts build their group offsets from the plan's host counts (a host-to-device
    copy), and backward reuses the forward's plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..dist.devices import comm_device, control_zeros
from ..dist.topology import Topology
from ..routing.dedup import UniqueLayout, decode_unique, encode_unique, receive, unique_layout
from ..routing.layout import Chunk, Partition, Unique, build_plan, decode, encode
from ..routing.router import Routing

__all__ = ["Dedup", "DispatchMeta", "TokenDispatcher"]


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
    dedup: Dedup | None = None


@dataclass(frozen=True)
class Dedup:
    """One call's token deduplication (routing/dedup.py): the sender's `layout` and `token_U`
    (the token of each of its unique rows), `weights_N` the combine weight of each of its
    expanded rows (differentiable: the region's input, receivers apply them), the expanded rows
    to (`rows_to`) and from (`rows_from`) each rank, and the communicator of the exchanges of
    per-row data."""

    layout: UniqueLayout
    weights_N: torch.Tensor
    rows_to: tuple[int, ...]
    rows_from: tuple[int, ...]
    group: Any
    token_U: torch.Tensor | None = None

    def combine(self, out_UM: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y [T, M]: each token's unique rows (its receivers' weighted sums) summed, fp32."""
        return decode_unique(out_UM, self.token_U, self.layout.num_tokens, dtype)

    def exchange(self, data: torch.Tensor, back: bool = False) -> torch.Tensor:
        """Per-row data of this rank's expanded rows [N, ...] to their receivers ([R, ...]), or
        with `back` the receivers' [R, ...] to the senders ([N, ...]): through the
        communicator's device, returned on data's. Collective (none on one rank)."""
        if self.group is None:
            return data
        send = data.to(comm_device(self.group))
        to, frm = (self.rows_from, self.rows_to) if back else (self.rows_to, self.rows_from)
        out = send.new_empty((sum(frm), *send.shape[1:]))
        dist.all_to_all_single(out, send, list(frm), list(to), self.group)
        return out.to(data.device)

    def weight_grads(self, grads: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The gradient of `weights_N` from the receivers' (rows, gradient) pairs, one per chunk
        (rows: places among the received expanded rows). Collective."""
        g_R = self.weights_N.new_zeros(sum(self.rows_from))
        for rows, g in grads:
            g_R.index_copy_(0, rows, g.to(g_R.dtype))
        return self.exchange(g_R, back=True)


class TokenDispatcher:
    """Encodes tokens into the expert-major buffer, learns the splits and plans the chunks.

    Args:
        topology: the expert-parallel group's topology.
        num_experts: E (a multiple of P).
        chunks: r, the chunks of the scheduled region.
        partition: how the chunks cut the buffer (the policy's).
        uniform_tokens: every rank routes the same T at every call (capacity mode only): the
            splits follow from the config and no counts are exchanged.
        dedup: send each token once per destination rank (dropless only; module docstring).
    """

    def __init__(
        self,
        topology: Topology,
        num_experts: int,
        chunks: int,
        partition: Partition | str = Partition.CAPACITY,
        *,
        uniform_tokens: bool = False,
        dedup: bool = False,
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
        self.dedup = dedup
        # The counts exchange runs on a communicator of its own (never the default group DDP
        # all-reduces on); creating it is collective, like constructing the layer.
        P = topology.world
        self.group = topology.subgroup(tuple(range(P)), tag="counts") if P > 1 else None

    def start_counts(
        self, counts: tuple[int, ...] | None, counts_E: torch.Tensor | None, dropless: bool
    ):
        """Start learning the splits; returns a function giving (counts, [P][El]): this rank's
        rows per expert (E) and the rows every source rank sends to each local expert.

        `counts`: this rank's rows per expert on the host, or None (dropless mode) with
        `counts_E`, the router's long [E] device counts. The exchange starts now; the function
        waits for it and reads the sizes back."""
        P, El = self.topology.world, self.num_local
        if counts is not None and P == 1:
            return lambda: (counts, (counts,))
        if counts is not None and self.uniform_tokens and not dropless:
            # Every rank's buffer has C rows per expert (C from the same T): no exchange.
            return lambda: (counts, ((counts[0],) * El,) * P)
        source = counts_E if counts is None else torch.tensor(counts, dtype=torch.long)
        read = self._start_table(source.view(P, El))

        def wait() -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
            sent, got = read()
            own = counts if counts is not None else tuple(c for row in sent for c in row)
            return own, tuple(tuple(row) for row in got)

        return wait

    def _start_table(self, table_PX: torch.Tensor):
        """Start the all-to-all of a long [P, X] table on the counts communicator (row d to rank
        d; none on one rank). Returns a function that waits for it and reads the sent and the
        received table back, as lists of P rows, in the call's one host sync."""
        # On the communicator's device: no copy where the table is there already (NCCL); with
        # gloo and CUDA counts, a device-to-host copy, then the call's one device sync.
        send = control_zeros(table_PX.shape, dtype=torch.long, group=self.group)
        send.copy_(table_PX)
        recv, work = send, None
        if self.group is not None:
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)

        def read() -> tuple[list[list[int]], list[list[int]]]:
            if work is not None:
                work.wait()
            # host sync: the splits must be known on the host; one read of both tables.
            sent, got = torch.stack([send, recv]).tolist()
            return sent, got

        return read

    def plan_chunks(self, exchange, device) -> tuple[tuple[int, ...], tuple, tuple[Chunk, ...]]:
        """Wait for the exchange `start_counts` began, read the split sizes (the call's one host
        sync where there is one) and plan the chunks: (counts, recv_counts, plan)."""
        counts, recv = exchange()
        plan = build_plan(counts, recv, self.topology.rank, self.chunks, self.partition, device)
        return counts, recv, tuple(plan)

    def dispatch_unique(self, x_TM: torch.Tensor, routing: Routing):
        """Token deduplication (dropless): (unique rows [U, M], counts, recv_counts, plan with
        every chunk's `unique` plan, the call's `Dedup`). Collective: the counts exchange (with
        the unique rows per chunk and destination; the call's one host sync), then one
        all-to-all of every expanded row's unique row and weight (the expanded rows' splits)."""
        P, El, r, rank = self.topology.world, self.num_local, self.chunks, self.topology.rank
        # 1. Where each choice's row goes among the unique rows, on the device.
        lay = unique_layout(routing, P, rank, r, self.partition)
        # 2. The counts exchange, each rank's row: its expert rows, then its unique rows per
        # chunk, for that rank ([P, El + r]); the call's one host sync reads it.
        table = torch.cat([routing.counts_E.view(P, El), lay.counts_Q.view(r, P).t()], 1)
        sent, got = self._start_table(table)()
        counts = tuple(c for row in sent for c in row[:El])
        recv_counts = tuple(tuple(row[:El]) for row in got)
        usend = [[sent[d][El + i] for d in range(P)] for i in range(r)]
        urecv = [[got[s][El + i] for s in range(P)] for i in range(r)]
        device = x_TM.device
        plan = build_plan(counts, recv_counts, rank, r, self.partition, device)
        # 3. Every expanded row's unique row (within its chunk and destination) and combine
        # weight, to the destination along the expanded rows' layout, as one float64 tensor
        # (exact for both); the sizes are known now: no host sync.
        T, k = routing.slot_TK.shape
        choice_N = torch.empty_like(routing.slot_TK.view(-1))
        choice_N[routing.slot_TK.view(-1)] = torch.arange(T * k, device=choice_N.device)
        w_N = routing.weight_TK.reshape(-1).index_select(0, choice_N)  # differentiable
        pack = torch.stack([lay.uloc_N.double(), w_N.detach().double()], 1)
        call = Dedup(
            lay,
            w_N,
            tuple(sum(counts[d * El : (d + 1) * El]) for d in range(P)),
            tuple(sum(row) for row in recv_counts),
            self.group,
        )
        got_R = call.exchange(pack)
        uloc_R, w_R = got_R[:, 0].long(), got_R[:, 1].float()
        lo, out = 0, []
        for i, ch in enumerate(plan):
            expand, rows = receive(uloc_R, recv_counts, urecv, i, r, rank, self.partition, ch.perm)
            hi = lo + sum(usend[i])
            u = Unique(lo, hi, tuple(usend[i]), tuple(urecv[i]), expand, rows, w_R[rows])
            out.append(replace(ch, unique=u))
            lo = hi
        call = replace(call, token_U=lay.token_of(lo))
        # 4. The unique rows themselves (differentiable in x).
        return encode_unique(x_TM, call.token_U), counts, recv_counts, tuple(out), call

    def dispatch(
        self, x_TM: torch.Tensor, routing: Routing, *, dropless: bool = False
    ) -> tuple[torch.Tensor, DispatchMeta]:
        """Tokens into this rank's dispatch buffer rows [N, M] (with `dedup`, its unique rows
        [U, M]), and the metadata of the call.

        Collective over the group unless the splits follow from the config (see the module
        docstring): every rank must call it."""
        if self.dedup:
            rows_UM, counts, recv, plan, call = self.dispatch_unique(x_TM, routing)
            routing = replace(routing, counts=counts)
            return rows_UM, DispatchMeta(routing, x_TM.dtype, counts, recv, plan, call)
        # 1. Start learning what every rank sends to this rank's experts.
        exchange = self.start_counts(routing.counts, routing.counts_E, dropless)
        # 2. Scatter the tokens into the expert-major buffer meanwhile (N known without a read).
        rows_NM = encode(x_TM, routing)
        # 3. Read the split sizes; cut the buffer into the region's chunks.
        counts, recv, plan = self.plan_chunks(exchange, x_TM.device)
        routing = replace(routing, counts=counts)
        return rows_NM, DispatchMeta(routing, x_TM.dtype, counts, recv, plan)

    def combine(self, rows_NM: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """The expert outputs back in token order, each token's k outputs weighted and summed
        (fp32 accumulation), as the input's dtype: y [T, M]. With dedup, rows_NM are the unique
        rows [U, M], each its receiver's weighted sum: each token's summed."""
        if meta.dedup is not None:
            return meta.dedup.combine(rows_NM, meta.dtype)
        return decode(rows_NM, meta.routing, meta.dtype)
