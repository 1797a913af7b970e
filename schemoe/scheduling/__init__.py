"""Task scheduling: tasks and schedules as data, policies, the executor, scheduled backward."""

from .executor import execute
from .plan import Chunk, build_plan
from .policies import POLICIES, Policy, fifo_links, make_schedule, register_policy
from .tasks import COMPUTE, Schedule, Task, TaskGraph

__all__ = [
    "COMPUTE",
    "POLICIES",
    "Chunk",
    "Policy",
    "Schedule",
    "Task",
    "TaskGraph",
    "build_plan",
    "execute",
    "fifo_links",
    "make_schedule",
    "register_policy",
]
