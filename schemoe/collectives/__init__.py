"""All-to-all algorithms: a registry of plug-ins (see base.py for the protocol)."""

from ..dist.topology import Topology, per_world
from .base import ALGORITHMS, AllToAll, Done, Pending, Works, check_splits
from .hier2d import Hier2D
from .leader import Leader
from .naive import Naive
from .pairwise import Pairwise
from .pipe import Pipe

__all__ = [
    "ALGORITHMS",
    "AllToAll",
    "Done",
    "Hier2D",
    "Leader",
    "Naive",
    "Pairwise",
    "Pending",
    "Pipe",
    "Works",
    "build",
    "check_splits",
]


def build(name: str, topology: Topology) -> AllToAll:
    """The algorithm `name` for `topology`, constructed once per process-group initialisation
    and shared by every layer on that group (it may create sub-groups and a comm thread, and
    the layers' transfers must share its one ordering)."""
    cls = ALGORITHMS.get(name)
    # Topology equality ignores the group: the group object is part of the key.
    return per_world(("algorithm", name, cls, topology, topology.group), lambda: cls(topology))
