"""The parts a benchmark bounds a step by: compute alone and network alone, timed in the same run.

Compute is timed one rank at a time (`one_at_a_time`): rank q runs its per-rank work on a
one-rank group while the others wait at a barrier, so the time is not inflated by the other
ranks competing for the host's cores. `compute_bound` turns that into a bound on the step:
with P ranks on K cores a step needs at least compute1 x max(1, P / K), because the P ranks' work
(P x compute1 core-seconds at least: a rank alone may use more than one core, never less than
one) cannot run faster than K cores, nor one rank's faster than it did with the host to itself.
The network part is the step's collectives back to back with their real sizes; the bound of a
row is max(compute, network). Neither part prices what overlapping costs, so a bound is not
always reachable, but no step can beat it beyond noise.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import AllToAll
from ..dist.topology import Topology
from ..layer.parallel import dense_parameters
from ..routing.router import capacity

__all__ = ["algorithm", "compute_bound", "host_cores", "host_ranks", "network", "one_at_a_time"]


def one_at_a_time(fn: Callable[[], None], rank: int, world: int) -> Callable[[], None]:
    """Each rank runs `fn` alone in turn while the others wait; one call times all P turns."""

    def run() -> None:
        for turn in range(world):
            if turn == rank:
                fn()
            dist.barrier()

    return run


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def host_ranks(env, world: int) -> int:
    """How many ranks share this host: every rank on loopback or the testbed (one machine), the
    node's ranks under an outside launcher."""
    return world if env.testbed or not env.launched else env.ranks_per_node


def compute_bound(turns_ms: float, world: int, ranks_on_host: int) -> tuple[float, float]:
    """(compute1, bound) from the median time of one `one_at_a_time` call (all P turns)."""
    compute1 = turns_ms / world
    return compute1, compute1 * max(1.0, ranks_on_host / host_cores())


def algorithm(name: str, ranks_per_node: int) -> AllToAll:
    """The all-to-all `name` on the default group, as a layer of that topology would build it
    (shared with the layers: one per process group)."""
    return collectives.build(name, Topology.from_group(None, ranks_per_node))


def network(args, core, algo, world: int, dtype: torch.dtype, group=None):
    """`schemoe train`'s GPT `core`: its collectives alone, back to back, real sizes: per MoE layer four
    all-to-alls of its dispatch buffer (uniform tokens: no counts exchanged), the dense gradients'
    all-reduce in `dtype`, the loss all-reduce."""
    moes = [b.ffn for b in core.blocks if b.moe]
    gate = moes[0].config.gate
    T = args.batch * args.seq_len
    rows = args.experts * capacity(gate, T)
    per = [rows // world + (d < rows % world) for d in range(world)]
    x = torch.randn(sum(per), args.model_dim)
    dense = sum(p.numel() for p in dense_parameters(core))
    grads = torch.zeros(dense, dtype=dtype)
    loss = torch.zeros(1)

    def run() -> None:
        for _ in moes:  # uniform tokens in capacity mode: no counts exchange
            for _ in range(4):  # dispatch, combine; their gradients in backward
                algo.start(x, per, per).wait()
        dist.all_reduce(grads, group=group)
        dist.all_reduce(loss)

    return run
