"""Emulated multi-node cluster on one Linux box: namespaces, shaped links, a launcher.

See docs/testbed.md. `netns` builds and removes the network, `launch` runs ranks inside it.
"""

from .launch import run
from .netns import Testbed, down, load, up

__all__ = ["Testbed", "down", "load", "run", "up"]
