"""Task scheduling: tasks and schedules as data, one issue rule, policies, the executor, the
simulator and the `search` policy (registered here, with the built-in policies)."""

from . import search, stack
from .executor import execute
from .policies import (
    POLICIES,
    Policy,
    fifo_links,
    make_schedule,
    place_shared,
    register_policy,
    with_shared,
)
from .simulator import TaskCosts, run
from .stack import STACK_POLICIES, StackGraph, make_stack_schedule, stack_task_costs
from .tasks import (
    COMPUTE,
    SHARED,
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
    "SHARED",
    "STACK_POLICIES",
    "Direction",
    "Kind",
    "Partition",
    "Phase",
    "Policy",
    "Schedule",
    "StackGraph",
    "Task",
    "TaskCosts",
    "TaskGraph",
    "execute",
    "fifo_links",
    "make_schedule",
    "make_stack_schedule",
    "place_shared",
    "register_policy",
    "run",
    "search",
    "stack",
    "stack_task_costs",
    "walk",
    "with_shared",
]
