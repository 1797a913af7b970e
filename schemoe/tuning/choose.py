"""Auto-tuning: choose policy, r, algorithm and compressor by simulation (prediction.py).

    choose(moe_config, tokens_per_rank, topology, hw, accuracy_budget="lossless") -> MoEConfig
    choose_shortlist(..., n=4) -> [MoEConfig]   # what a measured trial settles (autotune.py)

`choose` predicts every candidate (`prediction.predict`): policies sequential, tutel, fastermoe
and schemoe x r in AUTO_CHUNKS = 1, 2, 4, 8 (fastermoe: r <= P) x every registered algorithm
with a cost model but AUTO_SKIPS (pairwise) x every registered compressor the accuracy budget
allows (same one forward and backward):

    lossless  compressors marked lossless (the built-ins: none only)
    fp16      none, fp16, bf16
    lossy     every compressor whose codec cost the hardware record has

then re-simulates each r's best with the `search` policy, and returns the fastest as a
MoEConfig, or the `shortlist` of the n most promising that differ in partition or r. Decisions
are cached per (layer shape, tokens, topology, hardware, budget) and logged on the
"schemoe.costmodel" logger. Deciding for a running layer (profiles, rank 0's decision broadcast,
trials) is `schemoe.tuning.auto`'s.
"""

from __future__ import annotations

import dataclasses
import logging

from ..collectives import ALGORITHMS
from ..compression import COMPRESSORS
from ..config import CollectiveConfig, CompressionConfig, MoEConfig, ScheduleConfig
from ..costmodel.hardware import Hardware
from ..costmodel.model import A2A_MODELS, LayerShape, wire_ratio
from ..costmodel.prediction import Prediction, predict, topology_of
from ..routing.layout import Partition
from ..scheduling import POLICIES

__all__ = [
    "AUTO_CHUNKS",
    "AUTO_SKIPS",
    "BUDGETS",
    "as_config",
    "candidates",
    "choose",
    "choose_shortlist",
    "explore",
    "shortlist",
]

log = logging.getLogger("schemoe.costmodel")

BUDGETS = ("lossless", "fp16", "lossy")
BASE_POLICIES = ("sequential", "tutel", "fastermoe", "schemoe")
_DECISIONS: dict[tuple, list[Prediction]] = {}


def _compressors(hw: Hardware, shape: LayerShape, budget: str) -> list[str]:
    if budget not in BUDGETS:
        raise ValueError(f"accuracy_budget must be one of {BUDGETS}, got {budget!r}")
    names = []
    for name in COMPRESSORS.names():
        lossless = getattr(COMPRESSORS.get(name), "lossless", False)
        if budget == "lossless" and not lossless:
            continue
        if budget == "fp16" and not (lossless or name in ("fp16", "bf16")):
            continue
        try:
            hw.codec(name)
            wire_ratio(name, shape.model_dim, shape.dtype_bytes)
        except (ValueError, ImportError) as e:
            log.info("tune: skipping compressor %s: %s", name, e)
            continue
        names.append(name)
    return names


