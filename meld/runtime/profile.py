"""Per-SM timelines of one persistent-kernel launch, from the buffer a MELD_PROFILE build writes.

The kernel's wall time alone cannot say whether SMs sat idle (imbalance, a long tail, merges waiting on
stragglers); a timeline per SM can. Each CTA writes into int64 `raw[cta]` of shape [1 + cap, 4]:

    row 0:      [t_begin_ns, t_end_ns, smid, n_records]    (%globaltimer at start and exit; n may exceed cap)
    rows 1..n:  [t0_ns, t1_ns, kind, unit]                 kind indexes KINDS
                or [-1, cycles, phase, warpgroup]          phase indexes PHASES (a cycle sum, not a task)

A CTA whose header is all zero never ran and is left out. Phase sums come from diagnostic builds that stamp each
block's phases in SM cycles (the global timer is too coarse for them: MlaKernelConfig(phases=True)); a warpgroup
records one sum per phase over its whole segment, so they say where a block's cycles go, not when. The trace converts to Chrome/Perfetto
trace-event JSON (one track per SM) and back, and renders to a PNG with no plotting dependency.
"""
from __future__ import annotations

import json
import numbers
import os
import reprlib
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from .. import jsonfile
from ..ir.schedule import unit_request

# Task kinds of every operator's kernels (a record's kind is its index here): decode attention's, then
# the fused MoE's. Generated kernels take their ids from this tuple (codegen passes them in).
DECODE_KINDS = ("piece", "merge-hbm", "merge-dsmem", "cluster-wait", "merge-wait")
MOE_KINDS = ("gemm1", "gemm2", "combine")
# The row-parallel linear's: a piece's GEMM, its partial staged, sent and stamped (the sender), a merge team
# waiting for a chunk's partials, merging them, and the direct path's exchange and sum.
TP_KINDS = ("tp-gemm", "tp-stage", "tp-send", "tp-wait", "tp-merge", "tp-direct")
KINDS = DECODE_KINDS + MOE_KINDS + TP_KINDS
WORK_KINDS = frozenset(KINDS) - {"cluster-wait", "merge-wait", "tp-wait"}
# Where a warpgroup's cycles go, block by block (the MLA kernel's phase stamps: templates/mla_decode.cuh, MLA_PHASES):
# waiting for a block's KV bytes, for Q, for the other warpgroup's P (or its publication), for its own wgmmas; the
# softmax; the issue of the score warpgroup's own P.V (its wgmmas, P from registers); publishing P; a P.V issued and
# waited for; converting FP8 bytes (and waiting for them or for a stage to convert into); at a unit's end, the two
# warpgroups' meeting (end-sync: the rows' non-finite check, waiting for the other's last P.V), the wait for a split
# unit's other parts (wait-parts), the stores of the output or partial and their fence (store), a sliced merge
# (merge), and the rest of the unit's end (unit-end). "blocks" is no phase: the blocks the warpgroup ran.
PHASES = ("wait-kv", "wait-q", "wait-p", "wait-mma", "softmax", "issue-pv", "publish", "pv", "convert", "wait-raw",
          "end-sync", "wait-parts", "store", "merge", "unit-end", "blocks")


def kind_defines() -> str:
    """`#define PROF_<KIND> <index>` for every kind and `#define PHASE_<PHASE> <index>` for every phase: the ids
    generated kernels record (common.cuh: Profiler)."""
    return "\n".join([f"#define PROF_{k.upper().replace('-', '_')} {i}" for i, k in enumerate(KINDS)]
                     + [f"#define PHASE_{k.upper().replace('-', '_')} {i}" for i, k in enumerate(PHASES)]
                     + [f"#define NUM_PHASES {len(PHASES)}"])  # cluster-wait is an SM held idle at the barrier, not work

