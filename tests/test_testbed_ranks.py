"""The testbed with rank links (`up --intra-rate`): where the bytes go, per interface counter.

Needs root and iproute2 (skipped otherwise). Rates: rank links Q = 25 Mbit/s, uplinks R = 200
Mbit/s, 2 nodes x 2 ranks, each rank sending PER_PEER to each peer of one kind:
- intra: each rank's link carries PER_PEER each way (>= PER_PEER / Q), the uplinks nothing;
- inter: each uplink carries 4 x PER_PEER (>= 4 PER_PEER / R); each rank link 2 x PER_PEER, which
  takes >= 2 PER_PEER / Q when the rank link shapes all bytes ("shared") and is not shaped at
  all when it shapes only intra-node bytes ("separate"), leaving the uplink as the limit.
This file is also the ranks' program (`python tests/test_testbed_ranks.py <phase> <out.json>`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from schemoe.testbed import launch, netns

RATE, INTRA_RATE = "200mbit", "25mbit"
PER_PEER = 2 * 2**20  # bytes each rank sends each peer of the phase's kind
K = 2  # ranks per node


def _child(phase: str, out_path: str) -> None:
    """One rank: one all-to-all over the phase's pairs; every rank writes what it saw."""
    import torch
    import torch.distributed as dist

    from schemoe.dist.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = Topology.from_group()
    rows = PER_PEER // 4
    splits = [rows if topo.same_node(d) == (phase == "intra") else 0 for d in range(topo.world)]
    x = torch.ones(sum(splits))
    y = torch.empty_like(x)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_to_all_single(y, x, splits, splits)
    dist.barrier()  # the slowest pair decides
    secs = time.perf_counter() - t0
    dist.destroy_process_group()
    ip = ["ip", "-o", "-4", "addr", "show", "dev", netns.IFNAME]
    addr = subprocess.run(ip, capture_output=True, text=True, check=True).stdout.split()[3]
    with open(f"{out_path}.{topo.rank}", "w") as f:
        json.dump({"secs": secs, "addr": addr.split("/")[0], "world": topo.world}, f)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the testbed needs root and iproute2 (ip, tc)",
)


@pytest.fixture(scope="module", params=netns.INTRA_LINKS)
def bed(request):
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("the testbed needs root and iproute2 (ip, tc)")
    if netns.namespaces() or os.path.exists(netns.STATE_FILE):
        pytest.skip("a testbed is already up; not touching someone else's")
    try:
        yield netns.up(2, RATE, intra_rate=INTRA_RATE, ranks_per_node=K, intra_link=request.param)
    finally:
        netns.down()
        assert netns.namespaces() == [], "testbed namespaces left behind"
        assert not os.path.exists(netns.STATE_FILE)
        assert netns.down() == []  # idempotent


def _counters(bed: netns.Testbed) -> dict[str, int]:
    """tx bytes of every rank's eth0 and every node's uplink."""
    out = {}
    for n in range(bed.nodes):
        out[f"uplink{n}"] = netns.link_bytes(bed.node_ns(n), "uplink")[0]
        for j in range(K):
            out[f"rank{n * K + j}"] = netns.link_bytes(bed.rank_ns(n, j), netns.IFNAME)[0]
    return out


def _run_phase(bed: netns.Testbed, phase: str, tmp_path) -> tuple[list[dict], dict[str, int]]:
    out = tmp_path / "r"
    before = _counters(bed)
    assert launch.run([__file__, phase, str(out)], ranks_per_node=K, timeout=60) == 0
    after = _counters(bed)
    res = [json.loads((tmp_path / f"r.{r}").read_text()) for r in range(bed.nodes * K)]
    return res, {k: after[k] - before[k] for k in before}


@pytest.fixture(scope="module")
def phase(bed, tmp_path_factory):
    """phase(name) -> (what each rank saw, bytes per interface) of one run of that phase on this
    bed, run once: the checks on the same phase share it (4 ranks start in seconds each)."""
    runs: dict[str, tuple[list[dict], dict[str, int]]] = {}

    def get(name: str) -> tuple[list[dict], dict[str, int]]:
        if name not in runs:
            runs[name] = _run_phase(bed, name, tmp_path_factory.mktemp(name))
        return runs[name]

    return get


