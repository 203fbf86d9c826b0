"""Work tables declared once: the contract between the planners (NumPy and CUDA), the kernels, the CPU
reference executor and the profiler. Like `ParamStruct` for parameters, one declaration gives the C
accessors generated into the kernels' source and the host-side layout, so a field cannot sit at one
index in a planner and another in a kernel.

One task layout, one event layout (Mirage MPK's task/event contract; templates/events.cuh counts them):
- `TASK`: a row per task, in the order the CTAs walk them. A header every family shares: its `kind` (the
  body that runs it), the `cta` that runs it, the range it covers, from (`first`, `begin`) to before
  (`last`, `end`) in (item, offset) coordinates, its partial `slot` (-1: none, or derived by the kind), and
  the events it arrives at, `event_first` .. `event_first + event_count - 1`; then `arg0`..`arg3`, the
  kind's own arguments (MPK's per-kind metadata union). A family reads it through a *view*: the same
  layout under its own names (its C struct), with its kind.
- `EVENT`: a row per event (a combine point): the `parts` that arrive at it and where their slots are listed
  (`part_first`). The arrival that brings its count to `parts` fires its combine.

The views:
- `CTA_TABLE` (decode, MLA: kind SEGMENT): one row per CTA, its segment of the line of units (the items;
  meld/ir/schedule.py): from (u_begin, s_begin) to before (u_end, s_end). Its events are the units it
  touches (event u counts unit u's pieces). Only a unit split at the segment's start (head) or end (tail)
  is counted, and its event row rides in the task row (head_first/head_parts, tail_first/tail_parts: the
  parts' first slot relative to the unit, and their number), so the walk loads one row per CTA and no
  event row. Its slots are derived (unit + cta): `slot` is -1.
- `SPLIT_TASK` (grouped attention: kind PIECE): a piece [kv_begin, kv_end) of one group (an item of
  producer `producer`) for one kv head, its partials from `slot` on; its events (a request and kv head
  each) are in `EVENT`, their parts' slots in the part-slot list.
- `TP_PIECE` (the row-parallel linear: kind TP_PIECE): a piece of output tile `tile` (column block `col`,
  first token `tok0`) over K stages [k0, k1) (its split `split`), its partial's slot among its CTA's
  (every-rank merges), and its tile's merge event: `EVENT` row `tile`, world x k_splits parts, the pieces
  from `part_first` (the tile's first) on of every rank, in (rank, split) order. The kernel loads a row per
  piece; the merges count on their own counters (templates/tp_linear.cuh).
- `MOE_TILE` (fused MoE: kind MOE_TILE): a GEMM tile, one row per ticket, in ticket order: column blocks
  [col, col_end) (one) of one row block (last_row_block = row_block; the items, `ROW_BLOCKS`), `gemm` 0 or
  1. Event r is row block r (its `rb_done` counter): a gemm1 tile arrives at it, a gemm2 tile waits for it.
  It counts the row block's n1 gemm1 tiles, a per-launch constant, so MoE has no `EVENT` rows. Its slots
  are derived (the row block's rows of act and y): `slot` is -1. CTAs take rows by ticket as they go, so no
  row names its CTA: `cta` is -1. (The token combines' counters, a token's per column block of H, are
  reached through a gemm2 tile's rows' tokens, not named in its row.)
The header's fields come after the segment's eight, at indices that keep the decode walk's loads where
they were (field-major: field f of entry i at f * count + i).

A `Table` is int32 entries of named fields, stored field-major (field f of entry i at f * count + i, so a warp
reading one field of consecutive entries coalesces) or entry-major (i * width + f).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Table:
    name: str                 # the C struct of one entry
    fields: tuple[str, ...]
    field_major: bool = True
    kind: int | None = None   # a view's task kind (TASK_KINDS)

    def view(self, name: str, kind: str, **names: str) -> "Table":
        """This layout under a family's names (`names`: field -> its name there) for tasks of `kind`."""
        unknown = set(names) - set(self.fields)
        if unknown:
            raise TypeError(f"{name}: {sorted(unknown)} are not fields of {self.name}")
        return Table(name, tuple(names.get(f, f) for f in self.fields), self.field_major, TASK_KINDS[kind])

    @property
    def width(self) -> int:
        return len(self.fields)

    @property
    def max_entries(self) -> int:
        """The most entries a table can hold: the C accessors index it with an int (the last index,
        width * count - 1, fits an int32)."""
        return 2 ** 31 // self.width

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
        kind = f"constexpr int {up}_TASK_KIND = {self.kind};\n" if self.kind is not None else ""
        return (f"struct {self.name} {{ int {', '.join(self.fields)}; }};\n{ids}\n{kind}"
                f"__device__ __forceinline__ {self.name} load_{low}(const int* t, int count, int i) {{\n"
                f"  auto at = [&](int f) {{ return {at}; }};\n  {self.name} e; {loads}\n  return e;\n}}\n"
                f"__device__ __forceinline__ void store_{low}(int* t, int count, int i, const {self.name}& e) {{\n"
                f"  auto at = [&](int f) {{ return {at}; }};\n  {stores}\n}}\n")


