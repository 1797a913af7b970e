"""The device helpers: control tensors follow the group's declared device, bad devices and
launcher values raise naming the value, and expert parallelism without torch.distributed."""

from __future__ import annotations

import pytest
import torch

from schemoe import init_expert_parallel
from schemoe.dist import devices
from schemoe.dist.topology import launcher_local_rank


def test_without_torch_distributed_the_backend_is_gloo_and_the_device_the_cpu():
    assert devices.backend_name() == "gloo"
    assert devices.comm_device() == torch.device("cpu")
    assert devices.issues_from_worker_thread()


def test_control_tensors_are_made_on_the_declared_device(monkeypatch):
    monkeypatch.setattr(devices, "comm_device", lambda group=None: torch.device("meta"))
    assert devices.control_tensor([1, 2], dtype=torch.int64).device.type == "meta"
    assert devices.control_zeros(3, dtype=torch.float64).device.type == "meta"


def test_on_nccl_no_algorithm_may_use_a_worker_thread(monkeypatch):
    monkeypatch.setattr(devices, "backend_name", lambda group=None: "nccl")
    assert not devices.issues_from_worker_thread()


@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_an_unknown_device_kind_raises_naming_it(kind):
    with pytest.raises(ValueError, match=kind):
        devices.local_device(kind, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_asking_for_cuda_without_cuda_raises_value_error():
    with pytest.raises(ValueError, match="cuda"):
        devices.local_device("cuda", 0)


def test_a_malformed_local_rank_raises_naming_it(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(ValueError, match="two"):
        launcher_local_rank()


def test_local_rank_defaults_without_a_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launcher_local_rank(3) == 3


def test_expert_parallel_without_torch_distributed_is_one_process():
    ep = init_expert_parallel(1)
    assert (ep.ep_size, ep.dp_size, ep.ep_group, ep.dp_group) == (1, 1, None, None)
    with pytest.raises(ValueError, match="ep_size=2"):
        init_expert_parallel(2)
