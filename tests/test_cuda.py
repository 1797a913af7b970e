"""GPU checks (`pytest -m cuda`; skipped without CUDA; run by scripts/device_check.sh):

- every policy x algorithm x compressor on one GPU (world 1) against the CPU reference;
- several processes on gloo with CUDA tensors (one GPU shared) for the algorithms whose
  collectives gloo supports on CUDA (all_to_all_single, all_gather: naive, hier2d, leader;
  gloo has no CUDA point-to-point, which pairwise and pipe use);
- the NCCL issue path (calling thread, side stream, events) with CUDA tensors, the backend name
  patched so gloo carries the bytes;
- a capacity-mode call with uniform tokens under torch.cuda.set_sync_debug_mode("error");
- token deduplication on one GPU and on two gloo ranks with CUDA tensors against the reference,
  and its one host sync per call (the counts read);
- on two or more GPUs (NCCL), a CUDA-event trace in which an all-to-all kernel overlaps an
  expert kernel (skipped on one GPU: NCCL cannot put two ranks on one device).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from moe_cases import (
    ALGOS,
    POLICIES,
    close,
    global_weights,
    inputs,
    layer_config,
    run_reference,
    step_without_host_sync,
)
from schemoe import (
    ExpertConfig,
    MoEConfig,
    MoELayer,
    compression,
)
from schemoe.dist import devices
from schemoe.dist.launch import spawn
from schemoe.experts.ffn import BatchedFFN

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

COMPRESSORS = tuple(n for n in compression.COMPRESSORS.names() if n != "zfp")
# Relative error budget per compressor (as tests/test_layer_compression.py), "none": fp32 parity.
BUDGET = {"none": 0.0, "fp16": 2e-3, "bf16": 1.5e-2, "fp8": 0.15, "int8": 0.06}


def cfg(policy="schemoe", algorithm="naive", comp="none", f=1.0, uniform=False, rpn=1):
    return layer_config(
        policy,
        algorithm,
        capacity_factor=f,
        dims=(16, 32),
        rpn=rpn,
        uniform=uniform,
        compression=comp,
    )


def _rel(a, b):
    return float((a.cpu() - b).norm() / b.norm().clamp_min(1e-12))


def _on_gpu(c: MoEConfig, rank: int, world: int, device: torch.device, budget: float):
    torch.manual_seed(2)
    layer = MoELayer(c)
    weights = global_weights(layer, seed=2)
    layer.load_global_state(weights)
    layer.to(device)
    xs, gys = inputs(world, [24] * world, 16, seed=2)
    x = xs[rank].to(device).requires_grad_(True)
    y, aux = layer(x)
    ((y * gys[rank].to(device)).sum() + aux).backward()
    ry, _, rgx, rgrads = run_reference(weights, c, xs, gys)
    sl = layer.expert_slice()
    experts = [(n, p.grad, rgrads[n][sl]) for n, p in layer.named_parameters() if "experts" in n]
    if budget == 0.0:
        close(y.detach().cpu(), ry[rank].detach(), "output")
        close(x.grad.cpu(), rgx[rank], "input grad")
        for n, g, want in experts:
            close(g.cpu(), want, f"grad {n}")
    else:
        assert _rel(y.detach(), ry[rank].detach()) < budget
        assert _rel(x.grad, rgx[rank]) < budget
        for _, g, want in experts:
            assert _rel(g, want) < budget
    return True


@pytest.mark.parametrize("comp", COMPRESSORS)
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_algorithm_and_compressor_matches_the_reference_on_one_gpu(
    policy, algorithm, comp
):
    assert _on_gpu(cfg(policy, algorithm, comp), 0, 1, torch.device("cuda"), BUDGET[comp])


def _gloo_cuda(rank, world, policy, algorithm):
    return _on_gpu(cfg(policy, algorithm, rpn=1), rank, world, torch.device("cuda", 0), 0.0)


@pytest.mark.parametrize("algorithm", ("naive", "hier2d", "leader"))
@pytest.mark.parametrize("policy", POLICIES)
def test_two_gloo_ranks_with_cuda_tensors_match_the_reference(ranks, policy, algorithm):
    assert all(ranks(2).run(_gloo_cuda, policy, algorithm))


def _side_streams(rank, world, algorithm):
    # NCCL's path (phases enqueued from the calling thread on a side stream, ordered by CUDA
    # events) on one GPU: only the backend name says "nccl", the transport stays gloo.
    saved = devices.backend_name, devices.comm_device
    devices.backend_name = lambda group=None: "nccl"
    devices.comm_device = lambda group=None: torch.device("cpu")
    try:
        return _gloo_cuda(rank, world, "schemoe", algorithm)
    finally:
        devices.backend_name, devices.comm_device = saved


@pytest.mark.parametrize("algorithm", ("hier2d", "leader"))
def test_the_calling_thread_side_stream_path_matches_the_reference(ranks, algorithm):
    assert all(ranks(2).run(_side_streams, algorithm))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_capacity_mode_call_with_uniform_tokens_makes_no_host_sync_on_cuda(policy):
    layer = MoELayer(cfg(policy, uniform=True, f=1.25)).cuda()
    x = torch.randn(32, 16, device="cuda", requires_grad=True)
    layer(x)  # warm
    step_without_host_sync(layer, x)


def _dedup(policy: str) -> MoEConfig:
    c = cfg(policy, f=0.0)
    return dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, dedup=True))


@pytest.mark.parametrize("policy", POLICIES)
def test_token_deduplication_matches_the_reference_on_one_gpu(policy):
    assert _on_gpu(_dedup(policy), 0, 1, torch.device("cuda"), 0.0)


def _gloo_cuda_dedup(rank, world, policy):
    return _on_gpu(_dedup(policy), rank, world, torch.device("cuda", 0), 0.0)


@pytest.mark.parametrize("policy", ("sequential", "schemoe", "fastermoe"))
def test_token_deduplication_on_two_gloo_ranks_with_cuda_tensors(ranks, policy):
    assert all(ranks(2).run(_gloo_cuda_dedup, policy))


def test_a_dedup_call_reads_the_device_once_on_cuda():
    """Dropless with dedup: the counts read is the call's one host sync, forward and backward."""
    layer = MoELayer(_dedup("schemoe")).cuda()
    x = torch.randn(32, 16, device="cuda", requires_grad=True)
    layer(x)[0].sum().backward()  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            y, aux = layer(x)
            (y.sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def _trace_overlap(rank, world):
    torch.cuda.set_device(rank)
    c = layer_config(
        chunks=4, experts=2 * world, capacity_factor=1.25, dims=(1024, 4096), uniform=True
    )
    layer = MoELayer(c).cuda()
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    for _ in range(2):
        layer(x)[0].sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x)[0].sum().backward()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    comp = [(e.time_range.start, e.time_range.end) for e in kernels if "gemm" in e.name.lower()]
    return any(a0 < b1 and b0 < a1 for a0, a1 in comm for b0, b1 in comp)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_all_to_all_kernels_overlap_expert_kernels_in_a_cuda_event_trace():
    assert any(spawn(_trace_overlap, 2, backend="nccl", timeout=300.0))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_the_gpus_one_bmm_path_gives_the_cpus_per_expert_gemms(activation):
    cfg = ExpertConfig(model_dim=16, hidden_dim=32, activation=activation, bias=True)
    cpu = BatchedFFN(cfg, num_local=3, first_expert=0, seed=5)
    gpu = BatchedFFN(cfg, num_local=3, first_expert=0, seed=5).cuda()
    x = torch.randn(3 * 7, 16)
    xg = x.cuda().requires_grad_(True)
    x.requires_grad_(True)
    y, yg = cpu(x, [7, 7, 7]), gpu(xg, [7, 7, 7])  # equal counts: bmm on the GPU only
    torch.testing.assert_close(yg.cpu(), y, rtol=1e-4, atol=1e-5)
    y.sum().backward()
    yg.sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gpu.w1_EMH.grad.cpu(), cpu.w1_EMH.grad, rtol=1e-4, atol=1e-4)
