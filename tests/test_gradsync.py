"""Scheduled gradient sync: the background queue's rule, and DDP's gradients reproduced."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from schemoe import CollectiveConfig, ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig
from schemoe.collectives import ALGORITHMS, Done
from schemoe.dist.launch import spawn
from schemoe.layer.parallel import ddp_ignore_experts, expert_parameters
from schemoe.scheduling.background import Background
from schemoe.step.gradsync import data_parallel
from schemoe.step.stack import Stage, run_stack


class _Fake:
    """A transfer that completes when the test says so."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.done = log, name, False
        log.append(f"post {name}")

    def is_completed(self) -> bool:
        return self.done

    def wait(self):
        self.done = True
        return self.name


def test_background_transfers_wait_while_an_all_to_all_is_in_flight():
    log, made = [], {}
    bg = Background(window=1)

    def start(name):
        def go():
            made[name] = _Fake(log, name)
            return made[name]

        return go

    bg.busy = 1  # a region's all-to-all is on the wire
    bg.submit(start("b0"), lambda r: log.append(f"done {r}"))
    bg.submit(start("b1"), lambda r: log.append(f"done {r}"))
    assert log == [] and len(bg) == 2
    bg.busy = 0
    bg.pump()
    assert log == ["post b0"]  # window 1: b1 waits for b0
    bg.pump()
    assert log == ["post b0"]
    made["b0"].done = True
    bg.pump()
    assert log == ["post b0", "done b0", "post b1"]
    bg.flush()
    assert log[-1] == "done b1" and len(bg) == 0


def test_background_flush_posts_everything_in_order_even_while_busy():
    log = []
    bg = Background(window=2)
    bg.busy = 3
    for name in ("b0", "b1", "b2"):
        bg.submit(lambda name=name: _Fake(log, name), lambda r: log.append(f"done {r}"))
    bg.flush()
    assert log == ["post b0", "post b1", "post b2", "done b0", "done b1", "done b2"]


@pytest.mark.parametrize("window", [0, -1, 1.5, True])
def test_background_window_must_be_a_positive_int(window):
    with pytest.raises(ValueError, match="window"):
        Background(window)


class _SlowLink:
    """naive on one rank, each transfer taking 20 ms (records when it was in flight)."""

    name, links = "test_slow_a2a", ("net",)

    def __init__(self, topology) -> None:
        self.spans: list[tuple[float, float]] = []

    def start(self, x, send_splits, recv_splits, *, link=None, out=None):
        t0 = time.perf_counter()
        self.spans.append((t0, t0 + 0.02))
        return _Timed(x.clone(), t0 + 0.02)


class _Timed(Done):
    def __init__(self, t, until: float) -> None:
        super().__init__(t)
        self.until = until

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.until

    def wait(self):
        time.sleep(max(0.0, self.until - time.perf_counter()))
        return super().wait()


def _slow_config(chunks: int) -> MoEConfig:
    return MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0),
        experts=ExpertConfig(model_dim=16, hidden_dim=64),
        schedule=ScheduleConfig(policy="schemoe", chunks=chunks),
        collective=CollectiveConfig(algorithm="test_slow_a2a"),
    )


def _queued_posts(bg: Background, n: int) -> list[float]:
    """n background transfers of 1 ms queued while "an all-to-all" runs; when each was posted."""
    posts: list[float] = []

    def start():
        posts.append(time.perf_counter())
        return _Timed(torch.zeros(1), time.perf_counter() + 0.001)

    bg.busy = 1  # queued while "an all-to-all" runs: the schedule's executor posts them
    for _ in range(n):
        bg.submit(start, lambda r: None)
    bg.busy = 0
    return posts


def _posted_only_outside(bg, posts, n, spans, transfers) -> None:
    assert len(posts) >= 2 and bg.busy == 0  # the schedule found idle time for some
    bg.flush()
    assert len(posts) == n and len(spans) == transfers
    inside = [p for p in posts if any(a < p < b for a, b in spans)]
    assert inside == []  # never while one of the schedule's transfers was on the wire


def test_a_region_posts_background_buckets_only_while_none_of_its_transfers_is_in_flight(plugin):
    plugin(ALGORITHMS, "test_slow_a2a", _SlowLink)
    layer = MoELayer(_slow_config(chunks=4))
    layer.algorithm.spans.clear()  # cached per group: it can hold an earlier test's spans
    bg = layer.background = Background(window=1)
    posts = _queued_posts(bg, 6)
    x = torch.randn(64, 16, requires_grad=True)
    y, aux = layer(x)
    (y.sum() + aux).backward()
    # 4 chunks x 2 exchanges x 2 directions
    _posted_only_outside(bg, posts, 6, layer.algorithm.spans, 16)


