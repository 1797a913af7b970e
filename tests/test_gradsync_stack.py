"""Scheduled gradient sync with a micro-chunk stack: each block's dense gradients are all-reduced
as soon as the stack's backward has them (GradSync.ready), and the results are those of the
buckets DDP forms after the stack's backward returns."""

from __future__ import annotations

import pytest
import torch

from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig
from schemoe.layer.parallel import ddp_ignore_experts
from schemoe.step.gradsync import data_parallel
from schemoe.train.model import GPT, GPTConfig


def _grads(rank, world, sync, algorithm, early=True, outside=False, accum=False):
    torch.manual_seed(0)  # the same dense weights on every rank
    moe = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2, capacity_factor=0.0),
        experts=ExpertConfig(model_dim=16, hidden_dim=32),
        schedule=ScheduleConfig(policy="schemoe", chunks=2),
    )
    core = GPT(GPTConfig(seq_len=8, layers=4, heads=2, micro_chunks=2), moe, seed=0)
    ddp, gs = data_parallel(
        ddp_ignore_experts(core),
        sync=sync,
        algorithm=algorithm,
        bucket_mb=0.01,  # several buckets, some of them holding several blocks' weights
        ranks_per_node=2,
    )
    if not early:  # the same sync with the stack's hand-over switched off
        for m in core.modules():
            if isinstance(m, MoELayer):
                m.grad_ready = None
    inside = core.blocks[1].attn.proj.weight  # a weight of the stack's first stage

    def backward(step: int) -> None:
        g = torch.Generator().manual_seed(100 * step + rank)
        logits, aux = ddp(torch.randint(0, 256, (4, 8), generator=g))
        loss = logits.square().mean() + aux
        if outside:  # the weight also used after the stack: its gradient grows afterwards
            loss = loss + 0.01 * (inside * inside).sum()
        loss.backward()

    out = []
    for step in range(2):
        ddp.zero_grad(set_to_none=True)
        if accum:  # --grad-accum: the first micro-batch under no_sync()
            with ddp.no_sync():
                backward(10 + step)
        backward(step)
        out.append({n: p.grad.clone() for n, p in core.named_parameters() if p.grad is not None})
    return out, (gs.early_params, gs.bucket_params) if gs is not None else None


def _equal(a, b, exact: bool) -> None:
    for rank in range(len(a)):
        for step in range(2):
            assert a[rank][0][step].keys() == b[rank][0][step].keys()
            for name, g in b[rank][0][step].items():
                got = a[rank][0][step][name]
                if exact:
                    assert torch.equal(got, g), (rank, step, name)
                else:  # another summation order than DDP's ring: a few ulps
                    torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("outside,accum", [(False, False), (True, False), (False, True)])
def test_early_blocks_give_the_buckets_gradients(ranks, outside, accum):
    """hier sums two addends per phase (exact in any layout), so handing blocks over early must
    give bitwise the gradients of the same sync without it; the DDP run checks both."""
    early = ranks(4).run(_grads, "scheduled", "hier", True, outside, accum)
    late = ranks(4).run(_grads, "scheduled", "hier", False, outside, accum)
    ddp = ranks(4).run(_grads, "ddp", "flat", True, outside, accum)
    _equal(early, late, exact=True)
    _equal(early, ddp, exact=False)
    plain = ranks(4).run(_grads, "scheduled", "hier") if outside else early
    for rank in range(4):
        used, bucketed = early[rank][1]
        assert used > 0, "no bucket was served from the stack's early all-reduces"
        assert late[rank][1][0] == 0  # switched off: every bucket went the usual way
        if outside:  # the grown weight's bucket is reduced from DDP's gradients instead
            assert bucketed > plain[rank][1][1] and used < plain[rank][1][0]


def test_early_flat_sync_matches_ddp(ranks):
    got = ranks(4).run(_grads, "scheduled", "flat")
    want = ranks(4).run(_grads, "ddp", "flat")
    _equal(got, want, exact=False)
    assert all(r[1][0] > 0 for r in got)


def _hand_over_order(rank, world):
    torch.manual_seed(0)
    moe = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2, capacity_factor=0.0),
        experts=ExpertConfig(model_dim=16, hidden_dim=32),
        schedule=ScheduleConfig(policy="schemoe", chunks=2),
    )
    core = GPT(GPTConfig(seq_len=8, layers=4, heads=2, micro_chunks=2), moe, seed=0)
    names = {id(p): n for n, p in core.named_parameters()}
    events = []
    for m in core.modules():
        if isinstance(m, MoELayer):
            m.grad_ready = lambda ps, gs: events.extend(f"ready {names[id(p)]}" for p in ps)

    # Block 0's attention backward starts when its output's gradient exists: a tensor hook.
    def mark(mod, args, out):
        out.register_hook(lambda g: events.append("attn0 backward"))

    core.blocks[0].attn.register_forward_hook(mark)
    logits, aux = core(torch.randint(0, 256, (4, 8)))
    (logits.square().mean() + aux).backward()
    return events


def test_the_last_stage_hands_each_weight_over_as_soon_as_it_is_final(ranks):
    """Block 1's attention weights are final once the last micro-chunk's AT backward has passed
    them, before it reaches block 0's attention: they go to the sync then, not when the call
    returns (the step's last compute); block 0's weights after their backward."""
    for events in ranks(2).run(_hand_over_order):
        last_attn0 = max(i for i, e in enumerate(events) if e == "attn0 backward")
        assert events.count("attn0 backward") == 2  # one per micro-chunk
        assert events.index("ready blocks.1.attn.qkv.weight") < last_attn0
        assert events.index("ready blocks.0.attn.qkv.weight") > last_attn0
        dense = {e for e in events if e.startswith("ready ")}
        assert "ready blocks.3.attn.proj.weight" in dense and len(dense) == len(events) - 2