IDLE = (36, 36, 44)
COLOURS = {"piece": (66, 133, 244), "merge-hbm": (234, 67, 53), "merge-dsmem": (251, 188, 5),
           "gemm1": (52, 168, 83), "gemm2": (66, 133, 244), "combine": (234, 67, 53),
           "cluster-wait": (150, 150, 150), "merge-wait": (150, 150, 150), "tp-gemm": (52, 168, 83),
           "tp-stage": (171, 71, 188), "tp-send": (0, 172, 193), "tp-wait": (150, 150, 150), "tp-merge": (234, 67, 53),
           "tp-direct": (251, 188, 5)}
STRIP_PX, MARGIN_PX = 8, 10  # busy-fraction strip, then a black gap; the timeline starts at x = MARGIN_PX
BAR_GAP_PX, BAR_PX = 2, 4    # below the SM rows: the occupancy bar over the whole span
# Later paints over: short merges stay visible. The row-parallel kernel's merges and sends run beside its
# GEMMs (other warps): its GEMMs paint over them, which leave the time no GEMM runs.
_PAINT_ORDER = ("cluster-wait", "merge-wait", "tp-wait", "tp-merge", "tp-send", "piece", "gemm1", "gemm2", "tp-stage",
                "tp-gemm", "merge-hbm", "merge-dsmem", "combine", "tp-direct")


@dataclass(frozen=True)
class TaskRecord:
    """One timed task of one CTA."""

    cta: int
    sm: int
    kind: str
    unit: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class PhaseCycles:
    """One warpgroup's cycles in one phase, summed over its CTA's segment."""

    cta: int
    warpgroup: int
    phase: str
    cycles: int


@dataclass(frozen=True)
class CtaSpan:
    """A CTA's lifetime and placement: which SM ran it, its cluster and its launch (grid)."""

    cta: int
    sm: int
    begin_ns: int
    end_ns: int
    cluster: int
    grid: int


