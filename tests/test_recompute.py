"""Activation checkpointing of blocks holding MoE layers (schemoe/layer/recompute.py): gradients
equal the plain run's, forward and backward, on 1 process and 2 gloo ranks; the recomputation
repeats no all-to-all; `schemoe train --activation-checkpointing` has the plain losses; misuse
answered with a clear error."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from schemoe import (
    ExpertConfig,
    GateConfig,
    MoEConfig,
    MoELayer,
    SharedExpertConfig,
    checkpoint_block,
    moe_checkpoint_context,
)
from schemoe.train import loop as T
from train_cases import tiny

E, M, H = 4, 8, 12


def cfg(f: float, shared: bool, **gate) -> MoEConfig:
    extra = {"shared": SharedExpertConfig(num=1, hidden_dim=H)} if shared else {}
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=2, capacity_factor=f, z_loss_weight=1e-3, **gate),
        experts=ExpertConfig(model_dim=M, hidden_dim=H),
        **extra,
    )


class Block(nn.Module):
    """A pre-norm block: a dense mixer (attention's stand-in), then the MoE FFN."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(M), nn.LayerNorm(M)
        self.mix = nn.Linear(M, M)
        self.moe = MoELayer(config)

    def forward(self, x):
        h = x + torch.tanh(self.mix(self.ln1(x)))
        y, aux = self.moe(self.ln2(h))
        return h + y, aux


@contextmanager
def counted_all_to_alls():
    """Counts the all_to_all_single calls (the counts exchange and the region's transfers)."""
    n = [0]
    real = dist.all_to_all_single

    def count(*args, **kwargs):
        n[0] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = count
    try:
        yield n
    finally:
        dist.all_to_all_single = real


def step(config: MoEConfig, wrap, world: int = 1, rank: int = 0, blocks: int = 2):
    """One forward and backward of `blocks` blocks, each run through `wrap(block, x)`. Returns
    (input and parameter gradients, expert load counters, all-to-all calls, region starts)."""
    torch.manual_seed(0)
    model = nn.ModuleList(Block(config) for _ in range(blocks))
    starts = [0]
    for b in model:
        real = b.moe.algorithm.start

        def start(*args, _real=real, **kwargs):
            starts[0] += 1
            return _real(*args, **kwargs)

        b.moe.algorithm.start = start
    torch.manual_seed(1 + rank)
    x = torch.randn(2, 5 + 2 * rank, M, requires_grad=True)  # T differs between ranks
    with counted_all_to_alls() as calls:
        h, aux = x, 0
        for b in model:
            h, a = wrap(b, h)
            aux = aux + a
        (h.square().sum() + aux).backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    loads = [b.moe.expert_load for b in model if b.moe.expert_load is not None]
    return grads, loads, calls[0], starts[0]


def plain(block, x):
    return block(x)


def assert_same(a, b):
    assert len(a) == len(b)
    for n, (u, v) in enumerate(zip(a, b)):
        assert u is not None and v is not None, n
        assert torch.equal(u, v), f"tensor {n}: max |diff| {(u - v).abs().max().item():.3e}"


CASES = {
    "capacity": (1.25, False),
    "capacity-shared": (1.25, True),
    "dropless": (0.0, False),
    "dropless-shared": (0.0, True),
}


def checkpointed(recompute_experts: bool):
    def wrap(block, x):
        return checkpoint_block(block, x, recompute_experts=recompute_experts)

    return wrap


# Both policies on capacity-shared and dropless; the expert recompute (default) on every case.
ONE_PROCESS = [(c, True) for c in CASES] + [("capacity-shared", False), ("dropless", False)]


@pytest.mark.parametrize(
    "case, recompute",
    ONE_PROCESS,
    ids=[f"{c}-{'recompute' if r else 'keep'}-experts" for c, r in ONE_PROCESS],
)
def test_checkpointed_block_gradients_equal_the_plain_ones_bitwise_on_one_process(case, recompute):
    config = cfg(*CASES[case])
    want, _, _, starts = step(config, plain)
    got, _, _, got_starts = step(config, checkpointed(recompute))
    assert_same(got, want)
    assert got_starts == starts > 0  # the recomputation started no transfer


def _ranks_case(rank, world, case):
    config = cfg(*CASES[case])
    want, _, calls, starts = step(config, plain, world, rank)
    out = []
    for recompute in (True, False):
        got, _, got_calls, got_starts = step(config, checkpointed(recompute), world, rank)
        assert_same(got, want)
        out.append((calls, got_calls, starts, got_starts))
    return out


@pytest.mark.parametrize("case", ["capacity-shared", "dropless"])
def test_checkpointed_block_on_two_ranks_matches_and_issues_the_plain_all_to_alls(ranks, case):
    for per_rank in ranks(2).run(_ranks_case, case):
        for calls, got_calls, starts, got_starts in per_rank:
            assert got_calls == calls > 0
            assert got_starts == starts > 0


def test_the_recomputation_counts_no_expert_load_twice():
    config = cfg(1.25, False, bias_update_rate=1e-3)
    _, want, _, _ = step(config, plain)
    _, got, _, _ = step(config, checkpoint_block)
    assert_same(got, want)
    assert all(int(t.sum()) > 0 for t in want)


def test_torch_checkpoint_wrapper_with_the_moe_context_matches_the_plain_block():
    config = cfg(0.0, True)
    want, _, _, starts = step(config, plain)

    def wrapped(block, x):
        return checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=moe_checkpoint_context
        )(x)

    got, _, _, got_starts = step(config, wrapped)
    assert_same(got, want)
    assert got_starts == starts


