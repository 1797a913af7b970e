"""A rank that raises, dies or stalls makes the others fail with a clear error within the
timeout; non-finite steps are skipped and three in a row stop the run (always), and --check-finite names the layer and the
step of the first NaN/Inf."""

from __future__ import annotations

import datetime
import json
import os
import queue
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch

from rank_pool import RankPool, context
from schemoe import collectives
from schemoe.checkpoint import store as checkpoint
from schemoe.collectives import ALGORITHMS
from schemoe.dist import failures, topology
from schemoe.dist.launch import free_port, init_process_group, set_launcher_env
from schemoe.dist.topology import Topology
from schemoe.layer.moe import MoELayer
from schemoe.step.gradsync import GRAD_SYNCS
from schemoe.train import loop as T
from schemoe.train.model import GPT, GPTConfig
from schemoe.train.report import finite_or_none
from train_cases import TINY

TIMEOUT = 4.0  # the collective timeout (--timeout) of these runs, seconds


def _rank(rank: int, port: int, mode: str, fault_at, results) -> None:
    """Rank 1 misbehaves in its 4th MoE forward (step 3, one MoE layer: the first is the pass
    that lays out DDP's buckets before step 1, `loop.settle_buckets`); rank 0 reports."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    init_process_group("gloo", TIMEOUT)
    if rank == 1:
        forward, calls = MoELayer.forward, [0]

        def faulty(self, x):
            calls[0] += 1
            if calls[0] == 4:
                fault_at.value = time.monotonic()
                if mode == "raises":
                    raise RuntimeError("injected failure")
                if mode == "exits":
                    os._exit(3)
                time.sleep(60)  # stalls; killed by the test
            return forward(self, x)

        MoELayer.forward = faulty
    try:
        T.train(rank, 2, T.parse_args([*TINY, "--steps", "6", "--timeout", str(TIMEOUT)]))
        results.put((rank, "finished", "", 0.0))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        results.put((rank, type(e).__name__, str(e), time.monotonic()))


def _launch(target, world: int, extra: tuple, done, seconds: float, what: str) -> dict:
    """Start `world` ranks of target(rank, port, *extra, results); collect what they put
    (rank -> the rest of the tuple) until done(out), within `seconds`; kill them all."""
    ctx = context()
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=target, args=(r, port, *extra, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        deadline = time.monotonic() + seconds
        while not done(out):
            rank, *rest = results.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = rest
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(out))} did not report ({what})")
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    return out


def _run(mode: str) -> dict:
    fault_at = context().Value("d", 0.0)
    out = _launch(_rank, 2, (mode, fault_at), lambda o: 0 in o, 60 + TIMEOUT, mode)
    kind, msg, t = out[0]
    return {"kind": kind, "msg": msg, "after": t - fault_at.value}


@pytest.mark.parametrize("mode", ["raises", "exits", "stalls"])
def test_survivor_fails_with_a_clear_error_within_the_timeout_when_a_peer(mode):
    r = _run(mode)
    assert r["kind"] == "PeerFailure", r
    assert "rank 0, step 3 (forward)" in r["msg"]
    if mode == "stalls":  # only the timeout can tell a silent peer from a slow one
        assert TIMEOUT - 0.5 < r["after"] < TIMEOUT + 3
        assert "did not complete within the 4s timeout (--timeout)" in r["msg"], r["msg"]
    else:  # the failing rank tears its group down, the dead one's sockets close: no waiting
        assert r["after"] < 2.0
        assert "another rank closed its connection: it died or raised" in r["msg"], r["msg"]
        assert "timeout" not in r["msg"].split("Backend said")[0], r["msg"]


def test_check_finite_names_the_moe_layer_and_step_where_nan_first_appears():
    a = T.parse_args(TINY)
    torch.manual_seed(0)
    core = GPT(GPTConfig(seq_len=32, layers=2, heads=2), T.moe_config_from_args(a))
    checker = failures.FiniteChecker(core)
    checker.step = 7
    x = torch.randint(0, 256, (2, 32))
    core(x)  # finite: passes
    with torch.no_grad():
        core.blocks[1].ffn.experts.w1_EMH[0].fill_(float("nan"))
    with pytest.raises(
        failures.NonFiniteError,
        match=r"blocks\.1\.ffn\.experts \(BatchedFFN\) at step 7 \(forward\)",
    ):
        core(x)
    checker.close()
    core(x)  # hooks removed
    core.zero_grad()
    core.embed.weight.grad = torch.full_like(core.embed.weight, float("inf"))
    with pytest.raises(failures.NonFiniteError, match=r"gradient of embed\.weight at step 7"):
        checker.check_grads()


def test_check_finite_flag_stops_a_diverging_run_naming_module_and_step():
    a = T.parse_args(
        [*TINY, "--steps", "4", "--lr", "1e30", "--warmup", "1", "--clip", "0", "--check-finite"]
    )
    with pytest.raises(failures.NonFiniteError, match=r"in blocks\.\d\.\S+ \(\w+\).* at step 2"):
        T.train(0, 1, a)


def test_a_diverging_run_stops_after_three_skipped_steps_without_check_finite():
    a = T.parse_args([*TINY, "--steps", "6", "--lr", "1e30", "--warmup", "1", "--clip", "0"])
    with pytest.raises(failures.NonFiniteError, match=r"the run diverged: steps 2-4 had a non-fin"):
        T.train(0, 1, a)


def test_the_summary_line_writes_non_finite_values_as_null_so_it_stays_valid_json():
    summary = finite_or_none({"a": float("nan"), "b": [1.0, float("inf")], "c": [[2, 3.5]]})
    assert json.loads(json.dumps(summary, allow_nan=False)) == {
        "a": None,
        "b": [1.0, None],
        "c": [[2, 3.5]],
    }


def test_diverging_command_exits_non_zero_naming_the_step_and_keeps_the_last_finite_checkpoint(
    tmp_path,
):
    d = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "schemoe", "train", *TINY, "--nproc", "2", "--steps", "6"]
    cmd += ["--lr", "1e30", "--warmup", "1", "--clip", "0", "--save", str(d), "--save-every", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode != 0
    # (stderr also carries torch's FutureWarning about DDP's broadcast_buffers, per rank)
    first = next(x for x in run.stderr.splitlines() if x.startswith("schemoe train: error: "))
    assert first.startswith("schemoe train: error: distributed run failed: rank ")
    assert re.search(r"raised NonFiniteError: the run diverged: steps 2-4 ", first), first
    assert "NaN" not in run.stdout and not run.stdout.strip().endswith("}")  # no summary line
    # step 1's state gave the NaN of step 2: set aside; latest is the initial state
    assert (d / "latest").read_text() == "step-00000000"
    core = GPT(GPTConfig(seq_len=32, layers=2, heads=2), T.moe_config_from_args(T.parse_args(TINY)))
    assert checkpoint.load(d, core).step == 0


GLOO = "[/src/third_party/gloo/gloo/transport/tcp/pair.cc:553] "


@pytest.mark.parametrize(
    ("text", "peer"),
    [
        (GLOO + "Connection closed by peer [127.0.0.1]:30430", True),
        (GLOO + "Read error [127.0.0.1]:7567: Connection reset by peer", True),
        (GLOO + "Timed out waiting 4000ms for send operation to complete", True),
        ("Application timeout caused pair closure", True),  # gloo's waiting side, bare
        ("[gloo/allreduce.cc:41] Expected tensors of equal size, got 4 and 8", False),
        ("ProcessGroupGloo does not support this reduce op", False),
        ("CUDA out of memory", False),
    ],
)
def test_only_the_backends_messages_for_a_lost_or_silent_peer_count_as_peer_failures(text, peer):
    assert failures.is_peer_failure(RuntimeError(text)) is peer


def test_a_peer_failure_from_a_reset_connection_says_so_instead_of_blaming_the_timeout():
    e = RuntimeError(GLOO + "Read error [127.0.0.1]:7567: Connection reset by peer")
    msg = str(failures.peer_failure(e, 0, 3, "forward", 10.0))
    assert msg.startswith("rank 0, step 3 (forward): another rank closed its connection")
    assert "10s" not in msg and "did not complete" not in msg
    e = RuntimeError(GLOO + "Timed out waiting 10000ms for recv operation to complete")
    msg = str(failures.peer_failure(e, 0, 3, "backward", 10.0))
    assert "a collective (recv) did not complete within the 10s timeout (--timeout)" in msg


class _NoBackendGroup:
    """A process group whose backend options cannot be read."""


def _subgroup_timeouts(rank: int, world: int) -> tuple:
    fallback = topology.Topology(world=1, rank=0, ranks_per_node=1, group=_NoBackendGroup())
    from_default = fallback.timeout()
    real = topology._group_timeout
    topology._group_timeout = lambda _group: None  # neither group says
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            neither = fallback.timeout()
    finally:
        topology._group_timeout = real
    return from_default, neither, [str(w.message) for w in seen]


def test_a_subgroup_whose_timeout_cannot_be_read_takes_the_default_groups_or_says_so():
    pool = RankPool(1, timeout=7.0)  # its own: the group's timeout is what is read
    try:
        from_default, neither, warned = pool.run(_subgroup_timeouts)[0]
    finally:
        pool.close()
    assert from_default == datetime.timedelta(seconds=7)  # before: None, i.e. 30 minutes
    assert neither is None and any("30 minutes" in w for w in warned), warned


# ---------------------------------------------------------------- a rank dies mid-transfer

DYING = 3  # of 4 ranks, 2 per node: the last rank of the second node


def _transfer(what: str, topo):
    """A `start(x) -> Pending` for every all-to-all algorithm and gradient-sync algorithm."""
    if what.startswith("grad:"):
        sync = GRAD_SYNCS.get(what[5:])(topo)
        return lambda x: sync.start(x)
    algo = collectives.build(what, topo)
    P = topo.world
    return lambda x: algo.start(x, [x.shape[0] // P] * P, [x.shape[0] // P] * P)


def _die_mid_transfer(rank: int, port: int, what: str, results) -> None:
    set_launcher_env(rank, 4, port)
    torch.set_num_threads(1)
    try:
        init_process_group("gloo", TIMEOUT)
        start = _transfer(what, Topology.from_group(None, 2))
        start(torch.ones(64, 8)).wait()  # connections and sub-groups up, every rank alive
        # 256 MiB per rank: a pair moves 64 MiB each way, tens of ms on loopback. The dying rank
        # exits as soon as its part is posted: a pair with it cannot have finished by then (with
        # a 10 ms wait, an intra-node pipe pair still did: rank 2 'completed', 1 CI run in ~10)
        big = torch.ones(16 * 2**18, 16)
        t0 = time.monotonic()
        pending = start(big)
        if rank == DYING:
            os._exit(3)
        pending.wait()
        results.put((rank, "completed", "", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        peer = failures.is_peer_failure(e)
        results.put((rank, "peer failure" if peer else type(e).__name__, str(e)[:300],
                     time.monotonic() - t0))  # fmt: skip


def _survivors(what: str) -> dict:
    out = _launch(_die_mid_transfer, 4, (what,), lambda o: len(o) >= 3, 60 + 3 * TIMEOUT, what)
    return {rank: tuple(rest) for rank, rest in out.items()}


WHATS = ["naive", "pairwise", "pipe", "hier2d", "leader", "grad:flat", "grad:hier"]


def test_every_transfer_kind_is_under_test():
    assert set(WHATS) == set(ALGORITHMS.names()) | {f"grad:{n}" for n in GRAD_SYNCS.names()}


@pytest.mark.parametrize("what", WHATS)
def test_a_rank_dying_mid_transfer_makes_every_survivor_raise_within_the_timeout(what):
    out = _survivors(what)
    for rank, (kind, msg, after) in out.items():
        # Ranks that exchange with the dead one see their sockets close at once; the others
        # (hierarchical phases) wait on a survivor that failed, and fail when it exits.
        assert kind == "peer failure", (rank, kind, msg)
        assert after < 2 * TIMEOUT + 3, (rank, after, msg)
