"""The executor really overlaps: compute of chunk i runs while chunk i+1's transfer is pending."""

from __future__ import annotations

import json
import time

import pytest
import torch

from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig, trace
from schemoe.collectives import ALGORITHMS
from schemoe.collectives.naive import Naive

DELAY = 0.1  # seconds per transfer: far longer than one chunk's compute here


class _SlowPending:
    def __init__(self, inner, done_at: float) -> None:
        self.inner, self.done_at = inner, done_at

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self):
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return self.inner.wait()


class SlowLink(Naive):
    """naive over a FIFO link that needs DELAY seconds per transfer."""

    name = "test_slow_link"

    def __init__(self, topology) -> None:
        super().__init__(topology)
        self.free_at = 0.0

    def start(self, x, send_splits, recv_splits, *, link=None, out=None):
        self.free_at = max(time.perf_counter(), self.free_at) + DELAY
        return _SlowPending(super().start(x, send_splits, recv_splits), self.free_at)


def _layer(policy: str, r: int) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(
        MoEConfig(
            gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0),
            experts=ExpertConfig(model_dim=16, hidden_dim=32),
            schedule=ScheduleConfig(policy=policy, chunks=r),
            collective=__import__("schemoe").CollectiveConfig(algorithm="test_slow_link"),
        )
    )


def _events(policy: str, r: int):
    layer = _layer(policy, r)
    x = torch.randn(64, 16, requires_grad=True)
    with trace.record() as tl:
        y, aux = layer(x)
        (y.sum() + aux).backward()
    return {(e.direction, e.task): e for e in tl.events}, tl


@pytest.fixture(autouse=True)
def slow_link(plugin):
    plugin(ALGORITHMS, "test_slow_link", SlowLink)


def test_expert_of_chunk_i_runs_while_the_transfer_of_chunk_i_plus_1_is_pending():
    # One thread: on a shared 2-core box an OpenMP pool stalls for tens of ms at random; and one
    # warm-up call, since the first autograd.grad of a process costs ~0.3 s of one-time setup.
    torch.set_num_threads(1)
    _events("schemoe", 4)
    ev, _ = _events("schemoe", 4)
    for direction in ("forward", "backward"):
        for i in range(3):
            e, a = ev[(direction, f"E.{i}")], ev[(direction, f"A1.{i + 1}")]
            # E.i starts when A1.i lands; A1.i+1 is then in flight for another DELAY.
            assert a.start < e.start < a.end, (direction, i, e, a)


def test_sequential_never_overlaps_compute_with_a_transfer():
    ev, _ = _events("sequential", 4)
    comm = [e for e in ev.values() if e.task.startswith("A")]
    comp = [e for e in ev.values() if e.task.startswith("E")]
    for c in comp:
        assert not any(a.start < c.start and c.end < a.end for a in comm), c


def test_trace_writes_a_chrome_json_and_a_gantt_png(tmp_path):
    _, tl = _events("schemoe", 2)
    files = tl.save(str(tmp_path / "t"))
    data = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"] for e in data["traceEvents"]}
    assert {"C1.0", "A1.1", "E.1", "D2.1"} <= names
    assert {e["cat"] for e in data["traceEvents"]} == {"forward", "backward"}
    if len(files) == 2:
        assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
