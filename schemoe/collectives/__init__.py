"""All-to-all algorithms: a registry of plug-ins (see base.py for the protocol)."""

from .base import ALGORITHMS, AllToAll, Done, Pending, check_splits
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
    "build",
    "check_splits",
]

_BUILT: dict = {}


def build(name: str, topology) -> AllToAll:
    """The algorithm `name` for `topology`, constructed once and cached (it may create groups)."""
    key = (name, topology, id(topology.group))  # Topology equality ignores the group
    if key not in _BUILT:
        _BUILT[key] = ALGORITHMS.get(name)(topology)
    return _BUILT[key]