def candidates(
    hw: Hardware,
    shape: LayerShape,
    budget: str = "lossless",
    policies=BASE_POLICIES,
    max_chunks: int = 8,
    chunk_grid: tuple[int, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> list[tuple]:
    """(policy, algorithm, (fwd, bwd), r) tuples to simulate, r in `chunk_grid` (default every
    r in 1..max_chunks), every registered algorithm with a cost model but those in `skip`."""
    algos = [a for a in ALGORITHMS.names() if a in A2A_MODELS and a not in skip]
    skipped = sorted(set(ALGORITHMS.names()) - set(algos))
    if skipped:
        log.info("tune: no cost model for algorithms %s; not considered", skipped)
    out = []
    for pol in policies:
        peers = POLICIES.get(pol).partition == Partition.PEERS
        for r in chunk_grid or range(1, max_chunks + 1):
            if peers and r > hw.world:
                continue
            for algo in algos:
                for comp in _compressors(hw, shape, budget):
                    out.append((pol, algo, (comp, comp), r))
    return out


def explore(
    hw: Hardware,
    shape: LayerShape,
    budget: str = "lossless",
    refine: bool = True,
    max_chunks: int = 8,
    chunk_grid: tuple[int, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> list[Prediction]:
    """Every candidate's prediction, fastest first. With `refine`, each r's fastest capacity-
    partition candidate is re-simulated under the search policy (added as policy "search")."""
    cands = candidates(hw, shape, budget, max_chunks=max_chunks, chunk_grid=chunk_grid, skip=skip)
    preds = [predict(hw, shape, *c) for c in cands]
    preds.sort(key=lambda p: p.step_s)
    if refine:
        best_per_r: dict[int, Prediction] = {}
        for p in preds:
            if POLICIES.get(p.policy).partition == Partition.CAPACITY:
                best_per_r.setdefault(p.chunks, p)
        preds += [
            predict(hw, shape, "search", p.algorithm, p.compressors, r)
            for r, p in sorted(best_per_r.items())
        ]
        preds.sort(key=lambda p: p.step_s)
    return preds


AUTO_CHUNKS = (1, 2, 4, 8)
# Algorithms auto leaves out. pairwise is the serialising baseline: P - 1 blocking steps of one
# flow per pair, which a profile fitted with every flow in flight cannot price (docs/costmodel.md:
# predicted far too fast, and measured slower than naive).
AUTO_SKIPS = ("pairwise",)


# Near-ties (within TIE) inside one (partition, r) go to the policy earlier here: ScheMoE's order
# is the optimal one (Theorem 1) and Tutel's a fixed special case, so where the model prices them
# the same (link-bound steps) the real schemoe is the safer pick (docs/costmodel.md has the
# measured pairs).
PREFERENCE = ("schemoe", "tutel", "fastermoe", "sequential")
TIE = 1.005


def shortlist(preds: list[Prediction], n: int) -> list[Prediction]:
    """The n most promising of `preds` (fastest first) that differ in what the model predicts
    least reliably: one candidate per (partition, r), fastest first.

    Within one (partition, r) the candidates differ in task order, algorithm or compressor,
    which the simulator ranks well; across r and partitions its errors (per-chunk costs, uneven
    peer groups, CPU contention) are of the size of the differences, so those are what a
    measured trial should settle. A group's candidate is its fastest fixed policy, near-ties
    (within TIE) broken by PREFERENCE; a `search` order replaces it only where it is predicted
    faster by more than TIE (it needs the cost model at run time)."""
    groups: dict[tuple, list[Prediction]] = {}
    for p in sorted(preds, key=lambda p: p.step_s):
        groups.setdefault((POLICIES.get(p.policy).partition, p.chunks), []).append(p)
    picked = []
    for group in groups.values():
        fixed = [p for p in group if p.policy != "search"] or group
        near = [p for p in fixed if p.step_s <= TIE * fixed[0].step_s]
        # At r = 1 every policy of a partition runs the same single chain: the plainest name.
        order = PREFERENCE if group[0].chunks > 1 else PREFERENCE[::-1]
        rank = {pol: i for i, pol in enumerate(order)}
        best = min(near, key=lambda p: rank.get(p.policy, len(rank)))
        searched = [p for p in group if p.policy == "search" and p.step_s * TIE < best.step_s]
        picked.append(searched[0] if searched else best)
    return sorted(picked, key=lambda p: p.step_s)[:n]


def as_config(moe_config: MoEConfig, p: Prediction) -> MoEConfig:
    """`moe_config` running prediction `p`'s policy, r, algorithm and compressors (gate, experts,
    parallel layout, shared experts and compressor options kept)."""
    return dataclasses.replace(
        moe_config,
        schedule=ScheduleConfig(policy=p.policy, chunks=p.chunks),
        collective=CollectiveConfig(algorithm=p.algorithm),
        compression=CompressionConfig(
            forward=p.compressors[0],
            backward=p.compressors[1],
            options=moe_config.compression.options,
        ),
    )


def choose(
    moe_config: MoEConfig,
    tokens_per_rank: int,
    topology,
    costs: Hardware,
    accuracy_budget: str = "lossless",
) -> MoEConfig:
    """The fastest simulated configuration of `moe_config`'s layer (gate and expert settings
    kept) on `costs` with `topology` ((nodes, ranks_per_node) or a Topology), within the budget,
    over r in AUTO_CHUNKS."""
    return choose_shortlist(moe_config, tokens_per_rank, topology, costs, accuracy_budget, 1)[0]


def choose_shortlist(
    moe_config: MoEConfig,
    tokens_per_rank: int,
    topology,
    costs: Hardware,
    accuracy_budget: str = "lossless",
    n: int = 4,
) -> list[MoEConfig]:
    """The `shortlist` of up to n configurations (fastest predicted first) for `choose`'s
    question; what a measured trial settles. Cached per layer shape; each decision is logged."""
    nodes, rpn = topology_of(topology)
    hw = costs.with_topology(nodes, rpn)
    shape = LayerShape.of(moe_config, tokens_per_rank)
    key = (shape, nodes, rpn, hw.dumps(), accuracy_budget, n)
    if key not in _DECISIONS:
        preds = explore(hw, shape, accuracy_budget, chunk_grid=AUTO_CHUNKS, skip=AUTO_SKIPS)
        picks = shortlist(preds, n)
        seq = next(p for p in preds if p.policy == "sequential" and p.chunks == 1)
        log.info(
            "tune: %s on %dx%d %s (%s): chose %s (r=1 sequential %s %.3f ms) out of %d candidates",
            shape,
            nodes,
            rpn,
            hw.name,
            accuracy_budget,
            [p.row() for p in picks],
            seq.algorithm,
            seq.step_s * 1e3,
            len(preds),
        )
        _DECISIONS[key] = picks
    # Built per call: the cached picks go on this layer's own config (two layers of one shape may
    # differ in what the shape leaves out, e.g. the shared experts' placement, the router noise).
    return [as_config(moe_config, p) for p in _DECISIONS[key]]
