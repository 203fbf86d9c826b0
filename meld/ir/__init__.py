"""meld's intermediate representations: the logical `TaskGraph` and the runtime `Schedule`."""
from .combiners import COMBINERS, Combiner
from .schedule import CTA_FIELDS, Schedule, ScheduleError
from .task_graph import Axis, GraphError, Reduction, TaskGraph, TaskTemplate

__all__ = ["Axis", "COMBINERS", "CTA_FIELDS", "Combiner", "GraphError", "Reduction",
           "Schedule", "ScheduleError", "TaskGraph", "TaskTemplate"]