def test_a_second_backward_with_retain_graph_recomputes_from_the_kept_outputs_again():
    config = cfg(1.25, True)

    def twice(wrap):
        torch.manual_seed(0)
        block = Block(config)
        x = torch.randn(6, M, requires_grad=True)
        y, aux = wrap(block, x)
        loss = y.square().sum() + aux
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad] + [p.grad for p in block.parameters()]

    assert_same(twice(checkpoint_block), twice(plain))


def test_checkpoint_block_refuses_reentrant_checkpointing_and_names_the_alternative():
    block = Block(cfg(1.25, False))
    x = torch.randn(4, M, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        checkpoint_block(block, x, use_reentrant=True)
    with pytest.raises(ValueError, match="torch.utils.checkpoint.checkpoint directly"):
        checkpoint_block(block, x, context_fn=moe_checkpoint_context)


def test_a_recomputation_that_calls_other_moe_layers_than_the_forward_raises():
    config = cfg(1.25, False)
    torch.manual_seed(0)
    first, second = MoELayer(config), MoELayer(config)
    calls = [0]

    def fickle(x):  # calls `first` in the forward, `second` in the recomputation
        calls[0] += 1
        return (first if calls[0] == 1 else second)(x)[0]

    x = torch.randn(4, M, requires_grad=True)
    y = checkpoint_block(fickle, x)
    with pytest.raises(RuntimeError, match="same layers"):
        y.sum().backward()


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute-experts", "keep-experts"])
def test_the_experts_run_again_in_backward_only_when_recomputed(recompute):
    config = cfg(1.25, True)
    torch.manual_seed(0)
    block = Block(config)
    runs = {"experts": 0, "shared": 0}
    block.moe.experts.register_forward_pre_hook(
        lambda *_: runs.__setitem__("experts", 1 + runs["experts"])
    )
    block.moe.shared.register_forward_pre_hook(
        lambda *_: runs.__setitem__("shared", 1 + runs["shared"])
    )
    x = torch.randn(6, M, requires_grad=True)
    y, aux = checkpoint_block(block, x, recompute_experts=recompute)
    forward = dict(runs)
    (y.square().sum() + aux).backward()
    assert forward["experts"] > 0 and forward["shared"] == 1
    assert runs == {k: n * (2 if recompute else 1) for k, n in forward.items()}


def test_a_checkpointed_block_nested_in_another_raises_in_the_recomputation():
    block = Block(cfg(1.25, False))
    x = torch.randn(4, M, requires_grad=True)

    def outer(h):  # needs the inner block's output again in its own recomputation
        y, aux = checkpoint_block(block, h)
        return torch.tanh(y), aux

    y, aux = checkpoint_block(outer, x)
    with pytest.raises(RuntimeError, match="nested inside another is not supported"):
        (y.sum() + aux).backward()


def _train(rank, world, extra):
    return T.train(rank, world, tiny("--steps", "2", *extra))["losses"]


def test_schemoe_train_with_activation_checkpointing_has_the_plain_runs_losses(ranks):
    plain_losses = ranks(2).run(_train, [])
    ckpt_losses = ranks(2).run(_train, ["--activation-checkpointing"])
    assert ckpt_losses == plain_losses and len(plain_losses[0]) == 2


def test_activation_checkpointing_refuses_micro_chunks():
    with pytest.raises(ValueError, match="--activation-checkpointing"):
        tiny("--activation-checkpointing", "--micro-chunks", "2")
