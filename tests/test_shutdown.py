"""A rank's end: `schemoe.dist.launch.shutdown` drops the groups and algorithm instances this process
cached (`topology.release`) and destroys every process group while the interpreter is alive, and
running it again is a no-op (spawn's worker runs it after `fn` returns). A group left to the
interpreter's exit aborted finished testbed ranks with SIGABRT (docs/results/exit_abort_testbed.txt).
The 4 ranks are a RankPool of the test's own, closed after it."""

from __future__ import annotations

import torch.distributed as dist

from rank_pool import RankPool
from schemoe.collectives import build
from schemoe.dist import launch as _dist
from schemoe.dist import topology
from schemoe.dist.topology import Topology


def _cache_then_shutdown(rank: int, world: int) -> tuple[int, int, bool]:
    topo = Topology.from_group(None, ranks_per_node=2)
    build("pairwise", topo)  # an algorithm instance with its comm thread
    build("hier2d", topo)  # and per-node sub-groups
    cached = len(topology._PER_WORLD)
    _dist.shutdown()
    after = len(topology._PER_WORLD)
    _dist.shutdown()  # again: nothing left to do, no error
    return cached, after, dist.is_initialized()


def test_shutdown_releases_the_cached_groups_and_destroys_the_process_groups():
    pool = RankPool(4)  # its own: the case ends the ranks' groups (the shared pools are kept)
    try:
        out = pool.run(_cache_then_shutdown)
    finally:
        pool.close()
    for cached, after, initialised in out:
        assert cached >= 3  # two algorithms, hier2d's sub-groups and their family
        assert after == 0
        assert not initialised


def test_release_without_a_process_group_is_a_no_op():
    topology.release()
    assert topology._PER_WORLD == {}
    _dist.shutdown()
