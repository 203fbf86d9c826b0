"""Runtime scheduling: turn real shapes into work tables (`meld.ir.Schedule`)."""
from .cost_model import DecodeCost
from .decode_plan import plan_decode
from .decode_plan_host import plan_decode_host
from .split_reduce_plan import GroupTable, SplitReducePlan, plan_split_reduce
from .topology import Topology, cluster_rows

__all__ = ["DecodeCost", "GroupTable", "SplitReducePlan", "Topology", "cluster_rows", "plan_decode", "plan_decode_host",
           "plan_split_reduce"]
