"""The emulated cluster: shaping is real, intra-node stays on loopback, nothing is left behind.

Needs root and iproute2 (skipped otherwise). This file is also the ranks' program: the launcher
runs it as a script (`python tests/test_testbed.py <mode> <out.json>`) inside each namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from schemoe.testbed import launch, netns

RATE = "100mbit"
PER_PEER = 4 * 2**20  # bytes each rank sends each peer: 16 MiB cross each node link, ~1.3 s


def _tx_bytes() -> int:
    with open(f"/sys/class/net/{netns.IFNAME}/statistics/tx_bytes") as f:
        return int(f.read())


def _child(mode: str, out_path: str) -> None:
    """One rank: time inter-node-only and intra-node-only all-to-alls; rank 0 writes results."""
    if mode == "fail":
        sys.exit(3 if os.environ["RANK"] == "1" else time.sleep(60))
    if mode == "hang":
        time.sleep(60)
    import torch
    import torch.distributed as dist

    from schemoe.dist.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = Topology.from_group()
    rows = PER_PEER // 4
    out = {"world": topo.world, "ranks_per_node": topo.ranks_per_node}
    for phase in ("inter", "intra", "inter"):
        splits = [rows if topo.same_node(d) == (phase == "intra") else 0 for d in range(topo.world)]
        x = torch.ones(sum(splits))
        y = torch.empty_like(x)
        # The counter is read before the barrier: no rank of this node can start sending before
        # rank 0 got there (read after it, the other rank's first bytes could be missed).
        tx0 = _tx_bytes()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x, splits, splits)
        dist.barrier()  # the slowest pair decides
        secs, tx = time.perf_counter() - t0, _tx_bytes() - tx0
        out.setdefault(phase, []).append({"secs": secs, "eth0_tx": tx})
    dist.destroy_process_group()
    if topo.rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the testbed needs root and iproute2 (ip, tc)",
)


@pytest.fixture(scope="module")
def bed():
    if netns.namespaces() or os.path.exists(netns.STATE_FILE):
        pytest.skip("a testbed is already up; not touching someone else's")
    try:
        yield netns.up(2, RATE)
    finally:
        netns.down()
        assert netns.namespaces() == [], "testbed namespaces left behind"
        assert not os.path.exists(netns.STATE_FILE)


@needs_root
def test_inter_node_bytes_take_at_least_bytes_over_rate_and_intra_node_bytes_skip_the_link(
    bed, tmp_path
):
    out = tmp_path / "result.json"
    assert launch.run([__file__, "measure", str(out)], ranks_per_node=2, timeout=45) == 0
    res = json.loads(out.read_text())
    assert res["world"] == 4 and res["ranks_per_node"] == 2
    rate_Bps = bed.rate_bps / 8
    # Each node's 2 ranks send PER_PEER to each of the 2 ranks of the other node.
    inter_bytes = 2 * 2 * PER_PEER
    for sample in res["inter"]:
        # tbf lets one full bucket leave at line speed after idling; the rest waits for tokens.
        assert sample["secs"] >= (inter_bytes - netns.bucket_bytes(bed.rate_bps)) / rate_Bps
        assert sample["eth0_tx"] >= inter_bytes  # the bytes did cross the node link
    intra = res["intra"][0]
    intra_bytes = 2 * 1 * PER_PEER  # each rank to the one other rank of its node
    assert intra["secs"] < 0.25 * intra_bytes / rate_Bps, "intra-node traffic looks shaped"
    assert intra["eth0_tx"] < 0.01 * intra_bytes, "intra-node traffic went out of eth0"


@needs_root
def test_a_failing_rank_stops_the_others_and_the_launcher_returns_its_code(bed, tmp_path):
    t0 = time.monotonic()
    code = launch.run([__file__, "fail", str(tmp_path / "x")], ranks_per_node=2, timeout=30)
    assert code == 3
    assert time.monotonic() - t0 < 20  # the sleeping ranks were killed, not waited for


@needs_root
def test_a_run_past_its_timeout_is_killed_with_code_124(bed, tmp_path):
    t0 = time.monotonic()
    assert launch.run([__file__, "hang", str(tmp_path / "x")], ranks_per_node=1, timeout=2) == 124
    assert time.monotonic() - t0 < 10


def test_rates_and_latencies_parse_or_fail_naming_the_value():
    assert netns.parse_rate("400mbit") == 4e8
    assert netns.parse_rate("1.5Gbit") == 1.5e9
    assert netns.parse_latency("500us") == pytest.approx(5e-4)
    assert netns.parse_latency(None) == 0.0
    for bad in ("400", "10bps", "-1mbit", "fast"):
        with pytest.raises(ValueError, match="rate"):
            netns.parse_rate(bad)
    with pytest.raises(ValueError, match="latency"):
        netns.parse_latency("2 parsecs")


def test_the_launcher_runs_modules_and_scripts_with_this_python():
    assert launch.child_command(["--", "-m", "schemoe.cli", "bench"])[1:] == [
        "-m",
        "schemoe.cli",
        "bench",
    ]
    assert launch.child_command(["schemoe.cli"])[1:] == ["-m", "schemoe.cli"]
    assert launch.child_command([__file__, "a"])[1:] == [__file__, "a"]
    with pytest.raises(ValueError, match="does not exist"):
        launch.child_command(["nope.py"])


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