@dataclass
class Trace:
    """The tasks and CTA lifetimes of a launch; units decode as (request, kv head, head block), request by request,
    or with `requests` > 0 head block by head block over that many requests (a head-major schedule:
    meld/ir/schedule.py)."""

    tasks: list[TaskRecord]
    cta_spans: list[CtaSpan]
    overflowed: int  # records dropped because a CTA tried to write more than the buffer's capacity
    units_per_request: int
    head_blocks: int
    requests: int = 0
    phases: list[PhaseCycles] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("units_per_request", "head_blocks", "overflowed", "requests"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {reprlib.repr(v)}")
        if self.head_blocks < 1 or self.units_per_request < 1 or self.units_per_request % self.head_blocks:
            raise ValueError(f"units_per_request={self.units_per_request} is not a positive multiple of "
                             f"head_blocks={self.head_blocks}")

    @staticmethod
    def from_buffer(raw: np.ndarray, units_per_request: int, head_blocks: int,
                    cluster: Optional[Sequence[int]] = None, grid: Optional[Sequence[int]] = None,
                    requests: int = 0) -> "Trace":
        """Decode the kernel's buffer; cluster and grid give each CTA's cluster id (default: its own) and launch;
        requests: the planned requests of a head-major schedule (0: units in request order)."""
        raw = np.asarray(raw)
        if raw.ndim != 3 or raw.shape[1] < 1 or raw.shape[2] != 4:
            raise ValueError(f"profile buffer must be [num_ctas, 1 + cap, 4], got {raw.shape}")
        if not np.issubdtype(raw.dtype, np.integer):
            raise ValueError(f"profile buffer must hold integers (the kernel writes int64), got dtype {raw.dtype}")
        n_ctas, cap = raw.shape[0], raw.shape[1] - 1
        for name, ids in (("cluster", cluster), ("grid", grid)):
            if ids is not None and not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"{name} must hold one int per CTA, got {reprlib.repr(ids)}")
        cluster = list(range(n_ctas)) if cluster is None else [int(c) for c in cluster]
        grid = [0] * n_ctas if grid is None else [int(g) for g in grid]
        if len(cluster) != n_ctas or len(grid) != n_ctas:
            raise ValueError(f"cluster and grid need one entry per CTA ({n_ctas})")
        tasks, spans, phases, overflowed = [], [], [], 0
        for c, block in enumerate(raw.tolist()):
            begin, end, sm, n = block[0]
            if not (begin or end or sm or n):
                continue
            spans.append(CtaSpan(c, sm, begin, end, cluster[c], grid[c]))
            overflowed += max(n - cap, 0)
            for t0, t1, kind, unit in block[1:1 + min(max(n, 0), cap)]:
                if t0 == -1:
                    if not 0 <= kind < len(PHASES):
                        raise ValueError(f"CTA {c}: unknown phase {kind} (expected 0..{len(PHASES) - 1})")
                    phases.append(PhaseCycles(c, unit, PHASES[kind], t1))
                    continue
                if not 0 <= kind < len(KINDS):
                    raise ValueError(f"CTA {c}: unknown record kind {kind} (expected 0..{len(KINDS) - 1})")
                tasks.append(TaskRecord(c, sm, KINDS[kind], unit, t0, t1))
        return Trace(tasks, spans, overflowed, units_per_request, head_blocks, requests, phases)

    @property
    def start_ns(self) -> int:
        return min((s.begin_ns for s in self.cta_spans), default=0)

    @property
    def span_ns(self) -> int:
        return max((s.end_ns for s in self.cta_spans), default=0) - self.start_ns

    def sms(self) -> list[int]:
        """Every SM id that ran a CTA, sorted."""
        return sorted({s.sm for s in self.cta_spans} | {t.sm for t in self.tasks})

    def label(self, task: TaskRecord) -> str:
        """The event name, e.g. "piece r3 kv2"; " hb1" is added only when query heads come in several blocks."""
        if task.unit < 0:
            return task.kind
        if task.kind in MOE_KINDS:   # MoE tiles are named by their ticket in the launch
            return f"{task.kind} ticket {task.unit}"
        request, hb = unit_request(task.unit, self.requests, self.units_per_request, bool(self.requests))
        kv, block = divmod(hb, self.head_blocks)
        return f"{task.kind} r{request} kv{kv}" + (f" hb{block}" if self.head_blocks > 1 else "")

    def sm_busy(self) -> dict[int, float]:
        """Per SM: the fraction of the kernel span covered by the union of its work intervals."""
        lo, span = self.start_ns, self.span_ns
        intervals: dict[int, list[tuple[int, int]]] = {sm: [] for sm in self.sms()}
        for t in self.tasks:
            if t.kind in WORK_KINDS:
                intervals[t.sm].append((max(t.start_ns, lo), min(t.end_ns, lo + span)))
        busy = {}
        for sm, ivs in intervals.items():
            covered, reach = 0, lo
            for a, b in sorted(ivs):  # co-resident CTAs overlap on one SM: count each ns once
                a = max(a, reach)
                if b > a:
                    covered, reach = covered + b - a, b
            busy[sm] = covered / span if span > 0 else 0.0
        return busy

    def summary(self) -> str:
        busy = list(self.sm_busy().values())
        grids = len({s.grid for s in self.cta_spans})
        counts = Counter(t.kind for t in self.tasks)
        mean = sum(busy) / len(busy) if busy else 0.0
        overflow = (f"OVERFLOW: {self.overflowed} records dropped (raise the profile capacity)"
                    if self.overflowed else "no overflow")
        return (f"span {self.span_ns / 1e3:.3f} µs, {len(busy)} SMs, {len(self.cta_spans)} CTAs"
                + (f" in {grids} grids" if grids > 1 else "")
                + f", SM busy min {min(busy, default=0.0):.3f} mean {mean:.3f}\n"
                + "tasks: " + ", ".join(f"{k} {counts[k]}" for k in KINDS if k in DECODE_KINDS or counts[k])
                + f"; {overflow}")

    def busy_table(self, least: int = 5) -> str:
        """Where the idle time is: the low end of the per-SM busy distribution and the SMs that make it."""
        busy = self.sm_busy()
        if not busy:
            return "SM busy: no SMs"
        v = np.fromiter(busy.values(), dtype=np.float64)
        worst = sorted(busy, key=lambda sm: (busy[sm], sm))[:least]
        return (f"SM busy: min {v.min():.3f}  p10 {np.percentile(v, 10):.3f}  median {np.median(v):.3f}  "
                f"max {v.max():.3f}\nleast busy: " + ", ".join(f"SM {sm} {busy[sm]:.3f}" for sm in worst))

    def _phase_sums(self) -> dict[int, dict[int, dict[str, int]]]:
        """warpgroup -> CTA -> phase -> cycles, for the CTAs where the warpgroup ran blocks (warpgroups in order)."""
        sums: dict[int, dict[int, dict[str, int]]] = {}
        for x in self.phases:
            sums.setdefault(x.warpgroup, {}).setdefault(x.cta, {})[x.phase] = x.cycles
        per = {wg: {c: d for c, d in by.items() if d.get("blocks", 0) > 0} for wg, by in sorted(sums.items())}
        return {wg: by for wg, by in per.items() if by}

    def phase_table(self) -> str:
        """Cycles a block in each phase, per warpgroup: the median over CTAs of each CTA's sum over its blocks
        (a diagnostic build's phase stamps; "no phase stamps" without them)."""
        if not self.phases:
            return "no phase stamps"
        lines = []
        for wg, by_cta in self._phase_sums().items():
            per = list(by_cta.values())
            cells = [f"{ph} {np.median([d.get(ph, 0) / d['blocks'] for d in per]):.0f}"
                     for ph in PHASES[:-1] if any(d.get(ph, 0) for d in per)]
            total = np.median([sum(v for k, v in d.items() if k != "blocks") / d["blocks"] for d in per])
            lines.append(f"warpgroup {wg}: {len(per)} CTAs, median blocks {np.median([d['blocks'] for d in per]):.0f}; "
                         f"cycles a block: {', '.join(cells)}; all {total:.0f}")
        return "\n".join(lines)

    def phase_totals(self) -> str:
        """Each warpgroup's cycles in each phase summed over a CTA's blocks (whole-launch costs, where phase_table
        spreads them over the blocks): min / median / max over CTAs, and the slowest CTA's (the largest sum of its
        phases), which bounds the launch. What a CTA pays once or per unit (Q, a split unit's end) and how unevenly
        shows here: 2026-12-05, split MLA at B=64 uniform2k, whole units ended in ~10k cycles and two-part ones in
        35-52k ("no phase stamps" without them)."""
        if not self.phases:
            return "no phase stamps"
        lines = []
        for wg, per in self._phase_sums().items():
            total = {c: sum(v for k, v in d.items() if k != "blocks") for c, d in per.items()}
            cells = []
            for ph in PHASES[:-1]:
                v = [d.get(ph, 0) for d in per.values()]
                if any(v):
                    cells.append(f"{ph} {min(v)}/{np.median(v):.0f}/{max(v)}")
            slow = max(total, key=lambda c: (total[c], -c))
            d = per[slow]
            worst = ", ".join(f"{ph} {d[ph]}" for ph in PHASES[:-1] if d.get(ph, 0))
            lines.append(f"warpgroup {wg}: cycles a CTA (min/median/max over {len(per)}): {', '.join(cells)}; "
                         f"all {min(total.values())}/{np.median(list(total.values())):.0f}/{max(total.values())}\n"
                         f"  slowest CTA {slow} ({d['blocks']} blocks): {worst}; all {total[slow]}")
        return "\n".join(lines)

    def to_chrome(self) -> dict:
        """Trace-event JSON: one "X" event per task on track tid = SM id, times in µs from kernel start.

        Exact ns (relative to meld.base_ns, so they stay below 2**53 for JavaScript viewers) ride in each
        event's args and the CTA spans in the top-level "meld" object, so from_chrome loses nothing."""
        base = self.start_ns
        spans = {s.cta: s for s in self.cta_spans}
        events: list[dict] = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "meld SMs"}}]
        for sm in self.sms():
            events += [{"ph": "M", "pid": 0, "tid": sm, "name": "thread_name", "args": {"name": f"SM {sm}"}},
                       {"ph": "M", "pid": 0, "tid": sm, "name": "thread_sort_index", "args": {"sort_index": sm}}]
        for t in self.tasks:
            s = spans[t.cta]
            events.append({"ph": "X", "pid": 0, "tid": t.sm, "name": self.label(t), "cat": t.kind,
                           "ts": (t.start_ns - base) / 1e3, "dur": (t.end_ns - t.start_ns) / 1e3,
                           "args": {"cta": t.cta, "unit": t.unit, "cluster": s.cluster, "grid": s.grid,
                                    "t0_ns": t.start_ns - base, "t1_ns": t.end_ns - base}})
        meld = {"base_ns": base, "units_per_request": self.units_per_request, "head_blocks": self.head_blocks,
                "overflowed": self.overflowed, **({"requests": self.requests} if self.requests else {}),
                "ctas": [[s.cta, s.sm, s.begin_ns - base, s.end_ns - base, s.cluster, s.grid]
                         for s in self.cta_spans],
                **({"phases": [[x.cta, x.warpgroup, x.phase, x.cycles] for x in self.phases]} if self.phases else {})}
        return {"traceEvents": events, "displayTimeUnit": "ns", "meld": meld}

    def write_chrome(self, path: Union[str, os.PathLike]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome(), separators=(",", ":")))
        return path

    @staticmethod
    def from_chrome(obj_or_path: Union[dict, str, os.PathLike]) -> "Trace":
        """Inverse of to_chrome. A file that is not JSON, not a meld trace, or has a missing or mistyped
        field or an unknown task kind raises ValueError naming the field, not an error deep in rendering."""
        obj = obj_or_path if isinstance(obj_or_path, dict) else jsonfile.read(obj_or_path)
        if not isinstance(obj, dict) or not isinstance(obj.get("meld"), dict):
            raise ValueError("not a meld trace: no top-level 'meld' object (write it with Trace.write_chrome)")
        meld = obj["meld"]
        base = _get(meld, "meld.base_ns")
        spans = [_cta_span(f"meld.ctas[{i}]", row, base) for i, row in enumerate(_get(meld, "meld.ctas", list))]
        ctas = {s.cta for s in spans}
        tasks = [_task(f"traceEvents[{i}]", e, base, ctas) for i, e in enumerate(_get(obj, "traceEvents", list))
                 if _typed(f"traceEvents[{i}]", e, dict).get("ph") == "X"]
        counts = [_get(meld, f"meld.{k}") for k in ("overflowed", "units_per_request", "head_blocks")]
        if counts[0] < 0:
            raise ValueError(f"meld.overflowed must be >= 0, got {counts[0]}")
        requests = _get(meld, "meld.requests") if "requests" in meld else 0
        if requests < 0:
            raise ValueError(f"meld.requests must be >= 0, got {requests}")
        phases = [_phase(f"meld.phases[{i}]", row) for i, row in enumerate(_get(meld, "meld.phases", list))] \
            if "phases" in meld else []
        return Trace(tasks, spans, *counts, requests, phases)


