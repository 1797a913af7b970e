"""The blocks of `schemoe train`'s GPT as a stack over m micro-chunks, priced: what the stack
runtime (schemoe/stack.py) runs, simulated with the same rules as a region.

    predict_stack(hw, StepShape(...), "schemoe", chunks=2, micro=4, stack_policy="wavefront")
        -> StackPrediction(forward_s, backward_s, events)
    choose_micro(hw, StepShape(...), "schemoe", chunks=2) -> (best m, {m: StackPrediction})

Costs of one micro-chunk (B / m sequences, T / m tokens):
  * AT (a stage's pre): the dense blocks before its MoE block and that block's attention half
    (`step.block_forward`: attention 2 T M 3M + 2 T M M + 4 T L M FLOPs, norms and residuals as
    memory traffic), backward twice that, plus a quarter of the layer's `CostModel.outside`
    each way (outside is a whole call's router, layout and fixed cost, forward and backward:
    a quarter in each of AT and PO, forward and backward, so a micro-chunk pays it once per
    layer, as `step.predict_step` charges a layer call);
  * the region's tasks: `CostModel.task_costs` of the layer at T / m tokens (capacity per
    micro-chunk, as the runtime), under the layer policy's own order;
  * PO: a quarter of `outside` each way, plus any dense blocks after the last MoE block.
  * with `grad_sync=True`, each stage's dense weights' all-reduce (`step.allreduce_time` of 4
    bytes per weight x `grad_ratio`, by `grad_algorithm`), stages together until
    `grad_group_bytes` (`early_groups`; 0: every stage alone), as transfers of about
    `grad_group_bytes` ("AR" tasks on the last link, after the stage's AT backward of every
    micro-chunk): what the scheduled sync sends as soon as a block's gradients are final
    (gradsync.GradSync.ready). The runtime hands them over a weight at a time, so piece i of n
    is posted (n - 1 - i) / n of the last AT backward before its end (the simulator's `lead`:
    the weights taken as final evenly through it). The pieces go beside the all-to-alls,
    sharing the link's rate with them while both are in flight: the stack does not hold
    buckets back while its all-to-alls are in flight, as a region does, and buckets go on
    communicators of their own (the simulator's shared link).
The head, the embedding and the optimizer are outside the stack (`step.predict_step` prices
them). Not modelled beyond the simulator's own list (scheduling/simulator.py): the stack's
Python overhead per task (taken as the executor's per-task overhead), compute slowing down more
when several micro-chunks' transfers are in flight at once than under one (`Hardware.overlap`
is one factor for any number).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..scheduling import (
    POLICIES,
    Direction,
    StackGraph,
    TaskGraph,
    make_schedule,
    make_stack_schedule,
    simulator,
    stack_task_costs,
)
from .hardware import Hardware
from .model import CostModel
from .step import (
    StepPrediction,
    StepShape,
    _buckets,
    allreduce_time,
    block_forward,
    gradient_bytes,
    head_time,
    optimizer_time,
    wire_ratio,
)

__all__ = [
    "StackPrediction",
    "choose_micro",
    "early_groups",
    "predict_stack",
    "predict_stack_step",
    "stage_gradient_bytes",
]


@dataclass(frozen=True)
class StackPrediction:
    forward_s: float
    backward_s: float
    events: list
    network_s: float = 0.0  # its transfers back to back (all-to-alls and buckets)

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s


def _stage_blocks(shape: StepShape) -> tuple[list[list[int]], list[int]]:
    """Per stage, the dense blocks before its MoE block; and the dense blocks after the last."""
    stages, dense = [], []
    for i in range(shape.layers):
        if shape.is_moe(i):
            stages.append(dense)
            dense = []
        else:
            dense.append(i)
    return stages, dense


def stage_gradient_bytes(shape: StepShape) -> list[float]:
    """fp32 bytes of each stage's dense weights (its blocks', the last stage with the dense
    blocks after it): what the stack hands the scheduled sync per block."""
    before, after = _stage_blocks(shape)
    moe_blocks = [i for i in range(shape.layers) if shape.is_moe(i)]
    grads = [
        4.0 * sum(shape.block_dense_params(i) for i in (*b, moe))
        for b, moe in zip(before, moe_blocks)
    ]
    if grads:
        grads[-1] += 4.0 * sum(shape.block_dense_params(i) for i in after)
    return grads


def early_groups(stage_bytes: list[float], group_bytes: float) -> tuple[list, float]:
    """How the scheduled sync sends the stages' gradients (gradsync.GradSync.ready): in backward
    order (last stage first), stages together until they reach `group_bytes`; [(the stage
    that completes the group, its bytes)] and the bytes left over, which go after the stack."""
    groups, acc = [], 0.0
    for b in reversed(range(len(stage_bytes))):
        acc += stage_bytes[b]
        if acc >= group_bytes:
            groups.append((b, acc))
            acc = 0.0
    return groups, acc


def _pieces(groups: list, piece_bytes: float) -> list[tuple[int, float, float]]:
    """Each group of `early_groups` as the sync sends it: transfers of about `piece_bytes`
    (one when 0) as (stage, bytes, lead), the stage's weights final one after another during
    its AT backward, so piece i of n is ready (n - 1 - i) / n of that task before its end."""
    out = []
    for b, nbytes in groups:
        n = max(1, round(nbytes / piece_bytes)) if piece_bytes > 0 else 1
        out += [(b, nbytes / n, (n - 1 - i) / n) for i in range(n)]
    return out


def predict_stack(
    hw: Hardware,
    shape: StepShape,
    policy: str = "schemoe",
    algorithm: str = "naive",
    chunks: int = 1,
    *,
    micro: int = 1,
    stack_policy: str = "wavefront",
    grad_sync: bool = False,
    grad_ratio: float = 1.0,
    grad_algorithm: str = "flat",
    grad_group_bytes: float = 0.0,
) -> StackPrediction:
    """The blocks' forward and backward of `shape` at `micro` micro-chunks (module docstring)."""
    if micro < 1 or shape.batch % micro:
        raise ValueError(f"micro must be >= 1 and divide batch {shape.batch}, got {micro}")
    before, after = _stage_blocks(shape)
    if not before:
        raise ValueError(f"the model has no MoE block (layers={shape.layers}, "
                         f"moe_every={shape.moe_every})")  # fmt: skip
    part = replace(shape, batch=shape.batch // micro)
    cm = CostModel(hw, part.layer(), algorithm, compute_scale=hw.compute_factor)
    partition = POLICIES.get(policy).partition
    dense = block_forward(hw, part, False)
    at = [dense * len(b) + block_forward(hw, part, True) for b in before]
    po = [0.0] * len(before)
    po[-1] += dense * len(after)
    quarter = cm.outside() / 4  # outside: a layer call's forward and backward, both halves
    groups, _ = early_groups(stage_gradient_bytes(shape), grad_group_bytes)
    out, events, t0, link = {}, [], 0.0, 0.0
    for direction in Direction:
        twice = 1.0 if direction == Direction.FORWARD else 2.0
        region = TaskGraph(chunks, cm.links, direction, partition)
        order = list(make_schedule(policy, region, cm).order["compute"])
        sent = groups if grad_sync and direction == Direction.BACKWARD else []
        pieces = _pieces(sent, grad_group_bytes)
        buckets = tuple(b for b, _, _ in pieces)  # the last stage's first
        graph = StackGraph((chunks,) * len(before), micro, cm.links, direction, buckets)
        tc = cm.task_costs(region)
        ar = [allreduce_time(hw, n * grad_ratio, grad_algorithm) for _, n, _ in pieces]
        costs = stack_task_costs(
            graph, [tc.durations] * len(before), at=[twice * a + quarter for a in at],
            po=[twice * p + quarter for p in po], ar=ar,
        )  # fmt: skip
        lead = {graph.bucket(k): f for k, (_, _, f) in enumerate(pieces)}
        costs = simulator.TaskCosts(costs, tc.overhead, tc.overlap, lead)
        sched = make_stack_schedule(stack_policy, graph, [order] * len(before), costs)
        span, ev = simulator.run(sched, graph, costs, origin=t0)
        link += sum(costs.durations[t] for t in graph.tasks if t.is_comm)
        out[direction], t0 = span, t0 + span
        events += ev
    return StackPrediction(out[Direction.FORWARD], out[Direction.BACKWARD], events, link)


def choose_micro(
    hw: Hardware,
    shape: StepShape,
    *plan: Any,
    candidates: tuple[int, ...] = (1, 2, 4, 8),
    **options: Any,
) -> tuple[int, dict[int, StackPrediction]]:
    """The micro-chunk count among `candidates` (those dividing the batch) with the smallest
    predicted blocks' step, and every candidate's prediction. `plan` (policy, algorithm, chunks)
    and `options` (stack_policy, grad_sync, ...) are `predict_stack`'s."""
    preds = {
        m: predict_stack(hw, shape, *plan, micro=m, **options)
        for m in candidates
        if m >= 1 and shape.batch % m == 0
    }
    if not preds:
        raise ValueError(f"no candidate in {candidates} divides batch {shape.batch}")
    return min(preds, key=lambda m: (preds[m].step_s, m)), preds


def predict_stack_step(
    hw: Hardware,
    shape: StepShape,
    policy: str = "schemoe",
    algorithm: str = "naive",
    chunks: int = 1,
    *,
    micro: int,
    stack_policy: str = "wavefront",
    grad_sync: str = "ddp",
    grad_compress: str = "none",
    grad_algorithm: str = "flat",
    bucket_bytes: float = 1 << 20,
) -> StepPrediction:
    """A whole training step with the blocks run as a stack of `micro` micro-chunks: the head
    and optimizer as `step.predict_step` prices them, the blocks by `predict_stack`. Under DDP
    every dense-gradient bucket goes after the stack's backward (the stack is one autograd
    Function: DDP sees all its gradients when it returns); under the scheduled sync each stage's
    gradients go during it (AR tasks in the stack) and only the rest (embedding, head) after."""
    ratio = wire_ratio(grad_compress)
    early = grad_sync == "scheduled"
    st = predict_stack(
        hw, shape, policy, algorithm, chunks, micro=micro, stack_policy=stack_policy,
        grad_sync=early, grad_ratio=ratio, grad_algorithm=grad_algorithm,
        grad_group_bytes=bucket_bytes,
    )  # fmt: skip
    sent = sum(n for _, n in early_groups(stage_gradient_bytes(shape), bucket_bytes)[0])
    after = gradient_bytes(shape) - (sent if early else 0.0)
    buckets = [
        allreduce_time(hw, nbytes * ratio, grad_algorithm)
        for _, nbytes in _buckets([after], bucket_bytes)
    ]
    head = head_time(hw, shape)
    return StepPrediction(
        forward_s=head + hw.step_overhead + st.forward_s,
        backward_s=2 * head + st.backward_s + sum(buckets),
        optimizer_s=optimizer_time(hw, shape),
        network_s=st.network_s + sum(buckets),
    )
