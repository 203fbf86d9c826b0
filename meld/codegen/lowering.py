"""From a task graph to the kernel family that runs it: the graph, not the operator, decides.

The task kinds select the family's planner policy (`PLANNED_KINDS`: which selector reads the rest of the
graph) and its device task bodies; within the kinds, the combiner recorded on the graph's reduction selects
the merge — the device merge the family compiles and the merge the CPU reference executor applies — and the
producers' domains and the attrs select among families of one shape. The family (`FAMILIES`) names
everything an operator runs: its kernel template, the builder of its kernel config (from the graph's attrs
and the operator's run-time options), its parameter struct, its host and device planners, its reference
executor and its device merge per combiner. Operators ask their `Lowering` for these instead of importing
them. A graph that asks for something no family implements is refused here, with the reason, before
anything is compiled.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..ir import TaskGraph
from ..ir.task_graph import GraphError, TaskTemplate


@dataclass(frozen=True)
class Family:
    """What runs one family. All but `kernel` and `merges` are "module:attribute" paths, imported when asked
    for (they import torch and NumPy; lowering only the IR)."""

    kernel: str | None           # the kernel template (None: only the CPU reference executor so far)
    config: str                  # builds the kernel config: (lowering, **the operator's options) -> config
    params: str                  # the kernel's parameter struct (meld/codegen/params.py)
    planner: str                 # the host planner (where there is a GPU planner, built from the same C source)
    device_planner: str | None   # the GPU planner's config; None: planned on the host, or in the kernel itself
    executor: str                # the CPU reference executor
    merges: Mapping[str, str]    # combiner -> the template whose device merge implements it
    xrank_params: str | None = None   # the parameter struct of builds whose partials cross ranks (if another)
    xrank_config: str | None = None   # builds the config of the cross-rank edge's own kernels, where the
                                      # transport runs as launches around the family's (expert parallelism)


FAMILIES = {
    # The decode GPU planner (templates/decode_plan.cuh) serves both split-KV families: one CTA cuts the batch.
    "decode_attention": Family(
        "decode_attention.cuh", "meld.codegen.decode_kernel:DecodeKernelConfig.of",
        "meld.codegen.params:DECODE_PARAMS", "meld.scheduler.decode_plan_host:plan_decode_host",
        "meld.codegen.decode_kernel:DecodePlanKernelConfig", "meld.runtime.reference:execute_decode",
        {"online_softmax": "split_kv.cuh"}, xrank_params="meld.codegen.params:SEQ_PARALLEL_DECODE_PARAMS"),
    "mla_decode": Family(
        "mla_decode.cuh", "meld.codegen.mla_kernel:MlaKernelConfig.of", "meld.codegen.params:MLA_PARAMS",
        "meld.scheduler.decode_plan_host:plan_decode_host", "meld.codegen.decode_kernel:DecodePlanKernelConfig",
        "meld.runtime.reference:execute_mla", {"online_softmax": "split_kv.cuh"}),
    # MoE plans on the GPU inside its own routing launch (templates/moe_plan.h included by moe.cuh): no
    # planner kernel of its own.
    "moe": Family(
        "moe.cuh", "meld.codegen.moe_kernel:MoeKernelConfig.of", "meld.codegen.params:MOE_PARAMS",
        "meld.scheduler.moe_plan:plan_moe_host", None, "meld.runtime.moe_reference:execute_moe",
        {"weighted_sum": "moe.cuh"}, xrank_params="meld.codegen.params:EP_PARAMS",
        xrank_config="meld.codegen.ep_kernel:EpKernelConfig.of"),
    # The row-parallel linear's plan is closed-form in the call's M, made on the host once per M.
    "tp_linear": Family(
        "tp_linear.cuh", "meld.codegen.tp_kernel:TpKernelConfig.of", "meld.codegen.params:TP_PARAMS",
        "meld.codegen.tp_kernel:TpSchedule.of", None, "meld.distributed.tp_matmul:row_parallel_matmul",
        {"sum": "tp_linear.cuh"}),
    # The grouped family's task and event tables are planned on the host and uploaded (CascadeDecode.plan).
    "grouped_attention": Family(
        "grouped_attention.cuh", "meld.codegen.grouped_kernel:GroupedKernelConfig.of",
        "meld.codegen.params:GROUPED_PARAMS", "meld.scheduler.split_reduce_plan:plan_split_reduce", None,
        "meld.runtime.reference:execute_split_reduce", {"online_softmax": "grouped_attention.cuh"}),
}


def _resolve(path: str) -> Callable:
    """The attribute a "module:attribute" path names, looked up at each call (so a patched one is seen)."""
    module, name = path.split(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


@dataclass(frozen=True)
class Lowering:
    family: str                          # a FAMILIES key: what runs the graph
    combiner: str                        # meld.ir.COMBINERS key: the device merge and the executor's merge
    waits: tuple[tuple[str, str, str], ...] = ()   # (src, dst, axis): tile edges that become dependency counters
    producers: tuple[str, ...] = ()      # the split-reduce tasks whose partials the combines merge, in merge order
    transport: str | None = None         # how those partials cross ranks (meld.ir.TRANSPORTS; None: one GPU)
    attrs: Mapping[str, object] = field(default_factory=dict, compare=False)   # the graph's: sizes, dtype

    @property
    def kernel(self) -> str | None:
        """The family's kernel template, or None where only the CPU reference executor runs it."""
        return FAMILIES[self.family].kernel

    def kernel_config(self, **options: object):
        """The family's kernel config for this graph (its attrs and transport) and the operator's run-time
        `options` (those the graph does not record: a cache dtype, batch invariance, profiling)."""
        return _resolve(FAMILIES[self.family].config)(self, **options)

    @property
    def params(self):
        """The kernel's parameter struct (`meld.codegen.params.ParamStruct`): with the cross-rank edge's fields
        where the graph's partials cross ranks and the family has such a build."""
        f = FAMILIES[self.family]
        return _resolve(f.xrank_params if self.transport and f.xrank_params else f.params)

    def transport_config(self, **options: object):
        """The config of the kernels that carry this graph's partials across ranks where the family runs them as
        launches of their own (expert parallelism's dispatch, return and combine), from the graph's transport
        and the operator's `options`; GraphError where the graph has no transport or the family's kernels
        carry it themselves."""
        path = FAMILIES[self.family].xrank_config
        if self.transport is None or path is None:
            raise GraphError(f"the {self.family} family has no cross-rank kernels for transport {self.transport!r}")
        return _resolve(path)(self, **options)

    @property
    def planner(self) -> Callable:
        """The family's host planner: real lengths in, the work tables its kernel and its executor walk out."""
        return _resolve(FAMILIES[self.family].planner)

    @property
    def device_planner(self):
        """The family's GPU planner config (an instance), or None where the family plans on the host or
        inside its own kernel (FAMILIES says which)."""
        path = FAMILIES[self.family].device_planner
        return None if path is None else _resolve(path)()

    @property
    def executor(self) -> Callable:
        """The family's CPU reference executor (the walk of its work tables the kernel makes); it merges with
        `combiner`."""
        return _resolve(FAMILIES[self.family].executor)

    @property
    def device_merge(self) -> str:
        """The template whose device merge implements the graph's combiner in this family's kernel; GraphError
        where the family's kernel has no merge for it."""
        merges = FAMILIES[self.family].merges
        if self.combiner not in merges:
            raise GraphError(f"the {self.family} family's kernel merges {sorted(merges)}, not {self.combiner!r}")
        return merges[self.combiner]


