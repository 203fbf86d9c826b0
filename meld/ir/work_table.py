"""Work tables declared once: the contract between the planners (NumPy and CUDA), the kernels, the CPU
reference executor and the profiler. Like `ParamStruct` for parameters, one declaration gives the C
accessors generated into the kernels' source and the host-side layout, so a field cannot sit at one
index in a planner and another in a kernel.

Two shapes cover meld's tables:
- `Table`: int32 entries of named fields, stored field-major (field f of entry i at f * count + i, so a
  warp reading one field of consecutive entries coalesces) or entry-major (i * width + f).
- `PackedWord`: small fields packed into one int32 (a task descriptor in a ticket list).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Table:
    name: str                 # the C struct of one entry
    fields: tuple[str, ...]
    field_major: bool = True

    @property
    def width(self) -> int:
        return len(self.fields)

    def index(self, field: str, entry: int, count: int) -> int:
        """Flat int32 index of `field` of `entry` in a table of `count` entries."""
        f = self.fields.index(field)
        return f * count + entry if self.field_major else entry * self.width + f

    def pack(self, count: int, **columns: np.ndarray) -> np.ndarray:
        """The flat int32 table of `count` entries from one array per field."""
        if set(columns) != set(self.fields):
            raise TypeError(f"{self.name}: fields {sorted(columns)} given, {sorted(self.fields)} declared")
        t = np.stack([np.broadcast_to(np.asarray(columns[f], dtype=np.int32), (count,)) for f in self.fields])
        return (t if self.field_major else t.T).reshape(-1).copy()

    def unpack(self, flat: np.ndarray, count: int) -> dict[str, np.ndarray]:
        t = np.asarray(flat)[: count * self.width]
        t = t.reshape(self.width, count) if self.field_major else t.reshape(count, self.width).T
        return {f: t[i] for i, f in enumerate(self.fields)}

    def c_source(self) -> str:
        """`struct Name`, its field indices (NAME_FIELD) and load/store of one entry."""
        up, low = self.name.upper(), self.name.lower()
        ids = "\n".join(f"constexpr int {up}_{f.upper()} = {i};" for i, f in enumerate(self.fields))
        at = "f * count + i" if self.field_major else f"i * {self.width} + f"
        loads = " ".join(f"e.{f} = t[at({up}_{f.upper()})];" for f in self.fields)
        stores = " ".join(f"t[at({up}_{f.upper()})] = e.{f};" for f in self.fields)
        return (f"struct {self.name} {{ int {', '.join(self.fields)}; }};\n{ids}\n"
                f"__device__ __forceinline__ {self.name} load_{low}(const int* t, int count, int i) {{\n"
                f"  auto at = [&](int f) {{ return {at}; }};\n  {self.name} e; {loads}\n  return e;\n}}\n"
                f"__device__ __forceinline__ void store_{low}(int* t, int count, int i, const {self.name}& e) {{\n"
                f"  auto at = [&](int f) {{ return {at}; }};\n  {stores}\n}}\n")


@dataclass(frozen=True)
class PackedWord:
    name: str
    fields: tuple[tuple[str, int], ...]   # (name, bits), low bits first

    def __post_init__(self) -> None:
        if sum(b for _, b in self.fields) > 31:
            raise ValueError(f"{self.name}: {sum(b for _, b in self.fields)} bits do not fit a non-negative int32")

    def _shifts(self) -> list[tuple[str, int, int]]:
        out, shift = [], 0
        for f, bits in self.fields:
            out.append((f, shift, bits))
            shift += bits
        return out

    def pack(self, **values: np.ndarray) -> np.ndarray:
        word = 0
        for f, shift, bits in self._shifts():
            v = np.asarray(values[f], dtype=np.int64)
            if np.any((v < 0) | (v >= 1 << bits)):
                raise ValueError(f"{self.name}.{f}: values outside 0..{(1 << bits) - 1}")
            word = word | (v << shift)
        return np.asarray(word, dtype=np.int64)

    def limit(self, field: str) -> int:
        """One past the largest value `field` can hold."""
        return 1 << dict(self.fields)[field]

    def c_source(self) -> str:
        low = self.name.lower()
        args = ", ".join(f"int {f}" for f, _ in self.fields)
        expr = " | ".join(f"({f} << {s})" for f, s, _ in self._shifts())
        gets = " ".join(f"w.{f} = (v >> {s}) & {(1 << b) - 1};" for f, s, b in self._shifts())
        return (f"struct {self.name} {{ int {', '.join(f for f, _ in self.fields)}; }};\n"
                f"__device__ __forceinline__ int pack_{low}({args}) {{ return {expr}; }}\n"
                f"__device__ __forceinline__ {self.name} unpack_{low}(int v) {{ {self.name} w; {gets} return w; }}\n")


# Decode attention: one segment of work per CTA (meld/ir/schedule.py explains the fields).
CTA_TABLE = Table("CtaRow", ("u_begin", "s_begin", "u_end", "s_end", "head_first", "head_parts", "tail_first",
                             "tail_parts"))

# Fused MoE (templates/moe.cuh): row blocks of one expert's rows, and the tiles in ticket order.
ROW_BLOCKS = Table("RowBlock", ("expert", "first_row", "rows", "pad"), field_major=False)
MOE_TASK = PackedWord("MoeTask", (("kind", 1), ("col", 11), ("row_block", 19)))

# Split-reduce graphs with several producers of partials (templates to come; today the CPU executor,
# meld/runtime/reference.py): one row per task (a piece of a producer's range for one group of requests and
# one kv head), in the order the CTAs walk them, and one row per event (a combine point: a request and kv
# head) with the parts it waits for and where their slots are listed (part_slot[part_first ..], in merge
# order). A task counts its arrival at events event_first .. event_first + event_count - 1; the arrival
# that reaches an event's `parts` fires its combine.
SPLIT_TASK = Table("SplitTask", ("cta", "producer", "group", "kv_head", "kv_begin", "kv_end", "slot", "event_first",
                                 "event_count"))
EVENT = Table("Event", ("parts", "part_first"))
