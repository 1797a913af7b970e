"""Every tensor handed to a collective is on its backend's device (no control tensor made on the
default device), through the layer under every policy, clipping, eval, checkpoints and the
profiler; no host sync in a capacity-mode layer call with uniform tokens; on NCCL (the backend
name patched) no collective is issued from a worker thread and the results are unchanged."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from comm_checks import CommCheck, count_host_syncs
from moe_cases import ALGOS, layer_config
from moe_cases import POLICIES as FIXED_POLICIES
from schemoe import MoELayer, ScheduleConfig
from schemoe.checkpoint import store as checkpoint
from schemoe.costmodel.hardware import preset
from schemoe.dist import devices
from schemoe.dist.topology import Topology
from schemoe.layer.parallel import average_expert_gradients, clip_grad_norm_, init_expert_parallel
from schemoe.train.model import GPT, GPTConfig, evaluate
from schemoe.tuning.auto import AutoTuner
from schemoe.tuning.measure import measure

POLICIES = (*FIXED_POLICIES, "auto", "search")


def cfg(policy="schemoe", algorithm="naive", f=0.0, uniform=False, r=2):
    sched = (
        ScheduleConfig(policy="auto", trials=1, shortlist=2)
        if policy == "auto"
        else ScheduleConfig(policy=policy, chunks=r)
    )
    return layer_config(
        algorithm=algorithm,
        capacity_factor=f,
        dims=(16, 24),
        rpn=2,
        uniform=uniform,
        schedule=sched,
    )


def _steps(layer, rank, n=1, tokens=None):
    for i in range(n):
        x = torch.randn(tokens or 20 + 3 * rank, 16, requires_grad=True)
        y, aux = layer(x)
        (y.square().sum() + aux).backward()


def _layer_case(rank, world, policy, algorithm):
    torch.manual_seed(rank)
    layer = MoELayer(cfg(policy, algorithm))
    with CommCheck() as c:
        if policy in ("auto", "search"):
            AutoTuner(layer, hardware=preset("local"))
        _steps(layer, rank, n=8 if policy == "auto" else 1)  # auto: its trials, then decides
    assert c.calls > 0
    return c.bad


@pytest.mark.parametrize("policy", POLICIES)
def test_the_layer_hands_collectives_only_backend_device_tensors_under_every_policy(ranks, policy):
    assert ranks(4).run(_layer_case, policy, "naive") == [[]] * 4


@pytest.mark.parametrize("algorithm", ALGOS[1:])
def test_every_algorithm_hands_collectives_only_backend_device_tensors(ranks, algorithm):
    assert ranks(4).run(_layer_case, "schemoe", algorithm) == [[]] * 4


def _training_case(rank, world, folder):
    ep = init_expert_parallel(2)
    moe = cfg(f=1.0)
    model = GPT(GPTConfig(seq_len=8, layers=2, heads=2), moe, group=ep.ep_group)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 256, (2, 9))
    with CommCheck() as c:
        # A rank whose experts got no gradient still takes part in the norm's all-reduce.
        clip_grad_norm_(model, 1.0, ep)
        logits, aux = model(tokens[:, :-1])
        (logits.square().mean() + aux).backward()
        average_expert_gradients(model, ep)
        clip_grad_norm_(model, 1.0, ep)
        opt.step()
        evaluate(model, tokens, 1)
        checkpoint.save(folder, model, opt, step=1)
        checkpoint.load(folder, model, opt)
    return c.bad


def test_clipping_eval_and_checkpoints_hand_collectives_only_backend_device_tensors(
    ranks, tmp_path
):
    assert ranks(4).run(_training_case, str(tmp_path)) == [[]] * 4


def _profiler_case(rank, world):
    with CommCheck() as c:
        hw, _ = measure(
            Topology.from_group(None, 2), model_dim=16, hidden=32, tokens=32, quick=True
        )
    return c.bad, (hw.overlap, hw.skew)


def test_the_profiler_hands_collectives_only_backend_device_tensors(ranks):
    out = ranks(2).run(_profiler_case)
    assert [bad for bad, _ in out] == [[]] * 2
    assert all(0 <= overlap <= 2 for _, (overlap, _) in out)  # fitted on a schemoe r = 4 step
    assert all(0 <= skew <= 0.05 for _, (_, skew) in out)  # on sequential r = 1 and r = 4


def _bad_case(rank, world):
    with CommCheck() as c:
        dist.all_reduce(torch.tensor([1]))  # the bug class: made on the default device
        dist.all_reduce(devices.control_tensor([1], dtype=torch.int64))
    return c.bad


def test_the_checker_catches_a_control_tensor_made_on_the_default_device(ranks):
    bad = ranks(2).run(_bad_case)
    assert all(len(b) == 1 and "default device" in b[0] for b in bad)


def _host_syncs(rank, world, policy):
    torch.manual_seed(rank)
    layer = MoELayer(cfg(policy, f=1.25, uniform=True))
    x = torch.randn(24, 16, requires_grad=True)
    layer(x)  # warm: the first call builds what later calls reuse
    with count_host_syncs() as counts:
        y, aux = layer(x)
        (y.sum() + aux).backward()
    return counts


@pytest.mark.parametrize("policy", POLICIES[:4])
def test_a_capacity_mode_layer_call_with_uniform_tokens_makes_no_host_sync(ranks, policy):
    assert ranks(2).run(_host_syncs, policy) == [{}] * 2


def _nccl_routing(rank, world, algorithm, patch):
    if patch:  # NCCL's issue rule on CPU tensors: only the backend name says "nccl"
        saved = devices.backend_name, devices.comm_device
        devices.backend_name = lambda group=None: "nccl"
        devices.comm_device = lambda group=None: torch.device("cpu")
    try:
        torch.manual_seed(rank)
        layer = MoELayer(cfg("schemoe", algorithm, f=0.0))
        x = torch.randn(20 + 3 * rank, 16, requires_grad=True)
        with CommCheck() as c:
            y, aux = layer(x)
            (y.square().sum() + aux).backward()
        main = threading.main_thread().name
        return y.detach(), x.grad, c.threads == {main}
    finally:
        if patch:
            devices.backend_name, devices.comm_device = saved


@pytest.mark.parametrize("algorithm", ALGOS)
def test_on_nccl_no_collective_is_issued_from_a_worker_thread(ranks, algorithm):
    on_nccl = ranks(4).run(_nccl_routing, algorithm, True)
    on_gloo = ranks(4).run(_nccl_routing, algorithm, False)
    for (y, gx, main_only), (y0, gx0, _) in zip(on_nccl, on_gloo):
        assert main_only
        assert torch.equal(y, y0) and torch.equal(gx, gx0)
