"""The logical task graph: what a dynamic operator computes, before any shape is known.

A `TaskGraph` is a DAG of task templates. Each template names its iteration domain (the axes one task
instance is indexed by), the dynamic range axis it may cover only part of (for split-KV attention, the KV
positions of a request), which axes should be co-located (affinity) and how partial results over the range
axis combine (reduction semantics: a named combiner and its identity). Extents are symbolic: the graph is
the same for every batch; only the scheduler sees real lengths.

An edge src -> dst says dst reads what src writes. By default every dst instance waits for every src
instance. `depends="axis"` makes the dependency tile-level: a dst instance waits only for the src
instances that agree with it on the domain axes up to and including that axis (both domains start with
the same axes up to it), e.g. a down-projection tile of (expert, row_block) waits for the gate/up tiles of
that (expert, row_block) across all their column blocks. An edge carrying a reduction feeds partials to
the combine task that merges them; `transport` on such an edge says the partials cross ranks on their way
(the operator runs over a process group: the graph's rank dimension), and by which of TRANSPORTS.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx

from . import serial
from .combiners import COMBINERS


class GraphError(ValueError):
    """A task graph that breaks one of the invariants the scheduler relies on."""


@dataclass(frozen=True)
class Axis:
    """One iteration axis. `extent` is a symbol (e.g. "batch_size") or a fixed size.

    `dynamic` marks an axis whose extent differs per point of the task domain (KV length per request).
    """

    name: str
    extent: str | int
    dynamic: bool = False


@dataclass(frozen=True)
class Reduction:
    """Reduction semantics: the combiner (a key of `meld.ir.combiners.COMBINERS`) and the axis it reduces."""

    combiner: str
    axis: str

    @property
    def identity(self) -> tuple[float, ...]:
        return COMBINERS[self.combiner].identity


@dataclass(frozen=True)
class TaskTemplate:
    """A kind of task. Instances are the points of `domain` (times sub-ranges of `range_axis`, if any)."""

    name: str
    kind: str  # one of TASK_KINDS
    domain: tuple[Axis, ...]
    range_axis: Axis | None = None
    affinity: tuple[str, ...] = ()
    reduction: Reduction | None = None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TaskTemplate:
        return TaskTemplate(
            name=d["name"],
            kind=d["kind"],
            domain=tuple(Axis(**a) for a in d["domain"]),
            range_axis=Axis(**d["range_axis"]) if d["range_axis"] else None,
            affinity=tuple(d["affinity"]),
            reduction=Reduction(**d["reduction"]) if d["reduction"] else None,
            reads=tuple(d["reads"]),
            writes=tuple(d["writes"]),
        )


def _axis(d: object, where: str) -> Axis:
    d = serial.fields(d, where, GraphError, ("name", "extent"), ("dynamic",))
    extent = d["extent"]
    if not isinstance(extent, str) and (not isinstance(extent, int) or isinstance(extent, bool)):
        raise GraphError(f"{where}.extent must be a symbol or an int, got {extent!r}")
    dynamic = d.get("dynamic", False)
    if not isinstance(dynamic, bool):
        raise GraphError(f"{where}.dynamic must be true or false, got {dynamic!r}")
    return Axis(serial.text(d["name"], f"{where}.name", GraphError), extent, dynamic)


def _reduction(d: object, where: str) -> Reduction | None:
    if d is None:
        return None
    d = serial.fields(d, where, GraphError, ("combiner", "axis"))
    return Reduction(serial.text(d["combiner"], f"{where}.combiner", GraphError),
                     serial.text(d["axis"], f"{where}.axis", GraphError))


def _names(v: object, where: str) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise GraphError(f"{where} must be a list of names, got {v!r}")
    return tuple(serial.text(x, f"{where}[{i}]", GraphError) for i, x in enumerate(v))


def _task(d: object, where: str) -> TaskTemplate:
    """A task template from JSON (`TaskTemplate.to_dict`), its fields checked by type."""
    d = serial.fields(d, where, GraphError, ("name", "kind", "domain", "range_axis", "affinity", "reduction", "reads",
                                             "writes"))
    if not isinstance(d["domain"], list):
        raise GraphError(f"{where}.domain must be a list of axes, got {d['domain']!r}")
    return TaskTemplate(
        name=serial.text(d["name"], f"{where}.name", GraphError), kind=serial.text(d["kind"], f"{where}.kind", GraphError),
        domain=tuple(_axis(a, f"{where}.domain[{i}]") for i, a in enumerate(d["domain"])),
        range_axis=None if d["range_axis"] is None else _axis(d["range_axis"], f"{where}.range_axis"),
        affinity=_names(d["affinity"], f"{where}.affinity"), reduction=_reduction(d["reduction"], f"{where}.reduction"),
        reads=_names(d["reads"], f"{where}.reads"), writes=_names(d["writes"], f"{where}.writes"))


# "split_reduce": a partial over a sub-range of its range axis; "combine": merges the partials of one domain
# point; "map": independent work per domain point (MoE routing, dispatch); "tile": one output tile of a
# GEMM-like task, whole along its contraction (which stays inside the tile).
TASK_KINDS = ("split_reduce", "combine", "map", "tile")
# How partials cross ranks on a combine edge: "peer", NVLink peer memory between the GPUs of a node;
# "proxy", puts and signals through a host proxy thread (the model of RDMA between nodes).
TRANSPORTS = ("peer", "proxy")


@dataclass
class TaskGraph:
    """A named DAG of task templates plus the static attributes codegen specialises on."""

    name: str
    attrs: dict[str, Any] = field(default_factory=dict)
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)

    def add_task(self, task: TaskTemplate) -> TaskTemplate:
        if task.name in self.graph:
            raise GraphError(f"task {task.name!r} is already in graph {self.name!r}")
        self.graph.add_node(task.name, task=task)
        return task

    def add_edge(self, src: str, dst: str, reduction: Reduction | None = None, depends: str | None = None,
                 transport: str | None = None) -> None:
        """dst reads src's output; `depends` names the axis of a tile-level dependency, `transport` how a
        reduction edge's partials cross ranks (module docstring)."""
        for n in (src, dst):
            if n not in self.graph:
                raise GraphError(f"edge {src!r} -> {dst!r}: no task named {n!r}")
        if self.graph.has_edge(src, dst):
            raise GraphError(f"edge {src!r} -> {dst!r} is already in graph {self.name!r} (one edge per pair of tasks)")
        self.graph.add_edge(src, dst, reduction=reduction, depends=depends, transport=transport)

    def transport(self, name: str) -> str | None:
        """How the partials that task `name` merges cross ranks (None: they stay on one GPU)."""
        kinds = {t for _, _, t in self.graph.in_edges(name, data="transport") if t is not None}
        if len(kinds) > 1:
            raise GraphError(f"task {name!r}: its partials arrive by several transports {sorted(kinds)}")
        return next(iter(kinds), None)

    @property
    def tasks(self) -> list[TaskTemplate]:
        return [self.graph.nodes[n]["task"] for n in nx.topological_sort(self.graph)]

    def task(self, name: str) -> TaskTemplate:
        return self.graph.nodes[name]["task"]

    def producers(self, name: str) -> list[TaskTemplate]:
        """The tasks whose partials task `name` merges (edges carrying its reduction), in the order they were
        added to the graph: the order their parts merge in."""
        feeding = {s for s, _, r in self.graph.in_edges(name, data="reduction") if r is not None}
        return [self.task(n) for n in self.graph.nodes if n in feeding]

    def validate(self) -> TaskGraph:
        if not nx.is_directed_acyclic_graph(self.graph):
            raise GraphError(f"graph {self.name!r} has a cycle")
        for t in self.tasks:
            if t.kind not in TASK_KINDS:
                raise GraphError(f"task {t.name!r}: kind {t.kind!r} is not one of {TASK_KINDS}")
            names = {a.name for a in t.domain}
            if len(names) != len(t.domain):
                raise GraphError(f"task {t.name!r}: repeated axis in domain {t.domain}")
            if any(a.dynamic and not isinstance(a.extent, str) for a in t.domain):
                raise GraphError(f"task {t.name!r}: a dynamic axis needs a symbolic extent, got {t.domain}")
            if not set(t.affinity) <= names:
                raise GraphError(f"task {t.name!r}: affinity {t.affinity} names axes outside its domain")
            if t.reduction is not None and t.reduction.combiner not in COMBINERS:
                raise GraphError(f"task {t.name!r}: unknown combiner {t.reduction.combiner!r}")
            if t.kind == "split_reduce" and (t.range_axis is None or t.reduction is None):
                raise GraphError(f"task {t.name!r}: a split_reduce task needs a range axis and a reduction")
            if t.kind == "split_reduce" and t.reduction.axis != t.range_axis.name:
                raise GraphError(f"task {t.name!r}: reduces {t.reduction.axis!r}, not its range axis")
            if t.kind == "combine" and (t.reduction is None or t.range_axis is not None):
                raise GraphError(f"task {t.name!r}: a combine task needs a reduction and no range axis")
            if t.kind in ("map", "tile") and (t.reduction is not None or t.range_axis is not None):
                raise GraphError(f"task {t.name!r}: a {t.kind} task has no range axis and no reduction")
        for src, dst, data in self.graph.edges(data=True):
            self._check_edge(src, dst, data["reduction"], data["depends"], data["transport"])
        for t in self.tasks:
            if t.kind == "combine" and not any(d["reduction"] == t.reduction
                                               for _, _, d in self.graph.in_edges(t.name, data=True)):
                raise GraphError(f"task {t.name!r}: no incoming edge brings the partials it merges")
        return self

    def _check_edge(self, src: str, dst: str, red: Reduction | None, depends: str | None,
                    transport: str | None) -> None:
        s, d = self.task(src), self.task(dst)
        where = f"edge {src!r} -> {dst!r}"
        if transport is not None and (red is None or transport not in TRANSPORTS):
            raise GraphError(f"{where}: transport {transport!r} needs a reduction edge and one of {TRANSPORTS}")
        if red is not None and (d.kind != "combine" or d.reduction != red):
            raise GraphError(f"{where}: reduction {red} is not the one {dst!r} merges ({d.reduction})")
        if red is not None and s.reduction not in (None, red):
            raise GraphError(f"{where}: reduction {red} differs from {src!r}'s")
        if depends is None:
            return
        src_axes, dst_axes = [a.name for a in s.domain], [a.name for a in d.domain]
        if depends not in src_axes or depends not in dst_axes:
            raise GraphError(f"{where}: depends on axis {depends!r}, which is not in both domains "
                             f"({src_axes} and {dst_axes})")
        src_pre, dst_pre = s.domain[:src_axes.index(depends) + 1], d.domain[:dst_axes.index(depends) + 1]
        if src_pre != dst_pre:
            raise GraphError(f"{where}: depends on {depends!r}, but the domains differ up to it: "
                             f"{src_pre} vs {dst_pre}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "attrs": dict(sorted(self.attrs.items())),
            "tasks": [t.to_dict() for t in self.tasks],
            "edges": [self._edge_dict(s, d, r) for s, d, r in sorted(self.graph.edges(data=True))],
        }

    @staticmethod
    def _edge_dict(src: str, dst: str, data: dict[str, Any]) -> dict[str, Any]:
        """`depends` and `transport` are written only when set, so graphs without them keep their old JSON."""
        red = data["reduction"]
        edge = {"src": src, "dst": dst, "reduction": asdict(red) if red else None}
        return edge | {k: data[k] for k in ("depends", "transport") if data[k] is not None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> TaskGraph:
        """The graph `to_json` wrote, validated; GraphError for anything else."""
        d = serial.document(text, "a TaskGraph", GraphError, ("name", "attrs", "tasks", "edges"))
        if not isinstance(d["attrs"], dict):
            raise GraphError(f"attrs must be a JSON object, got {type(d['attrs']).__name__}")
        g = TaskGraph(serial.text(d["name"], "name", GraphError), dict(d["attrs"]))
        for name in ("tasks", "edges"):
            if not isinstance(d[name], list):
                raise GraphError(f"{name} must be a list, got {type(d[name]).__name__}")
        for i, t in enumerate(d["tasks"]):
            g.add_task(_task(t, f"tasks[{i}]"))
        for i, e in enumerate(d["edges"]):
            where = f"edges[{i}]"
            e = serial.fields(e, where, GraphError, ("src", "dst", "reduction"), ("depends", "transport"))
            depends, transport = e.get("depends"), e.get("transport")
            g.add_edge(serial.text(e["src"], f"{where}.src", GraphError), serial.text(e["dst"], f"{where}.dst", GraphError),
                       _reduction(e["reduction"], f"{where}.reduction"),
                       None if depends is None else serial.text(depends, f"{where}.depends", GraphError),
                       None if transport is None else serial.text(transport, f"{where}.transport", GraphError))
        return g.validate()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskGraph) and self.to_dict() == other.to_dict()

    def __str__(self) -> str:
        lines = [f"TaskGraph {self.name} {self.attrs}"]
        for t in self.tasks:
            dom = ", ".join(f"{a.name}<{a.extent}>" for a in t.domain)
            rng = f" over {t.range_axis.name}<{t.range_axis.extent}>" if t.range_axis else ""
            red = f" reduce {t.reduction.combiner}" if t.reduction else ""
            lines.append(f"  {t.name}: {t.kind} [{dom}]{rng}{red} affinity={list(t.affinity)}")
        for s, d, data in self.graph.edges(data=True):
            lines.append(f"  {s} -> {d}" + "".join(f" {k}={data[k]}" for k in ("depends", "transport")
                                                   if data[k] is not None))
        return "\n".join(lines)
