import os
import sys
import tempfile
from contextlib import contextmanager

import pytest

# The multi-rank tests import their shared helpers (moe_cases) in spawned processes too.
sys.path.insert(0, os.path.dirname(__file__))

from rank_pool import RankPool

# No test reads or writes the user's home (profile stores, caches): HOME points at an empty
# folder for this session and the ranks it spawns.
_HOME = tempfile.mkdtemp(prefix="schemoe-test-home-")
os.environ["HOME"] = _HOME
os.environ["XDG_CACHE_HOME"] = os.path.join(_HOME, ".cache")


@contextmanager
def registered(registry, name: str, obj):
    """`obj` registered as `name` in `registry` for the block only (also inside spawned ranks)."""
    registry.register(name)(obj)
    try:
        yield obj
    finally:
        registry.unregister(name)


@pytest.fixture
def plugin():
    """Register test-only plug-ins for one test: plugin(registry, name, obj); removed after."""
    added = []

    def add(registry, name, obj):
        registry.register(name)(obj)
        added.append((registry, name))
        return obj

    yield add
    for registry, name in added:
        registry.unregister(name)


@pytest.fixture(scope="session")
def ranks():
    """ranks(world) -> a RankPool of `world` gloo ranks, shared by the session's cases (spawning
    and joining a group costs seconds); a pool a failed case closed is replaced."""
    pools: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in pools or pools[world].closed:
            pools[world] = RankPool(world)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()