def _split_reduce(g: TaskGraph) -> Lowering:
    """Split-reduce and combine tasks. A split range of KV positions merges online-softmax states (attention:
    MLA's where it reads a latent cache, i.e. the graph has a rotary-key width); a split contraction
    dimension, plain sums (the row-parallel GEMM, its ranges spread over ranks). Attention whose partials
    come from several tasks, from a task over groups of the combine's points (a shared prefix read once for
    a group of requests), or through more than one level of combines, is the grouped family: its plan is a
    task and event table (meld.ir.work_table)."""
    reductions = {t.reduction.combiner for t in g.tasks if t.reduction is not None}
    if len(reductions) != 1 or next(iter(reductions)) not in ("online_softmax", "sum"):
        raise GraphError(f"graph {g.name!r}: a split-reduce family merges online-softmax states or sums; "
                         f"this graph reduces with {sorted(reductions)}")
    combiner = next(iter(reductions))
    combines = [t for t in g.tasks if t.kind == "combine"]
    if combiner == "sum":
        producers = tuple(t.name for t in g.producers(combines[0].name)) if len(combines) == 1 else ()
        transport = g.transport(combines[0].name) if len(combines) == 1 else None
        return Lowering("tp_linear", combiner, producers=producers, transport=transport)
    sink = _sink(g, combines)
    producers = _leaves(g, sink)
    grouped = len(combines) > 1 or len(producers) > 1 or g.task(producers[0]).domain != sink.domain
    attention = "mla_decode" if "head_dim_kpe" in g.attrs else "decode_attention"
    family = "grouped_attention" if grouped else attention
    crossing = sorted({t for t in map(g.transport, (c.name for c in combines)) if t is not None})
    if crossing and family != "decode_attention":
        raise GraphError(f"graph {g.name!r}: partials cross ranks ({', '.join(map(repr, crossing))}) only in the "
                         f"decode_attention and tp_linear families, not {family}")
    return Lowering(family, combiner, producers=producers, transport=g.transport(sink.name))


