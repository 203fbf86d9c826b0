"""From a task graph to the kernel family that runs it: the graph, not the operator, decides.

The task kinds and their edges select the family (its planner policy and device task bodies); the
combiner recorded on the graph's reduction selects the merge — the device merge the family compiles and
the merge the CPU reference executor applies. A graph that asks for something no family implements is
refused here, with the reason, before anything is compiled.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import TaskGraph
from ..ir.task_graph import GraphError


@dataclass(frozen=True)
class Lowering:
    family: str                          # "decode_attention" | "mla_decode" | "moe" | "tp_linear": template, planner
    combiner: str                        # meld.ir.COMBINERS key: the device merge and the executor's merge
    waits: tuple[tuple[str, str, str], ...] = ()   # (src, dst, axis): tile edges that become dependency counters


def _kinds(g: TaskGraph) -> dict[str, str]:
    return {t.name: t.kind for t in g.tasks}


def lower(graph: TaskGraph) -> Lowering:
    """The family that runs `graph` (validated first); GraphError says why none does."""
    g = graph.validate()
    kinds = sorted(set(_kinds(g).values()))
    reductions = {t.reduction.combiner for t in g.tasks if t.reduction is not None}
    edges = [(s, d, data.get("depends")) for s, d, data in g.graph.edges(data=True)]
    if kinds == ["combine", "split_reduce"]:
        # A split range of KV positions merges online-softmax states (attention: MLA's where it reads a latent
        # cache, i.e. the graph has a rotary-key width); a split contraction dimension, plain sums (the
        # row-parallel GEMM, its ranges spread over ranks).
        attention = "mla_decode" if "head_dim_kpe" in g.attrs else "decode_attention"
        families = {"online_softmax": attention, "sum": "tp_linear"}
        if len(reductions) != 1 or next(iter(reductions)) not in families:
            raise GraphError(f"graph {g.name!r}: a split-reduce family merges online-softmax states or sums; "
                             f"this graph reduces with {sorted(reductions)}")
        combiner = next(iter(reductions))
        return Lowering(families[combiner], combiner)
    if kinds == ["combine", "map", "tile"]:
        waits = tuple((s, d, dep) for s, d, dep in edges if dep is not None and _kinds(g)[s] == "tile")
        if reductions != {"weighted_sum"} or len(waits) != 1 or waits[0][2] != "row_block":
            raise GraphError(f"graph {g.name!r}: the tile family runs two tile stages joined by a row-block "
                             f"dependency and a weighted-sum combine; this graph has reductions "
                             f"{sorted(reductions)} and tile edges {list(waits)}")
        return Lowering("moe", "weighted_sum", waits)
    raise GraphError(f"graph {g.name!r}: no kernel family runs task kinds {kinds}")
