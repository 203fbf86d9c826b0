"""meld's intermediate representations: the logical `TaskGraph`, the runtime `Schedule`, and the
`RankedSchedule` that adds a rank dimension and the edges along which results cross ranks."""
from .combiners import COMBINERS, Combiner
from .ranked import RankedSchedule, RankEdge
from .schedule import CTA_FIELDS, Schedule, ScheduleError
from .task_graph import TRANSPORTS, Axis, GraphError, Reduction, TaskGraph, TaskTemplate

__all__ = ["Axis", "COMBINERS", "CTA_FIELDS", "Combiner", "GraphError", "RankEdge", "RankedSchedule", "Reduction",
           "Schedule", "ScheduleError", "TRANSPORTS", "TaskGraph", "TaskTemplate"]