class _Pre(nn.Module):
    """A stack stage's pre: a linear map, handed to the MoE and kept as the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return h, h


def test_a_stack_posts_background_buckets_between_its_tasks_beside_its_transfers(plugin):
    """The stack pumps its layers' queue (empty when the step starts: an empty Background is
    falsy, and the stack once took None and never pumped) between its tasks, without holding a
    bucket back while its own all-to-alls are in flight, one bucket at a time (window 1)."""
    plugin(ALGORITHMS, "test_slow_a2a", _SlowLink)
    torch.manual_seed(0)
    stages = [Stage(_Pre(), MoELayer(_slow_config(chunks=2), seed=b)) for b in range(2)]
    bg = Background(window=1)
    for s in stages:
        s.moe.background = bg
    algorithms = {id(s.moe.algorithm): s.moe.algorithm for s in stages}.values()
    for a in algorithms:  # cached per group: an instance can hold an earlier test's spans
        a.spans.clear()
    out, aux = run_stack(stages, torch.randn(4, 8, 16, requires_grad=True), 2)
    posts = _queued_posts(bg, 6)  # queued during the step, as the stack's gradients are
    (out.sum() + aux).backward()
    assert len(posts) == 6 and bg.busy == 0  # all posted by the stack's pumps, none by flush
    spans = [sp for a in algorithms for sp in a.spans]
    assert len(spans) == 32  # 2 blocks x 2 micro-chunks x 2 chunks x 2 exchanges x 2 directions
    assert any(a < p < b for p in posts for a, b in spans)  # beside the stack's transfers
    assert all(b - a >= 0.001 for a, b in itertools.pairwise(posts))  # window 1: one at a time


# ------------------------------------------------------------------ against DDP, 4 ranks
class _Net(nn.Module):
    """Dense layers of uneven sizes around an MoE layer, and a frozen and an unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.moe = MoELayer(
            MoEConfig(
                gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0),
                experts=ExpertConfig(model_dim=16, hidden_dim=32),
                schedule=ScheduleConfig(policy="schemoe", chunks=2),
            )
        )
        self.big = nn.Linear(16, 700)  # buckets of uneven sizes at bucket_mb = 0.01
        self.out = nn.Linear(700, 1)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, x):
        y, aux = self.moe(torch.relu(self.inp(x)))
        return self.out(torch.relu(self.big(y))).sum() + aux + self.frozen.sum()


def _grads(rank, world, sync, algorithm, compress):
    net = _Net()
    ddp, _ = data_parallel(
        ddp_ignore_experts(net),
        sync=sync,
        compress=compress,
        algorithm=algorithm,
        bucket_mb=0.01,
        ranks_per_node=2,
        find_unused_parameters=True,
    )
    out = []
    for step in range(2):
        x = torch.randn(24, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp.zero_grad(set_to_none=True)
        ddp(x).backward()
        out.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
    assert "frozen" not in out[0] and "unused" not in out[0]
    assert all(p.grad is not None for p in expert_parameters(net))
    return out


@pytest.mark.parametrize(
    "algorithm,compress,exact",
    [("flat", "none", True), ("hier", "none", False), ("flat", "bf16", True)],
)
def test_scheduled_sync_gives_ddps_gradients(ranks, algorithm, compress, exact):
    want = ranks(4).run(_grads, "ddp", "flat", compress)
    got = ranks(4).run(_grads, "scheduled", algorithm, compress)
    for rank in range(4):
        for step in range(2):
            for name, g in want[rank][step].items():
                if exact:  # the same arithmetic, bucket for bucket
                    assert torch.equal(got[rank][step][name], g), (rank, step, name)
                else:  # another summation order: a few ulps
                    torch.testing.assert_close(got[rank][step][name], g, rtol=1e-6, atol=1e-7)


def _one_rank_leaves_before_its_backward(rank, world):
    net = _Net()
    ddp, _ = data_parallel(
        ddp_ignore_experts(net), sync="scheduled", bucket_mb=0.01, find_unused_parameters=True
    )
    loss = ddp(torch.randn(24, 16))
    if rank == 1:
        return None  # gone: its process ends, its gradient buckets never come
    t0 = time.perf_counter()
    try:
        loss.backward()
    except RuntimeError as e:
        return time.perf_counter() - t0, str(e)
    return "no error"


def test_a_rank_failing_mid_sync_makes_the_others_raise_within_the_timeout():
    out = spawn(_one_rank_leaves_before_its_backward, 2, timeout=10)
    assert out[0] != "no error"
    seconds, message = out[0]
    assert seconds < 10 + 5, message  # the group's timeout bounds it, no hang


def test_data_parallel_names_a_bad_setting():
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="grad sync must be one of"):
        data_parallel(net, sync="fsdp")
    with pytest.raises(ValueError, match="grad compress must be one of"):
        data_parallel(net, compress="int3")
    with pytest.raises(ValueError, match="needs 'scheduled'"):
        data_parallel(net, sync="ddp", algorithm="hier")
    with pytest.raises(ValueError, match="unknown gradient sync algorithm"):
        data_parallel(net, sync="scheduled", algorithm="ring9")
    with pytest.raises(ValueError, match="bucket_mb"):
        data_parallel(net, bucket_mb=0)
    assert dist.is_initialized() is False
