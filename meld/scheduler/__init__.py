"""Runtime scheduling: turn real shapes into work tables (`meld.ir.Schedule`)."""
from .cost_model import DecodeCost
from .decode_plan import plan_decode
from .decode_plan_host import plan_decode_host
from .topology import Topology, cluster_rows

__all__ = ["DecodeCost", "Topology", "cluster_rows", "plan_decode", "plan_decode_host"]
