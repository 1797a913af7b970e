"""Task scheduling: tasks and schedules as data, one issue rule, policies, the executor, the
simulator and the `search` policy (registered here, with the built-in policies)."""

from . import search
from .executor import execute
from .policies import POLICIES, Policy, fifo_links, make_schedule, register_policy
from .simulator import TaskCosts, run
from .tasks import (
    COMPUTE,
    Direction,
    Kind,
    Partition,
    Phase,
    Schedule,
    Task,
    TaskGraph,
    walk,
)

__all__ = [
    "COMPUTE",
    "POLICIES",
    "Direction",
    "Kind",
    "Partition",
    "Phase",
    "Policy",
    "Schedule",
    "Task",
    "TaskCosts",
    "TaskGraph",
    "execute",
    "fifo_links",
    "make_schedule",
    "register_policy",
    "run",
    "search",
    "walk",
]