def _sink(g: TaskGraph, combines: list[TaskTemplate]) -> TaskTemplate:
    """The combine that writes attention's output: the one whose merged state no other combine reads. The
    others are levels of a merge tree (each merges per combine point, like the sink, and feeds one combine)."""
    feeds = {c.name: [d for _, d, r in g.graph.out_edges(c.name, data="reduction") if r is not None]
             for c in combines}
    sinks = [c for c in combines if not feeds[c.name]]
    if len(sinks) != 1 or any(len(d) > 1 for d in feeds.values()):
        raise GraphError(f"graph {g.name!r}: attention's combines must form one tree that merges into one output; "
                         f"combines {[c.name for c in combines]} feed {feeds}")
    inner = [c.name for c in combines if c.domain != sinks[0].domain]
    if inner:
        raise GraphError(f"graph {g.name!r}: combine(s) {inner} merge over another domain than the output's "
                         f"{sinks[0].name!r}: every level of attention's merge is per (request, kv head)")
    return sinks[0]


def _leaves(g: TaskGraph, combine: TaskTemplate) -> tuple[str, ...]:
    """The split-reduce tasks under `combine`, depth first through its inputs in merge order: the order the
    planner lays their pieces on its line and an event lists its parts in."""
    out: list[str] = []
    for t in g.producers(combine.name):
        if t.kind == "combine":
            out += _leaves(g, t)
        elif sum(r is not None for _, _, r in g.graph.out_edges(t.name, data="reduction")) > 1:
            raise GraphError(f"graph {g.name!r}: task {t.name!r} feeds its partials to several combines")
        else:
            out.append(t.name)
    return tuple(out)


def _tiles(g: TaskGraph) -> Lowering:
    """Map, tile and combine tasks: two tile stages joined by a row-block dependency, merged by a weighted sum
    (whose inputs cross ranks where the combine's edge has a transport: expert parallelism)."""
    kinds = {t.name: t.kind for t in g.tasks}
    reductions = {t.reduction.combiner for t in g.tasks if t.reduction is not None}
    waits = tuple((s, d, dep) for s, d, dep in g.graph.edges(data="depends") if dep is not None and kinds[s] == "tile")
    if reductions != {"weighted_sum"} or len(waits) != 1 or waits[0][2] != "row_block":
        raise GraphError(f"graph {g.name!r}: the tile family runs two tile stages joined by a row-block "
                         f"dependency and a weighted-sum combine; this graph has reductions "
                         f"{sorted(reductions)} and tile edges {list(waits)}")
    combine = next(t.name for t in g.tasks if t.kind == "combine")
    return Lowering("moe", "weighted_sum", waits, transport=g.transport(combine))


# The task kinds a graph may have (sorted), and the selector that reads the rest of it: the planner policies.
PLANNED_KINDS: dict[tuple[str, ...], Callable[[TaskGraph], Lowering]] = {
    ("combine", "split_reduce"): _split_reduce,
    ("combine", "map", "tile"): _tiles,
}


def lower(graph: TaskGraph) -> Lowering:
    """The family that runs `graph` (validated first); GraphError says why none does."""
    if not isinstance(graph, TaskGraph):
        raise TypeError(f"graph must be a meld.ir.TaskGraph, got {type(graph).__name__}")
    g = graph.validate()
    kinds = tuple(sorted({t.kind for t in g.tasks}))
    select = PLANNED_KINDS.get(kinds)
    if select is None:
        raise GraphError(f"graph {g.name!r}: no planner takes task kinds {list(kinds)}; planners take "
                         + " or ".join(str(list(k)) for k in PLANNED_KINDS))
    low = dataclasses.replace(select(g), attrs=dict(g.attrs))
    try:
        low.device_merge   # (a combiner the family's kernel cannot merge is refused before anything compiles)
    except GraphError as e:
        raise GraphError(f"graph {g.name!r}: {e}") from None
    return low
