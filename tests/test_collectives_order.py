"""The order the all-to-alls post their point-to-point ops in: every receive before any send.

On gloo a send posted before the peer's receive moves the pair's two directions one after the
other on a shaped link (`schemoe.collectives._common.start_exchange`; measured in
docs/results/recv_first_2026-12-07/). What they move is checked against `naive` and a
single-process reference in test_collectives.py; here, in one process, torch.distributed's
calls are replaced by recorders and the order they were made in is checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from schemoe.collectives import _common
from schemoe.collectives.pairwise import Pairwise
from schemoe.collectives.pipe import Pipe
from schemoe.dist.topology import Topology


class Recorder:
    """Stands in for torch.distributed's point-to-point calls on a group of `size`, as `rank`."""

    def __init__(self, monkeypatch, rank: int, size: int, backend: str = "gloo") -> None:
        self.calls: list[tuple] = []
        monkeypatch.setattr(_common, "backend_name", lambda group=None: backend)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
        monkeypatch.setattr(dist, "get_global_rank", lambda group, q: 10 + q)
        monkeypatch.setattr(dist, "irecv", self._op("irecv"))
        monkeypatch.setattr(dist, "isend", self._op("isend"))
        monkeypatch.setattr(dist, "all_to_all_single", self._a2a)
        monkeypatch.setattr(dist, "batch_isend_irecv", self._batch)
        monkeypatch.setattr(dist, "P2POp", _P2POp)

    def _op(self, kind: str):
        def op(tensor, peer, group=None, tag=0):
            self.calls.append((kind, peer, tensor.data_ptr(), tensor.numel()))
            return "work"

        op.kind = kind
        return op

    def _a2a(self, out, x, recv, send, group=None, async_op=False):
        self.calls.append(("all_to_all_single", tuple(recv), tuple(send)))
        return "work"

    def _batch(self, ops):
        self.calls.append(("batch", [(op.op.kind, op.peer) for op in ops]))
        return []


class _P2POp:
    def __init__(self, op, tensor, peer, group=None, tag=0) -> None:
        self.op, self.tensor, self.peer = op, tensor, peer


def _ptr(t: torch.Tensor, row: int) -> int:
    return t.data_ptr() + row * t.stride(0) * t.element_size()


def test_on_gloo_every_receive_is_posted_before_any_send(monkeypatch):
    rec = Recorder(monkeypatch, rank=1, size=4)
    send, recv = [1, 2, 3, 4], [2, 2, 1, 3]
    x, out = torch.arange(10.0), torch.full((8,), -1.0)
    works = _common.start_exchange(x, send, recv, "group", out)
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["irecv"] * 3 + ["isend"] * 3 and len(works) == 6
    # Receives from me - 1, me - 2, me - 3 (the order their sends go out), into their rows.
    assert [(c[1], c[3]) for c in rec.calls[:3]] == [(10, 2), (13, 3), (12, 1)]
    assert [c[2] for c in rec.calls[:3]] == [_ptr(out, 0), _ptr(out, 5), _ptr(out, 4)]
    # Sends to me + 1, me + 2, me + 3, from their rows of x.
    assert [(c[1], c[3]) for c in rec.calls[3:]] == [(12, 3), (13, 4), (10, 1)]
    assert [c[2] for c in rec.calls[3:]] == [_ptr(x, 3), _ptr(x, 6), _ptr(x, 0)]
    # The rows this rank keeps are copied, nothing else of out is touched.
    assert out[2:4].tolist() == [1.0, 2.0] and (out[:2] == -1).all() and (out[4:] == -1).all()


def test_off_gloo_the_exchange_is_one_all_to_all_single(monkeypatch):
    rec = Recorder(monkeypatch, rank=0, size=2, backend="nccl")
    works = _common.start_exchange(torch.zeros(3), [1, 2], [1, 1], "group", torch.zeros(2))
    assert rec.calls == [("all_to_all_single", (1, 1), (1, 2))] and works == ["work"]


def test_blocking_exchange_waits_on_the_receives_first_ops(monkeypatch):
    Recorder(monkeypatch, rank=0, size=2)
    waited = []
    for name, kind in (("irecv", "recv"), ("isend", "send")):
        monkeypatch.setattr(dist, name, lambda t, peer, group=None, k=kind: _W(waited, k))
    _common.exchange(torch.zeros(2), [1, 1], [1, 1], "group", 2)
    assert waited == ["recv", "send", "wait", "wait"]


class _W:
    def __init__(self, log: list, kind: str) -> None:
        self.log = log
        log.append(kind)

    def wait(self) -> None:
        self.log.append("wait")


@pytest.mark.parametrize("rank", [0, 3])
def test_pipe_posts_its_network_receives_before_its_sends(monkeypatch, rank):
    rec = Recorder(monkeypatch, rank=rank, size=4)
    pipe = Pipe.__new__(Pipe)
    pipe.topo, pipe.world_group = Topology(world=4, rank=rank, ranks_per_node=2), "inter"
    splits = [1, 1, 1, 1]
    pipe._inter(torch.zeros(4), splits, splits, torch.zeros(4))
    (batch,) = [c[1] for c in rec.calls if c[0] == "batch"]
    remote = [2, 3] if rank < 2 else [0, 1]
    assert batch == [("irecv", q) for q in remote] + [("isend", q) for q in remote]


def test_pairwise_posts_each_steps_receive_before_its_send(monkeypatch):
    rec = Recorder(monkeypatch, rank=1, size=4)
    pw = Pairwise.__new__(Pairwise)
    pw.topo, pw.group = Topology(world=4, rank=1, ranks_per_node=1), "pairwise"
    splits = [1, 1, 1, 1]
    pw._run(torch.zeros(4), splits, splits, torch.zeros(4))
    batches = [c[1] for c in rec.calls if c[0] == "batch"]
    # Step s receives from rank 1 - s and sends to rank 1 + s (no group: global ranks).
    assert batches == [
        [("irecv", 0), ("isend", 2)],
        [("irecv", 3), ("isend", 3)],
        [("irecv", 2), ("isend", 0)],
    ]
