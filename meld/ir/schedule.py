"""The runtime schedule: struct-of-arrays work tables the persistent kernel walks.

The work of decode attention comes in *units*, one per (request, q-head block), laid end to end in
request order. `meld.scheduler.plan_decode` cuts that line into one contiguous *segment* per CTA; a
segment starts at (unit u_begin, token s_begin) and ends before (u_end, s_end). A unit cut by a segment
boundary is *split*: each of its pieces writes a partial into slot `unit + cta` (unique, and contiguous
for the pieces of one unit, because along the line unit + cta only grows), and the CTA that completes
the unit last merges them (a per-unit counter: last-arriver-does-the-work). The head/tail columns tell
a CTA how many pieces the split unit at its start/end has, and where they begin.

All arrays are int32 and laid out exactly as the kernel reads them, so uploading a schedule is one copy.
`items()` expands the segments into explicit (unit, range) items for validation, the CPU reference
executor and printing; the kernel never needs that form.

Batch-invariant schedules (`chunk_tokens` > 0) split by a rule that depends on a request's length
alone: a unit of L > chunk_tokens tokens is always cut into its ceil(L / chunk_tokens) chunks, each its
own piece, even where several run on one CTA, so its result does not depend on the rest of the batch.
Segments then start and end on chunk boundaries, the head/tail columns are unused (zero), and the
pieces of request b's units take the slots from `slot_base[b]` on (unit after unit, chunk after chunk).

Head-major schedules (`head_major`, DecodeMLA's) lay the units out head block by head block instead: unit u is
head block u // B of request u % B (B requests), so the same tokens of a request's two 64-head units are cut at
the same place of the line's two halves, and CTAs W / 2 apart read them together (templates/decode_plan.h).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np

from . import serial
from .work_table import CTA_TABLE

CTA_FIELDS = CTA_TABLE.fields   # one row per field, one column per CTA (meld/ir/work_table.py)
SEGMENT_FIELDS = CTA_FIELDS[:8]  # the segment; then the task header that follows from it (segment_header)
_KEYS = ("num_kv_heads", "group_size", "heads_per_item", "kv_len", "page_base", "cta", "meta")
_OPTIONAL = ("chunk_tokens", "head_major")


def unit_request(unit, requests: int, units_per_request: int, head_major: bool):
    """(request, index of the unit within its request) of a unit number or an array of them. Head-major plans
    number a request's units `requests` apart (unit = index * requests + request), so that the CTAs running one
    request's head blocks read its KV together; the others number them request by request."""
    return (unit % requests, unit // requests) if head_major else (unit // units_per_request, unit % units_per_request)


def segment_header(cta: np.ndarray) -> np.ndarray:
    """The task-header rows (kind, cta, slot, event_first, event_count: meld/ir/work_table.py) of the
    segments in `cta`'s first rows: a segment's slots are derived (unit + cta), and the events it may arrive
    at are the units it touches (none for an empty segment)."""
    ub, sb, ue, se = cta[:4].astype(np.int64)
    touched = np.where((ub == ue) & (sb == se), 0, np.where(se > 0, ue, ue - 1) - ub + 1)
    head = {"kind": np.full_like(ub, CTA_TABLE.kind), "cta": np.arange(len(ub)), "slot": np.full_like(ub, -1),
            "event_first": ub, "event_count": touched}
    return np.stack([head[f] for f in CTA_FIELDS[len(SEGMENT_FIELDS):]]).astype(np.int32)


class ScheduleError(ValueError):
    """A schedule that would make the kernel read or write out of bounds, or compute a wrong answer."""


@dataclass
class Schedule:
    """Work tables for one batch.

    Attributes:
        num_kv_heads, group_size: the attention shape (q heads per kv head = group_size).
        heads_per_item: q heads one unit computes; a kv head has ceil(group_size / heads_per_item) units.
        kv_len: int32 [B] KV tokens per request.
        page_base: int32 [B] first page of each request in kv_indices (kv_indptr[:-1]).
        cta: int32 [len(CTA_FIELDS), num_ctas]; CTAs past the active ones have empty segments.
        meta: what the planner decided besides the tables (active CTAs, cost model), for printing.
        chunk_tokens: 0, or the chunk of a batch-invariant schedule (above).
        head_major: the units' order (above); never with chunk_tokens.
    """

    num_kv_heads: int
    group_size: int
    heads_per_item: int
    kv_len: np.ndarray
    page_base: np.ndarray
    cta: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    chunk_tokens: int = 0
    head_major: bool = False

    @property
    def num_ctas(self) -> int:
        return self.cta.shape[1]

    @property
    def head_blocks(self) -> int:
        return -(-self.group_size // self.heads_per_item)

    @property
    def units_per_request(self) -> int:
        return self.num_kv_heads * self.head_blocks

    @property
    def num_units(self) -> int:
        return len(self.kv_len) * self.units_per_request

    def unit_lengths(self) -> np.ndarray:
        """int64 [num_units]: each unit's KV tokens (its request's), in unit order."""
        L = self.kv_len.astype(np.int64)
        return np.tile(L, self.units_per_request) if self.head_major else np.repeat(L, self.units_per_request)

    def unit_request(self, unit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(request, unit index within its request) of each unit."""
        return unit_request(unit, len(self.kv_len), self.units_per_request, self.head_major)

    @property
    def chunks(self) -> np.ndarray:
        """Pieces per unit of each request in a batch-invariant schedule: max(1, ceil(kv_len / chunk))."""
        return np.maximum(1, -(-self.kv_len.astype(np.int64) // self.chunk_tokens))

    @property
    def _chunk_slots(self) -> np.ndarray:
        """Partial slots per request of a batch-invariant schedule: one per piece of each unit, for the
        requests of more than one chunk."""
        return np.where(self.chunks > 1, self.chunks, 0) * self.units_per_request

    @property
    def slot_base(self) -> np.ndarray:
        """int32 [B]: the first partial slot of each request's pieces (batch-invariant schedules)."""
        per_request = self._chunk_slots
        return (np.cumsum(per_request) - per_request).astype(np.int32)

    @property
    def num_slots(self) -> int:
        """Partial slots the kernel may address: slot = unit + cta < num_units + num_ctas, or with
        chunks, one per piece of every unit split into chunks."""
        if self.chunk_tokens:
            return int(self._chunk_slots.sum())
        return self.num_units + self.num_ctas

    def items(self) -> dict[str, np.ndarray]:
        """The segments as explicit items, in the order the CTAs run them (what the kernel derives)."""
        ub, sb, ue, se, hf, hp, tf, tp = (r.astype(np.int64) for r in self.cta[:len(SEGMENT_FIELDS)])
        L = self.unit_lengths()
        last = np.where(se > 0, ue, ue - 1)                      # last unit touched by each segment
        n = np.maximum(last - ub + 1, 0)
        n[(ub == ue) & (sb == se)] = 0                           # empty segment
        cta = np.repeat(np.arange(self.num_ctas), n)
        unit = np.repeat(ub, n) + np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        first, final = unit == ub[cta], unit == last[cta]
        begin = np.where(first, sb[cta], 0)
        end = np.where(final & (se[cta] > 0), se[cta], L[unit] if len(L) else unit)
        head = first & (sb[cta] > 0)
        tail = final & (se[cta] > 0) & ~head
        split = head | tail
        pbegin = np.where(head, unit + hf[cta], np.where(tail, unit + tf[cta], -1))
        nparts = np.where(head, hp[cta], np.where(tail, tp[cta], 0))
        nqb, H = self.head_blocks, self.heads_per_item
        if self.chunk_tokens:
            cta, unit, begin, end, split, pbegin, nparts = self._chunk_pieces(cta, unit, begin, end)
        req, within = self.unit_request(unit)
        kvh = within // nqb
        q_head = kvh * self.group_size + (within % nqb) * H
        slot = np.where(split, pbegin + begin // self.chunk_tokens if self.chunk_tokens else unit + cta, -1)
        return {
            "cta": cta, "unit": unit, "req": req, "kv_head": kvh, "q_head": q_head,
            "rows": np.minimum(H, (kvh + 1) * self.group_size - q_head),
            "kv_begin": begin, "kv_end": end, "slot": slot,
            "parts_begin": pbegin, "num_parts": nparts,
        }

    def _chunk_pieces(self, cta, unit, begin, end):
        """Batch-invariant schedules: each item cut at every chunk boundary; a unit of n > 1 chunks has n
        pieces (slots slot_base[req] + head block * n + chunk), a unit of one chunk is whole."""
        c = self.chunk_tokens
        k0 = begin // c
        count = np.maximum(k0, (end - 1) // c) - k0 + 1          # an empty unit is one (empty) piece
        rep = lambda a: np.repeat(a, count)                      # noqa: E731
        k = rep(k0) + np.arange(count.sum()) - rep(np.cumsum(count) - count)
        cta, unit = rep(cta), rep(unit)
        begin, end = np.maximum(rep(begin), k * c), np.minimum(rep(end), (k + 1) * c)
        req = unit // self.units_per_request
        n = self.chunks[req]
        pbegin = self.slot_base[req].astype(np.int64) + (unit % self.units_per_request) * n
        split = n > 1
        return cta, unit, begin, end, split, np.where(split, pbegin, -1), np.where(split, n, 0)

    def validate(self) -> "Schedule":
        """Check every invariant the kernel relies on; raise ScheduleError naming the first broken one."""
        U, W = self.num_units, self.num_ctas
        if self.head_major and self.chunk_tokens:
            raise ScheduleError("a head-major schedule cuts no chunks (its slots are numbered request by request)")
        if self.cta.shape != (len(CTA_FIELDS), W) or len(self.page_base) != len(self.kv_len):
            raise ScheduleError(f"table shapes: cta {self.cta.shape}, kv_len {self.kv_len.shape}, "
                                f"page_base {self.page_base.shape}")
        ub, sb, ue, se = self.cta[:4].astype(np.int64)
        if np.any(ub < 0) or np.any(ue > U) or np.any(ub > ue) or np.any((ub == ue) & (sb > se)):
            raise ScheduleError("a segment runs backwards or outside [0, num_units]")
        if ub[0] != 0 or sb[0] != 0 or np.any(ub[1:] != ue[:-1]) or np.any(sb[1:] != se[:-1]):
            raise ScheduleError("segments are not contiguous from (0, 0)")
        if (ue[-1], se[-1]) != (U, 0):
            raise ScheduleError(f"segments end at ({ue[-1]}, {se[-1]}), not ({U}, 0)")
        wrong = np.flatnonzero((self.cta[len(SEGMENT_FIELDS):] != segment_header(self.cta)).any(axis=1))
        if len(wrong):
            raise ScheduleError(f"task header {CTA_FIELDS[len(SEGMENT_FIELDS) + wrong[0]]} does not match the segments")
        if U == 0:
            return self
        it = self.items()
        L = self.unit_lengths()
        if np.any(it["kv_begin"] < 0) or np.any(it["kv_end"] > L[it["unit"]]) or np.any(it["kv_end"] < it["kv_begin"]):
            raise ScheduleError("an item's KV range lies outside [0, kv_len)")
        u, b, e = it["unit"], it["kv_begin"], it["kv_end"]      # ordered by (unit, begin) by construction
        if len(np.unique(u)) != U or (U and (u[0] != 0 or np.any(np.diff(u) < 0))):
            raise ScheduleError("some unit has no item, or items are out of order")
        first = np.r_[True, u[1:] != u[:-1]]
        last = np.r_[u[1:] != u[:-1], True]
        if np.any(b[first] != 0) or np.any(e[last] != L[u[last]]):
            raise ScheduleError("a unit's items do not start at token 0 and end at kv_len")
        if np.any(b[~first] != e[np.flatnonzero(~first) - 1]) or np.any((e == b) & ~(first & last)):
            raise ScheduleError("a unit's items overlap, leave a gap, or include an empty piece")
        # Split units: every piece knows the same contiguous slots, one per piece, in order.
        split = ~(first & last)
        if np.any((it["slot"] >= 0) != split):
            raise ScheduleError("pieces of split units need a slot, whole units none")
        run = np.cumsum(first) - 1
        count = np.bincount(run)[run]
        if np.any(it["num_parts"][split] != count[split]):
            raise ScheduleError("a piece's part count differs from its unit's number of pieces")
        start = it["slot"][first][run]
        if np.any(it["parts_begin"][split] != start[split]) or np.any(np.diff(it["slot"][split]) <= 0):
            raise ScheduleError("a split unit's slots are not contiguous from its parts_begin")
        if split.any() and (it["slot"][split].max() >= self.num_slots or np.any(it["slot"][split] !=
                                                                               start[split] + (np.arange(len(u)) - np.flatnonzero(first)[run])[split])):
            raise ScheduleError("a slot lies outside the partial buffer or out of sequence")
        return self

    def merge_paths(self, cluster_of_cta: Sequence[int] | None = None) -> dict[str, int]:
        """How the split units merge when CTA row c runs in cluster `cluster_of_cta[c]` (default: no
        clusters): a unit whose pieces all ran in one cluster merges on chip, any other through global
        memory. Returns counts of split units and pieces per path, and the partial rows (q heads) the
        global-memory pieces write (x (head_dim + 1) x 4 bytes each)."""
        it = self.items()
        split = it["slot"] >= 0
        first = it["parts_begin"] - it["unit"]                  # CTA of the unit's first piece
        last = first + it["num_parts"] - 1
        cl = np.arange(self.num_ctas) if cluster_of_cta is None else np.asarray(cluster_of_cta)
        onchip = split & (cl[np.clip(first, 0, self.num_ctas - 1)] == cl[np.clip(last, 0, self.num_ctas - 1)])
        hbm = split & ~onchip
        starts = it["cta"] == first
        return {"split_units": int((split & starts).sum()), "onchip_units": int((onchip & starts).sum()),
                "onchip_pieces": int(onchip.sum()), "hbm_pieces": int(hbm.sum()),
                "hbm_partial_rows": int(it["rows"][hbm].sum())}

    def cta_cost(self, item_overhead_tokens: int = 0) -> np.ndarray:
        """Predicted cost per CTA in KV tokens (+ a fixed cost per item)."""
        it = self.items()
        return np.bincount(it["cta"], weights=it["kv_end"] - it["kv_begin"] + item_overhead_tokens,
                           minlength=self.num_ctas)

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: (v.tolist() if isinstance(v := getattr(self, f.name), np.ndarray) else v)
                for f in fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> "Schedule":
        """The schedule `to_json` wrote, validated; ScheduleError for anything else."""
        return Schedule.from_dict(serial.document(text, "a Schedule", ScheduleError, _KEYS, _OPTIONAL))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Schedule":
        """The schedule `to_dict` gave, validated; ScheduleError for anything else."""
        d = serial.fields(d, "a Schedule", ScheduleError, _KEYS, _OPTIONAL)
        if not isinstance(d.get("head_major", False), bool):
            raise ScheduleError(f"head_major must be true or false, got {d['head_major']!r}")
        heads = {k: serial.integer(d[k], k, ScheduleError, 1) for k in ("num_kv_heads", "group_size", "heads_per_item")}
        if not isinstance(d["meta"], dict):
            raise ScheduleError(f"meta must be a JSON object, got {type(d['meta']).__name__}")
        cta = serial.int32_array(d["cta"], "cta", ScheduleError, ndim=2)
        if cta.shape[0] != len(CTA_FIELDS) or cta.shape[1] == 0:
            raise ScheduleError(f"cta must have {len(CTA_FIELDS)} rows ({', '.join(CTA_FIELDS)}) of one entry per "
                                f"CTA, got shape {cta.shape}")
        kv_len = serial.int32_array(d["kv_len"], "kv_len", ScheduleError)
        if np.any(kv_len < 0):
            raise ScheduleError(f"kv_len must not be negative, got {int(kv_len.min())}")
        return Schedule(**heads, kv_len=kv_len, page_base=serial.int32_array(d["page_base"], "page_base", ScheduleError),
                        cta=cta, meta=d["meta"],
                        chunk_tokens=serial.integer(d.get("chunk_tokens", 0), "chunk_tokens", ScheduleError, 0),
                        head_major=d.get("head_major", False)).validate()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.to_dict() == other.to_dict()

    def __str__(self) -> str:
        it = self.items()
        busy = len(np.unique(it["cta"]))
        splits = int((it["slot"] >= 0).sum())
        cost = self.cta_cost(self.meta.get("item_overhead_tokens", 0))[:max(busy, 1)]
        return (f"Schedule: {len(self.kv_len)} requests x {self.units_per_request} head units, "
                f"{len(it['unit'])} items on {busy}/{self.num_ctas} CTAs, "
                f"{len(np.unique(it['unit'][it['slot'] >= 0]))} split units ({splits} partials), "
                f"predicted balance max/mean {cost.max() / max(cost.mean(), 1e-9):.3f}")
