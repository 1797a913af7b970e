"""Expert x data parallelism on 4 ranks: ep 2 x dp 2 matches the single-process reference for
every algorithm and policy, expert gradients averaged over the replicas by the library, and a
checkpoint written at ep 2 x dp 2 resumes at ep 4 and at ep 1."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_cases import (
    ALGOS,
    POLICIES,
    close,
    global_weights,
    inputs,
    layer_config,
    run_layer,
    run_reference,
)
from schemoe import MoELayer
from schemoe.checkpoint import store as checkpoint
from schemoe.costmodel.hardware import preset
from schemoe.layer.parallel import average_expert_gradients, clip_grad_norm_, init_expert_parallel
from schemoe.tuning.auto import TUNED, AutoTuner


def cfg(policy="schemoe", algorithm="naive", r=2, rpn=1):
    return layer_config(policy, algorithm, chunks=r, rpn=rpn)


def _against_reference(rank, world, policy, algorithm):
    ep = init_expert_parallel(2)
    c = cfg(policy, algorithm, r=2)
    torch.manual_seed(3)
    layer = MoELayer(c, group=ep.ep_group)
    if policy in TUNED:
        AutoTuner(layer, hardware=preset("local"))
    weights = global_weights(layer, seed=3)
    layer.load_global_state(weights)
    tokens = [13 + 7 * q for q in range(world)]  # every rank of the world has its own batch
    xs, gys = inputs(world, tokens, c.experts.model_dim, seed=3)
    y, _, gx, grads = run_layer(layer, xs[rank], gys[rank])
    ry, _, rgx, rgrads = run_reference(weights, c, xs, gys)
    close(y, ry[rank].detach(), f"output rank {rank}")
    close(gx, rgx[rank], f"input grad rank {rank}")
    # The library's averaging: reference gradients are of the summed loss; DDP's are of the
    # mean over the world, so the expert gradient after averaging is reference / world.
    for name, p in layer.named_parameters():
        p.grad = grads[name].clone()
    average_expert_gradients(layer, ep)
    sl = layer.expert_slice()
    for name, p in layer.named_parameters():
        if getattr(p, "schemoe_expert", False):
            close(p.grad * world, rgrads[name][sl], f"expert grad {name} rank {rank}")
        else:
            g = p.grad.clone()
            dist.all_reduce(g)  # what DDP would sum (then average) over the world
            close(g, rgrads[name], f"dense grad {name} rank {rank}")
    return True


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("policy", POLICIES)
def test_ep2_dp2_layer_matches_the_reference_with_averaged_expert_gradients(
    ranks, policy, algorithm
):
    assert all(ranks(4).run(_against_reference, policy, algorithm))


@pytest.mark.parametrize("policy", sorted(TUNED))
def test_ep2_dp2_layer_matches_the_reference_under_tuned_policies(ranks, policy):
    assert all(ranks(4).run(_against_reference, policy, "naive"))


def _replicas_agree(rank, world):
    ep = init_expert_parallel(2)
    torch.manual_seed(5)
    layer = MoELayer(cfg(), group=ep.ep_group)
    x = torch.randn(16 + rank, 12)
    layer(x)[0].square().sum().backward()
    average_expert_gradients(layer, ep)
    g = layer.experts.w1_EMH.grad
    both = [torch.empty_like(g) for _ in range(ep.dp_size)]
    dist.all_gather(both, g, group=ep.dp_group)
    return torch.equal(both[0], both[1]) and (ep.ep_rank, ep.dp_rank) == (rank % 2, rank // 2)


def test_expert_gradients_are_identical_on_the_data_parallel_replicas(ranks):
    assert all(ranks(4).run(_replicas_agree))


class _Model(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 12)
        self.moe = MoELayer(cfg(), group=group, seed=11)

    def forward(self, x):
        y, aux = self.moe(self.inp(x))
        return y.square().mean() + aux


def _save(rank, world, folder):
    ep = init_expert_parallel(2)
    torch.manual_seed(0)
    model = _Model(ep.ep_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(10, 12, generator=torch.Generator().manual_seed(rank))).backward()
    for p in model.parameters():  # dense: what DDP would give
        if not getattr(p, "schemoe_expert", False):
            dist.all_reduce(p.grad)
            p.grad /= world
    average_expert_gradients(model, ep)
    clip_grad_norm_(model, 1.0, ep)
    opt.step()
    checkpoint.save(folder, model, opt, step=1)
    return model.moe.global_state()


def _resume(rank, world, folder, ep_size):
    ep = init_expert_parallel(ep_size)
    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    model = _Model(ep.ep_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = checkpoint.load(folder, model, opt)
    state = model.moe.global_state()
    w1 = model.moe.experts.w1_EMH
    return got.step, state, opt.state[w1]["exp_avg"], model.moe.expert_slice()


@pytest.mark.parametrize("ep_size", [4, 1])
def test_a_checkpoint_saved_at_ep2_dp2_resumes_at_another_ep_size(ranks, tmp_path, ep_size):
    saved = ranks(4).run(_save, str(tmp_path))
    state = saved[0]
    for other in saved[1:]:  # every replica holds the same experts
        for n in state:
            assert torch.equal(other[n], state[n]), n
    # AdamW's exp_avg of every global expert, as written by the ep-2 ranks.
    folder = checkpoint.resolve(tmp_path)
    tensors = checkpoint._tensors(folder, json.loads((folder / "meta.json").read_text()))
    loaded = ranks(4).run(_resume, str(tmp_path), ep_size)
    for step, got, exp_avg, sl in loaded:
        assert step == 1
        for n in state:
            assert torch.equal(got[n], state[n]), n
        rows = [tensors[f"optim/exp_avg/moe.experts.w1_EMH[{e}]"] for e in range(8)][sl]
        assert torch.equal(exp_avg, torch.stack(rows))


def test_init_expert_parallel_rejects_an_ep_size_that_does_not_divide_the_world(ranks):
    assert all(ranks(4).run(_bad_ep_size))


def _bad_ep_size(rank, world):
    for bad, err in ((3, ValueError), (0, ValueError), (2.0, TypeError)):
        try:
            init_expert_parallel(bad)
        except err as e:
            assert str(bad) in str(e)
        else:
            raise AssertionError(f"ep_size={bad!r} accepted")
    return True


def _user_groups(rank, world):
    # Groups the user made, not through init_expert_parallel: their family is learnt (one
    # all_gather_object), and every sub-group of both is created on all four ranks.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(rank)
    for algorithm in ALGOS[1:]:
        layer = MoELayer(cfg("schemoe", algorithm), group=groups[rank // 2])
        y, aux = layer(torch.randn(12, 12, requires_grad=True))
        (y.sum() + aux).backward()
    return True


def test_sub_groups_of_user_made_expert_parallel_groups_are_created_on_every_rank(ranks):
    assert all(ranks(4).run(_user_groups))


def _one_replica_without_gradients(rank, world):
    ep = init_expert_parallel(2)
    torch.manual_seed(5)
    layer = MoELayer(cfg(), group=ep.ep_group)
    if ep.dp_rank == 0:  # the other replica never ran backward: no expert gradient at all
        layer(torch.randn(16, 12))[0].square().sum().backward()
    average_expert_gradients(layer, ep)
    return layer.experts.w1_EMH.grad is not None


def test_a_replica_without_expert_gradients_still_takes_part_in_the_average(ranks):
    assert all(ranks(4).run(_one_replica_without_gradients))