_JSON_TYPES = {int: "an integer", str: "a string", list: "an array", dict: "an object"}


def _typed(where: str, value, kind: type = int):
    """value if it is a JSON `kind`; bools and floats are not integers (they would fail later, in pixel maths)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where} must be {_JSON_TYPES[kind]}, got {reprlib.repr(value)}")
    return value


def _get(obj: dict, where: str, kind: type = int):
    """obj's field named by the last part of `where` (e.g. "meld.ctas"), checked by _typed."""
    key = where.rpartition(".")[2]
    if key not in obj:
        raise ValueError(f"{where} is missing")
    return _typed(where, obj[key], kind)


def _cta_span(where: str, row, base: int) -> CtaSpan:
    if not isinstance(row, list) or len(row) != 6:
        raise ValueError(f"{where} must be [cta, sm, begin_ns, end_ns, cluster, grid], got {reprlib.repr(row)}")
    c, sm, b, e, cl, g = (_typed(f"{where}[{j}]", v) for j, v in enumerate(row))
    return CtaSpan(c, sm, base + b, base + e, cl, g)


def _task(where: str, event: dict, base: int, ctas: set[int]) -> TaskRecord:
    """An "X" event back to its task: to_chrome writes one per task, so each must carry all of it."""
    kind, args = _get(event, f"{where}.cat", str), _get(event, f"{where}.args", dict)
    if kind not in KINDS:
        raise ValueError(f"{where}.cat: unknown task kind {reprlib.repr(kind)} (expected {', '.join(KINDS)})")
    cta, unit, t0, t1 = (_get(args, f"{where}.args.{k}") for k in ("cta", "unit", "t0_ns", "t1_ns"))
    if cta not in ctas:
        raise ValueError(f"{where}.args.cta: CTA {cta} is not in meld.ctas")
    return TaskRecord(cta, _get(event, f"{where}.tid"), kind, unit, base + t0, base + t1)