# The one task layout and the one event layout (the module docstring).
TASK_KINDS = {"segment": 0, "piece": 1, "tp_piece": 2, "moe_tile": 3}
TASK = Table("Task", ("first", "begin", "last", "end", "arg0", "arg1", "arg2", "arg3", "kind", "cta", "slot",
                      "event_first", "event_count"))
EVENT = Table("Event", ("parts", "part_first"))

# Decode and MLA attention: one segment of work per CTA (meld/ir/schedule.py explains the fields).
CTA_TABLE = TASK.view("CtaRow", "segment", first="u_begin", begin="s_begin", last="u_end", end="s_end",
                      arg0="head_first", arg1="head_parts", arg2="tail_first", arg3="tail_parts")

# Grouped attention (templates/grouped_attention.cuh; the CPU executor, meld/runtime/reference.py): a piece of
# a producer's group for one kv head, covering (group, kv_begin) to (last_group = group, kv_end); its
# requests' events are consecutive (h * batch + the group's first request ..), their parts' slots listed in
# merge order (part_slot[part_first ..]). `pages`: where the group's page list starts in the producers' lists
# laid one after another (the kernel's kv_indices), so a task's first lookup needs no table but its row.
SPLIT_TASK = TASK.view("SplitTask", "piece", first="group", begin="kv_begin", last="last_group", end="kv_end",
                       arg0="producer", arg1="kv_head", arg2="pages")

# The row-parallel linear (templates/tp_linear.cuh; meld.codegen.tp_kernel.TpSchedule.tasks plans it): a piece
# of output tile `tile` over K stages [k0, k1), its range (tile, k0) to before (last_tile = tile, k1).
TP_PIECE = TASK.view("TpPiece", "tp_piece", first="tile", begin="k0", last="last_tile", end="k1",
                     arg0="split", arg1="col", arg2="tok0")

# Fused MoE (templates/moe.cuh; the plan: templates/moe_plan.h, meld/scheduler/moe_plan.py). Its items: a row
# block is up to BLOCK_TOKENS rows of one expert. An item table, not a view of TASK: a tile's producer and
# consumers each read a row block's three fields together, so its rows are entry-major (one 16-byte row).
ROW_BLOCKS = Table("RowBlock", ("expert", "first_row", "rows", "pad"), field_major=False)
# Its tiles in ticket order (`MOE_TILE` above): gemm 0 computes act for columns [col, col_end) of I, gemm 1 y for
# those of H. The row's event is its row block's (event_first = row_block, event_count = 1), so the kernel reads
# row_block for both and loads three fields of a row: gemm, row_block, col. Split K (templates/moe_plan.h): the
# tile is K slice `slice` of `slices` (0 and 0 in a plan without split K).
MOE_TILE = TASK.view("MoeTile", "moe_tile", first="row_block", begin="col", last="last_row_block", end="col_end",
                     arg0="gemm", arg1="slice", arg2="slices")