@needs_root
def test_each_rank_runs_in_its_own_namespace_in_node_major_order(bed, phase):
    if bed.intra_link != "shared":
        pytest.skip("addresses do not depend on --intra-link: checked once, with shared")
    res, _ = phase("intra")
    assert [r["addr"] for r in res] == list(bed.addresses)
    assert bed.addresses[K] == "10.77.1.1"  # rank K is node 1's first rank


@needs_root
def test_intra_node_bytes_cross_the_rank_links_at_the_intra_rate_and_not_the_uplink(bed, phase):
    res, moved = phase("intra")
    for r in range(bed.nodes * K):
        assert moved[f"rank{r}"] >= PER_PEER, "an intra-node pair did not cross the rank link"
    for n in range(bed.nodes):
        # Only the rendezvous and gloo's connection set-up cross nodes (a few KB).
        assert moved[f"uplink{n}"] < 0.02 * K * PER_PEER, "intra-node bytes crossed the uplink"
    q_Bps = bed.intra_rate_bps / 8
    assert res[0]["secs"] >= (PER_PEER - netns.bucket_bytes(bed.intra_rate_bps)) / q_Bps


@needs_root
def test_inter_node_bytes_cross_the_uplink_and_the_rank_link_shapes_them_only_when_shared(
    bed, phase
):
    res, moved = phase("inter")
    remote = (bed.nodes - 1) * K
    for n in range(bed.nodes):
        assert moved[f"uplink{n}"] >= K * remote * PER_PEER
    for r in range(bed.nodes * K):
        assert moved[f"rank{r}"] >= remote * PER_PEER
    secs = res[0]["secs"]
    up_bytes = K * remote * PER_PEER
    assert secs >= (up_bytes - netns.bucket_bytes(bed.rate_bps)) / (bed.rate_bps / 8)
    q_Bps = bed.intra_rate_bps / 8
    rank_link_s = remote * PER_PEER / q_Bps  # 4x the uplink's time at these rates
    if bed.intra_link == "shared":
        assert secs >= rank_link_s - netns.bucket_bytes(bed.intra_rate_bps) / q_Bps
    else:
        assert secs < 0.6 * rank_link_s, "inter-node bytes look shaped by the rank link"


@needs_root
def test_a_run_with_other_ranks_per_node_than_up_made_is_refused_naming_both(bed):
    with pytest.raises(ValueError, match="ranks_per_node 1.*has 2 rank namespaces"):
        launch.run(["-m", "schemoe.cli"], ranks_per_node=1, timeout=5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes": 2, "intra_rate": "fast", "ranks_per_node": 2}, "intra-rate 'fast'"),
        ({"nodes": 2, "intra_rate": "10bps", "ranks_per_node": 2}, "intra-rate '10bps'"),
        (
            {"nodes": 1, "intra_rate": "50mbit", "ranks_per_node": 2},
            "intra-rate '50mbit' with 1 node",
        ),
        ({"nodes": 2, "intra_rate": "50mbit"}, "needs ranks per node"),
        ({"nodes": 2, "intra_rate": "50mbit", "ranks_per_node": 0}, "got 0"),
        (
            {"nodes": 2, "intra_rate": "50mbit", "ranks_per_node": 2, "intra_link": "nv"},
            "intra-link 'nv'",
        ),
        ({"nodes": 2, "ranks_per_node": 2}, "only with --intra-rate"),
    ],
    ids=[
        "unparsable",
        "bytes_per_second",
        "one_node",
        "no_ranks_per_node",
        "zero_ranks_per_node",
        "unknown_intra_link",
        "ranks_per_node_without_intra_rate",
    ],
)
def test_up_refuses_bad_intra_node_settings_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        netns.up(rate="200mbit", **kwargs)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