def _phase(where: str, row) -> PhaseCycles:
    row = _typed(where, row, list)
    if len(row) != 4:
        raise ValueError(f"{where} must be [cta, warpgroup, phase, cycles], got {reprlib.repr(row)}")
    cta, wg, phase, cycles = (_typed(f"{where}[{i}]", v, str if i == 2 else int) for i, v in enumerate(row))
    if phase not in PHASES:
        raise ValueError(f"{where}: unknown phase {phase!r} (expected one of {PHASES})")
    return PhaseCycles(cta, wg, phase, cycles)


def _shade(fraction) -> np.ndarray:
    v = np.round(32 + 223 * np.asarray(fraction, dtype=np.float64)).astype(np.uint8)
    return np.stack([v, v, v], axis=-1)


def render_png(trace: Trace, path: Union[str, os.PathLike], width: int = 1600, row_height: int = 6) -> Path:
    """Timeline image: one row per SM (sorted by id; a 1-px gap below each when row_height >= 3) at
    y = i * row_height, coloured by COLOURS over the kernel span from x = MARGIN_PX; a left strip whose
    grey level is the SM's busy fraction; below, a bar whose grey level is the fraction of SMs working."""
    w = width - MARGIN_PX
    if w < 1 or row_height < 1:
        raise ValueError(f"width must exceed {MARGIN_PX} and row_height be positive")
    sms, busy = trace.sms(), trace.sm_busy()
    row = {sm: i for i, sm in enumerate(sms)}
    lo, span = trace.start_ns, max(trace.span_ns, 1)
    code = np.zeros((len(sms), w), np.uint8)  # 0 idle, else 1 + index into _PAINT_ORDER
    for t in sorted(trace.tasks, key=lambda t: _PAINT_ORDER.index(t.kind)):
        x0 = min(max((t.start_ns - lo) * w // span, 0), w - 1)
        x1 = max(min(-(-(t.end_ns - lo) * w // span), w), x0 + 1)  # every task shows at least one pixel
        code[row[t.sm], x0:x1] = 1 + _PAINT_ORDER.index(t.kind)
    palette = np.array([IDLE] + [COLOURS[k] for k in _PAINT_ORDER], np.uint8)
    body = row_height - (row_height >= 3)
    bar_y = len(sms) * row_height + BAR_GAP_PX
    img = np.zeros((bar_y + BAR_PX, width, 3), np.uint8)
    for i, sm in enumerate(sms):
        img[i * row_height:i * row_height + body, MARGIN_PX:] = palette[code[i]]
        img[i * row_height:i * row_height + body, :STRIP_PX] = _shade(busy[sm])
    working = np.isin(code, [1 + _PAINT_ORDER.index(k) for k in WORK_KINDS])
    img[bar_y:, MARGIN_PX:] = _shade(working.mean(axis=0) if sms else np.zeros(w))
    return _write_png(Path(path), img)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def _write_png(path: Path, img: np.ndarray) -> Path:
    """RGB 8-bit, filter 0 on every row, one IDAT."""
    h, w, _ = img.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, 3 * w)], axis=1)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + _chunk(b"IEND", b""))
    return path
