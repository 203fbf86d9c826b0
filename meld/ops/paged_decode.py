"""The plan() every paged decode operator shares (`DecodeAttention`, `DecodeMLA`): FlashInfer's page table,
validated and handed to the GPU planner (templates/decode_plan.h), which cuts the batch's units into one
segment per CTA and rewrites the work tables in place, so a CUDA graph that captured run() replays any
later plan within the capacities.

plan() is transactional (the operator shell's `_commit`): it validates everything before it changes
anything, so a plan() that raises leaves the previous plan, its tables and its buffers exactly as they were.
The buffers (work tables, partials, counters, the launch) are the shell's, sized by two capacities: requests
and page indices. An operator adds its shapes, its kernel's launch (`_kernel_launch`), and run()'s checks,
launch and CPU executor call.
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .. import config
from ..ir import Schedule
from ..ir.schedule import unit_request
from ..runtime import host_helper, torch_fastcall
from ..scheduler import Topology
from ..scheduler.decode_plan_host import plan_params
from ..tuning.recorder import kv_lens, recorder
from .base import Operator
from .checks import expect, is_int, plain, same_device
from .page_table import check_page_table, max_page, page_table_error

_trace_seq = itertools.count()


def _host(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


@dataclass(frozen=True)
class _Planned:
    """What run() and `schedule` need of the last plan() that succeeded. Replaced whole, never edited."""

    batch: int
    indptr: np.ndarray | torch.Tensor   # kv_indptr and kv_last_page_len as planned, for `schedule`
    last: np.ndarray | torch.Tensor
    max_page: int                       # largest page index; -1: none, or not known (check=False)
    kv_indices: torch.Tensor | None     # the CPU executor's page indices
    qo_indptr: np.ndarray | None = None  # a ragged operator's qo_indptr as planned (`PagedDecode._qo_table`)


_DEFAULT_CAPACITY = {"batch": 64, "pages": 4096}   # of the buffers made before the first plan() when none is given


@dataclass
class _Buffers:
    """Everything on the device sized by the capacities: work tables, partials, counters, the kernel's
    launch (its parameter structs point into the others), the planner's parameters."""

    caps: dict[str, int]                # "batch": requests, "pages": page indices
    tables: object                      # meld.runtime.tables.WorkTables
    part_o: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor
    prof: torch.Tensor | None
    prof_clock: torch.Tensor | None     # sampled profiles: the launch number and the exit tickets
    plan_params: ctypes.Structure
    launcher: object                    # meld.runtime.driver.PersistentLaunch
    qo_indptr: torch.Tensor | None      # a ragged operator's qo_indptr as the kernel reads it ([batch + 1] int32)


class UnitNames:
    """Names a unit of a paged decode plan in the terms of the batch (`describe(unit)`), for `describe_unit` and
    the watchdog's message. Never raises (it runs inside error reporting): a number no plan so far has had (the
    kernel that tripped may run an older plan than the last) is answered as out of range. Holds no operator.
    `describe` takes units in request order; a head-major operator's (`units_per_request` given) are converted with
    the last plan's planned requests (`requests`), so a kernel of an older plan of another batch may be misnamed."""

    def __init__(self, describe, units_per_request: int = 0):
        self.describe = describe
        self.units = 0   # the most units any plan so far had
        self.units_per_request = units_per_request   # > 0: units come head-major
        self.requests = 0   # the last plan's planned requests

    def __call__(self, unit: object) -> str:
        if not is_int(unit):
            return f"unit {unit!r} is not a unit number (an int)"
        if not 0 <= unit < self.units:
            have = f"units 0-{self.units - 1}" if self.units else "no units (no plan so far)"
            return f"unit {unit!r} is out of range: the plans so far have {have}"
        try:
            if self.units_per_request:
                req, hb = unit_request(int(unit), self.requests, self.units_per_request, True)
                return self.describe(req * self.units_per_request + hb)
            return self.describe(int(unit))
        except Exception as e:   # (a describe that fails must not hide the report it is part of)
            return f"unit {unit} (not described: {type(e).__name__}: {e})"


class PagedDecode(Operator):
    """Base of the paged decode operators. A subclass sets `page_size`, `units_per_request`, `head_blocks`,
    `num_kv_heads`, `group_size`, `heads_per_unit`, `partial_width` (channels of a partial row), `cost`,
    `kernel_config`, `topology`, `profile_every`, the capacities and `graph`, calls `_init_plan_state(describe)`
    (describe names a unit: `UnitNames`), on a GPU loads `kernel` and calls `_init_device`, and calls
    `_launched()` after each run() launch."""

    _cluster_rows: torch.Tensor | None = None   # the CTA table's cluster rows, where the planner places for clusters
    q_len = 1   # new tokens per request
    # Requests the planner makes of each request: 1, or q_len where the kernel runs a new token per unit (DecodeMLA:
    # templates/decode_plan.h, PLAN_TOKEN_REQUESTS); with 1, a unit's rows are (q head, token) pairs and the
    # planner's rows per kv head are group_size * q_len (DecodeAttention).
    token_requests = 1
    # The units' order on the planner's line and in the tables: request by request, or head block by head block
    # (DecodeMLA: templates/decode_plan.h, meld/ir/schedule.py)
    head_major = False
    ragged = False   # requests of 1 .. q_len new tokens, their rows given by plan()'s qo_indptr (DecodeAttention)

    def _init_plan_state(self, describe) -> None:
        # (what the watchdog registers: it must not hold the operator)
        self._unit_names = UnitNames(describe, self.units_per_request if self.head_major else 0)
        self._plan_kernel_last = False   # the last kernel this op put on a stream was plan()'s
        self._schedule: Schedule | None = None   # of `_planned`, computed on first use
        self._recorder = None   # MELD_RECORD's recorder, read by each plan() before it changes anything

    def _init_device(self) -> None:
        """On a GPU, once `kernel` and `topology` are set: the watchdog, the GPU planner, and the buffers for the
        capacities given (or `_DEFAULT_CAPACITY`)."""
        self._register_watchdog(self.kernel_config.name, self._unit_names)
        pc = self.lowering.device_planner
        if self.token_requests > 1:
            pc = dataclasses.replace(pc, token_requests=True)
        self.planner = self._kernels(pc, {pc.entry: (pc.threads, pc.smem_bytes(self.topology.num_ctas))})[pc.entry]
        self._helper_out = (ctypes.c_int(-1), ctypes.c_longlong(0))   # the C helper's max page and error index
        self._helper_out_ptrs = tuple(ctypes.byref(v) for v in self._helper_out)
        self._buf = self._make_buffers({"batch": self.max_batch_size or _DEFAULT_CAPACITY["batch"],
                                        "pages": self.max_num_pages or _DEFAULT_CAPACITY["pages"]})

    def _make_buffers(self, caps: dict[str, int]) -> _Buffers:
        from ..runtime.tables import Capacity, WorkTables

        W, requests = self.topology.num_ctas, caps["batch"] * self.token_requests   # (the planned requests)
        t = WorkTables(self.device, W, Capacity(requests, caps["pages"]),
                       line_entries=requests * self.units_per_request if self.head_major else requests)
        units = requests * self.units_per_request
        # A partial's slot: one per chunk (batch-invariant plans), otherwise its piece's unit + its CTA.
        slots = self._chunk_slots(caps["batch"], caps["pages"]) if self._chunk else units + W
        f32 = dict(dtype=torch.float32, device=self.device)
        part_o = torch.empty(slots * self.heads_per_unit * self.partial_width, **f32)
        part_lse = torch.empty(slots * self.heads_per_unit, **f32)
        counters = torch.zeros(units, dtype=torch.int32, device=self.device)
        qo = torch.zeros(caps["batch"] + 1, dtype=torch.int32, device=self.device) if self.ragged else None
        params = plan_params(   # one struct for every plan(): plan() sets the batch and the page table
            self.cost, self.page_size, self.units_per_request, W, self._chunk, self.token_requests, self.head_major,
            kv_indptr=0,
            last_page_len=0, kv_len=t.ptr(t.off_kv_len), page_base=t.ptr(t.off_page_base), cta_table=t.ptr(0),
            line=t.line.data_ptr(), src_indices=0, dst_indices=t.ptr(t.off_indices), done_flag=0,
            arrive=t.arrive.data_ptr(), done_seq=0, batch=0, slot_base=t.ptr(t.off_slot_base),
            cluster_rows=self._cluster_rows.data_ptr() if self._cluster_rows is not None else 0)
        # Records per CTA: at most every piece (units, or with chunks up to every slot too), 2 merges, the exit wait
        # (and a phases build's sums).
        prof_cap = units + (slots if self._chunk else 0) + 3 + self.kernel_config.phase_records
        prof, clock = self._profile_buffers(self.kernel_config.profile, W, prof_cap, self.profile_every)
        launcher = self._kernel_launch(t, dict(
            kv_indices=t.ptr(t.off_indices), kv_len=t.ptr(t.off_kv_len), page_base=t.ptr(t.off_page_base),
            cta_table=t.ptr(0), part_o=part_o.data_ptr(), part_lse=part_lse.data_ptr(), counters=counters.data_ptr(),
            **({"qo_indptr": qo.data_ptr()} if qo is not None else {}),
            **self._header(prof, clock, prof_cap, self.profile_every, W)))
        return _Buffers(caps, t, part_o, part_lse, counters, prof, clock, params, launcher, qo)

    def _kernel_launch(self, tables, fields: dict[str, int]):
        """The kernel's `meld.runtime.driver.PersistentLaunch`, its parameters `fields` (the work tables',
        partials' and counters' addresses and the header) and the kernel's own; `tables`: the WorkTables."""
        raise NotImplementedError

    def _chunk_slots(self, max_batch: int, max_pages: int) -> int:
        """Partial slots a batch-invariant plan within the capacities can need: one per chunk of every unit
        of more than one chunk. With T tokens (at most max_pages full pages) that is at most
        min(2 T / (chunk + 1), T / chunk + B) chunks per unit position (a request of L > chunk tokens
        has ceil(L / chunk) <= 2 L / (chunk + 1) chunks)."""
        T, c = max_pages * self.page_size, self._chunk
        return self.units_per_request * min(2 * T // (c + 1), T // c + max_batch)

    def describe_unit(self, unit: int) -> str:
        """A unit of work in the terms of the batch ("request 3, kv head 1, q heads 4-7"); a number outside
        the units of the plans so far is answered as out of range (never an exception)."""
        return self._unit_names(unit)

    def _launched(self) -> None:
        """After every run() launch: the next one may overlap the stream's previous kernel, and an eager run of a
        kernel that profiles every launch writes its Chrome trace to MELD_PROFILE_DIR."""
        self._plan_kernel_last = False
        if self._buf.prof is not None and self.profile_every == 1 and not torch.cuda.is_current_stream_capturing():
            d = config.profile_dir()
            d.mkdir(parents=True, exist_ok=True)
            self.last_trace().write_chrome(d / f"{self.graph.name}-{next(_trace_seq):04d}.trace.json")

    def _profile_records(self):
        if self._buf is None or self._buf.prof is None:
            return None
        launcher = self._buf.launcher
        requests = self._planned.batch * self.token_requests if self.head_major and self._planned else 0
        return (self._buf.prof, (self.units_per_request, self.head_blocks),
                dict(cluster=launcher.cluster_of_cta(), grid=launcher.grid_of_cta(), requests=requests))

    def _servable(self, topology: Topology) -> Topology:
        limit = self.lowering.device_planner.max_ctas
        if topology.num_ctas > limit:
            raise ValueError(f"topology={topology}: {topology.num_ctas} CTA slots, but the planner serves grids of at "
                             f"most {limit} CTAs (its per-CTA scratch must fit one CTA's shared memory)")
        return topology

    def _check_capacity(self, batch: int, pages: int) -> None:
        """ValueError where a plan of `batch` requests and `pages` page indices exceeds a capacity given at
        construction (a limit)."""
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(f"batch of {batch} requests exceeds max_batch_size={self.max_batch_size} given at "
                             "construction")
        if self.max_num_pages is not None and pages > self.max_num_pages:
            raise ValueError(f"kv_indptr[-1]={pages} page indices exceed max_num_pages={self.max_num_pages} given "
                             "at construction")

    def _fitting(self, batch: int, pages: int) -> _Buffers:
        """The buffers a plan of `batch` requests and `pages` page indices is written into (`_buffers_for`)."""
        self._check_capacity(batch, pages)
        return self._buffers_for({"batch": batch, "pages": pages})

    # --- plan -----------------------------------------------------------------------------------
    @property
    def _plan_clusters(self) -> list[tuple[int, int]]:
        """The cluster mix the planner places for (none: no on-chip merges)."""
        return []

    @property
    def _chunk(self) -> int:
        """The chunk of batch-invariant plans (0: plans balance freely)."""
        return 0

    @property
    def tables(self):
        """The device work tables (`meld.runtime.tables.WorkTables`) the GPU planner writes."""
        if self._buf is None:
            raise RuntimeError(f"{type(self).__name__}.tables: the CPU executor has no device tables")
        return self._buf.tables

    @property
    def planned_group_size(self) -> int:
        """Query rows per kv head of a planned request (the schedule's group_size): q heads per kv head, times
        q_len where a unit's rows are (q head, token) pairs."""
        return self.group_size * self.q_len // self.token_requests

    @property
    def schedule(self) -> Schedule:
        """The `meld.ir.Schedule` of the last plan(), from the host build of the GPU planner (on a GPU: a
        copy of the tables the GPU planner wrote, computed when first asked for)."""
        if self._schedule is None:
            if self._planned is None:
                raise RuntimeError(f"{type(self).__name__}.schedule: call plan() first")
            # (the lowering's planner: plan_decode_host, the host build of the GPU planner's source)
            self._schedule = self.lowering.planner(
                _host(self._planned.indptr), _host(self._planned.last), self.page_size, self.num_kv_heads,
                self.planned_group_size, self.topology, self.cost, self.heads_per_unit, self._plan_clusters,
                self._chunk, self.token_requests, self.head_major)
        return self._schedule

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
             *, check: bool = True, qo_indptr: torch.Tensor | None = None) -> None:
        """Plan a batch from FlashInfer's paged layout (int32 tensors, CPU or this op's device).

        Args:
            kv_indptr: [B + 1] page-table offsets of each request in kv_indices.
            kv_indices: [>= kv_indptr[-1]] page indices into the KV cache.
            kv_last_page_len: [B] tokens in each request's last page (1..page_size; any for empty requests).
            check: validate the values (page indices, last-page lengths). CPU inputs are always checked
                and never synchronise with the device. GPU inputs are planned on the GPU; checking them
                reads them on the host (a synchronisation) — pass check=False to plan with no host
                involvement at all (then plan() can itself be captured in a CUDA graph).
            qo_indptr: a ragged operator's (and only its) [B + 1] int32 row offsets: request b's new tokens are q's
                rows qo_indptr[b] .. qo_indptr[b + 1], 1 to q_len of them (FlashInfer's prefill layout). Always read
                and checked on the host (on a GPU: a synchronisation) and copied to the table the kernel reads, so a
                captured run() replays it with the plan.
        The schedule is at `self.schedule`. A plan() that raises changes nothing (MELD_DUMP_DIR is checked
        first; writing the schedule there after the plan is installed can only warn). Like FlashInfer's, the
        plan is written on torch's current stream: a run() on another stream must wait for it.
        """
        if self._watchdog is not None:
            self._watchdog.check()
        # The settings plan() acts on are read before it changes anything, so that a bad one (MELD_RECORD_EVERY=0,
        # a MELD_DUMP_DIR that is a file) fails the plan() whole instead of after the tables were rewritten.
        self._recorder = recorder()
        dump = config.dump_dir()
        if dump is not None:
            config.made_dir("MELD_DUMP_DIR", dump)
        kv_indptr, kv_indices, kv_last_page_len = plain(kv_indptr), plain(kv_indices), plain(kv_last_page_len)
        expect("kv_indptr", kv_indptr, torch.int32, (None,), "B + 1 offsets", contiguous=True)
        B = kv_indptr.shape[0] - 1
        if B < 0:
            raise ValueError("kv_indptr must have B + 1 entries, got an empty tensor")
        expect("kv_indices", kv_indices, torch.int32, (None,), "page indices", contiguous=True)
        expect("kv_last_page_len", kv_last_page_len, torch.int32, (B,), "one entry per request, B = len(kv_indptr) - 1",
               contiguous=True)
        if not isinstance(check, bool):
            raise ValueError(f"check must be True or False, got {check!r}")
        on_host = kv_indptr.is_cpu and kv_indices.is_cpu and kv_last_page_len.is_cpu
        if not on_host:
            for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                            ("kv_last_page_len", kv_last_page_len)):
                if t.device.type != "cpu" and not same_device(t.device, self.device):
                    raise ValueError(f"{name} must be on the CPU or on {self.device}, got {t.device}")
        qo = self._qo_table(qo_indptr, B)
        kv_indptr, kv_indices = self._pages_read(kv_indptr, kv_indices, kv_last_page_len, check or on_host, qo)
        if self.device.type == "cpu":
            self._plan_cpu(B, kv_indptr, kv_indices, kv_last_page_len, qo)
        elif on_host:
            self._plan_host(B, kv_indptr, kv_indices, kv_last_page_len, qo)
        else:
            self._plan_device(B, kv_indptr, kv_indices, kv_last_page_len, check, qo)
        if dump is not None:   # the plan is installed: a dump that fails now (a full disk) only warns
            try:
                config.dump(f"{self.graph.name}.schedule.json", self.schedule.to_json())
            except ValueError as e:
                warnings.warn(f"{e}; the plan was installed, its schedule not dumped", RuntimeWarning, stacklevel=2)

    def _qo_table(self, qo_indptr: object, B: int) -> np.ndarray | None:
        """A ragged operator's qo_indptr (required) as a host copy, checked: int32, B + 1 offsets from 0, each
        request 1 to q_len new tokens. Any other operator takes none (None)."""
        if not self.ragged:
            if qo_indptr is not None:
                raise ValueError(f"qo_indptr is for ragged operators (DecodeAttention(..., q_len=n, ragged=True)); "
                                 f"this one decodes q_len={self.q_len} new tokens for every request: pass none")
            return None
        if qo_indptr is None:
            raise ValueError(f"qo_indptr is required: this operator is ragged (request b's 1 to q_len={self.q_len} "
                             "new tokens are q's rows qo_indptr[b] .. qo_indptr[b + 1])")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a ragged operator's plan() reads qo_indptr on the host and copies it: it cannot be "
                               "captured in a CUDA graph (capture run(), which replays later plans)")
        qo_indptr = plain(qo_indptr)
        expect("qo_indptr", qo_indptr, torch.int32, (B + 1,), "B + 1 offsets, B = len(kv_indptr) - 1")
        if qo_indptr.device.type != "cpu" and not same_device(qo_indptr.device, self.device):
            raise ValueError(f"qo_indptr must be on the CPU or on {self.device}, got {qo_indptr.device}")
        qo = _host(qo_indptr).copy()
        if qo[0] != 0:
            raise ValueError(f"qo_indptr[0] must be 0, got {int(qo[0])}")
        n = np.diff(qo.astype(np.int64))
        bad = np.flatnonzero((n < 1) | (n > self.q_len))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"qo_indptr gives request {b} {int(n[b])} new tokens (qo_indptr[{b + 1}] - qo_indptr[{b}] "
                             f"= {int(qo[b + 1])} - {int(qo[b])}): expected 1 to q_len={self.q_len}")
        return qo

    def _pages_read(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                    check: bool, qo: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The page table the kernel reads of the one plan() was given (shapes and dtypes checked; its values too
        when `check`, `_check_new_tokens` among them, with `qo`, a ragged plan's qo_indptr): the same here; an
        operator with a sliding window leaves out the pages before it."""
        if check:
            self._check_new_tokens(kv_indptr, kv_indices, kv_last_page_len, qo)
        return kv_indptr, kv_indices

    def _check_new_tokens(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                          qo: np.ndarray | None = None) -> None:
        """With q_len > 1, every request must hold its new tokens, q_len or (ragged) those `qo` gives it (the page
        table checked first, so that its errors name the entry; unchecked, a new token that sees no key gives zeros
        and lse -inf)."""
        if self.q_len == 1:
            return
        indptr, last = _host(kv_indptr), _host(kv_last_page_len)
        check_page_table(indptr, last, kv_indices.numel(), self.page_size)
        lens = kv_lens(indptr, last, self.page_size)
        need = self.q_len if qo is None else np.diff(qo)
        short = np.flatnonzero(lens < need)
        if short.size:
            i = int(short[0])
            if qo is not None:
                raise ValueError(f"kv_indptr and kv_last_page_len give request {i} {int(lens[i])} KV tokens, fewer "
                                 f"than its {int(need[i])} new tokens in qo_indptr (qo_indptr[{i + 1}] - "
                                 f"qo_indptr[{i}]): the cache must already hold them (token j of n attends to keys "
                                 "0 .. kv_len - n + j)")
            raise ValueError(f"kv_indptr and kv_last_page_len give request {i} {int(lens[i])} KV tokens, fewer "
                             f"than q_len={self.q_len}: its first new tokens would attend to an empty KV range (the "
                             "cache must already hold each request's q_len new tokens; token j attends to keys "
                             "0 .. kv_len - q_len + j)")

    def _commit(self, planned: _Planned, buf: _Buffers | None = None) -> None:
        """The shell's commit, after recording the batch when MELD_RECORD samples it; then the state derived
        from the plan (its schedule, computed when asked for; the units the watchdog names); the torch op's fast path
        forgets the launches it recorded (meld.runtime.torch_fastcall)."""
        rec = self._recorder   # (resolved when plan() started)
        if rec is not None and rec.due() and not any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                                                     for t in (planned.indptr, planned.last)):
            rec.record(self.graph.name, self.shape_bucket, kv_lens(_host(planned.indptr), _host(planned.last),
                                                                   self.page_size))
        if planned.qo_indptr is not None and self.device.type != "cpu":   # the table the kernel reads
            (buf or self._buf).qo_indptr[:planned.batch + 1].copy_(torch.from_numpy(planned.qo_indptr), non_blocking=True)
        super()._commit(planned, buf)
        torch_fastcall.drop(self.handle)
        self._schedule = None
        self._unit_names.units = max(self._unit_names.units,
                                     planned.batch * self.token_requests * self.units_per_request)
        self._unit_names.requests = planned.batch * self.token_requests
        self._plan_kernel_last = True

    def _plan_cpu(self, B, kv_indptr, kv_indices, kv_last_page_len, qo) -> None:
        indptr, last = kv_indptr.numpy(), kv_last_page_len.numpy()
        nnz = check_page_table(indptr, last, kv_indices.numel(), self.page_size)
        self._check_capacity(B, nnz)
        indices = kv_indices[:nnz].clone()
        self._commit(_Planned(B, indptr.copy(), last.copy(), max_page(indices.numpy()), indices, qo))

    def _plan_host(self, B, kv_indptr, kv_indices, kv_last_page_len, qo) -> None:
        """A page table on the host: validated and staged in pinned memory in one pass, then read from
        there by the GPU planner (one driver call, no wait for the device)."""
        indptr = kv_indptr.numpy()
        nnz = int(indptr[-1])
        buf = self._fitting(B, max(0, min(nnz, kv_indices.numel())))   # bad tables stage no more than that
        t = buf.tables
        staged = t.stage()    # the staging buffer the last plan did not use: the last plan keeps its own
        host = t.staging_ptr()
        raw = staged[t.off_raw:t.off_raw + 2 * B + 1]
        helper = host_helper.load()
        if helper is not None:   # validate and stage in one pass (C)
            top, where = self._helper_out
            err = helper.meld_stage_page_table(
                kv_indptr.data_ptr(), kv_last_page_len.data_ptr(), kv_indices.data_ptr(), B, kv_indices.numel(),
                self.page_size, host + 4 * t.off_raw, host + 4 * t.off_indices, self._helper_out_ptrs[0],
                self._helper_out_ptrs[1])
            if err:
                page_table_error(err, where.value, indptr, kv_last_page_len.numpy(), kv_indices.numel(),
                                 kv_indices, self.page_size)
            top = top.value
        else:                    # NumPy: the same checks, more passes
            check_page_table(indptr, kv_last_page_len.numpy(), kv_indices.numel(), self.page_size)
            top = max_page(kv_indices.numpy()[:nnz])
            ctypes.memmove(host + 4 * t.off_raw, kv_indptr.data_ptr(), 4 * (B + 1))
            ctypes.memmove(host + 4 * (t.off_raw + B + 1), kv_last_page_len.data_ptr(), 4 * B)
            ctypes.memmove(host + 4 * t.off_indices, kv_indices.data_ptr(), 4 * nnz)
        flag, seq = t.commit()
        host_raw = host + 4 * t.off_raw
        self._launch_planner(buf, B, host_raw, host_raw + 4 * (B + 1), host + 4 * t.off_indices, flag, seq,
                             copy_ctas=-(-nnz // (4 * 4 * 1024)))
        # `schedule` replans from these views: this staging buffer is rewritten two plans later, when
        # `_planned` already points at the newer one.
        self._commit(_Planned(B, raw[:B + 1], raw[B + 1:], top, None, qo), buf)

    def _plan_device(self, B, kv_indptr, kv_indices, kv_last_page_len, check: bool, qo) -> None:
        """A page table already on this GPU: device copies and the planner, no host staging; `check`
        reads it back to validate it first."""
        if check:
            nnz = check_page_table(_host(kv_indptr), _host(kv_last_page_len), kv_indices.numel(), self.page_size)
            top = max_page(_host(kv_indices[:nnz]))
        else:          # trust the values: no host involvement at all
            nnz, top = kv_indices.numel(), -1
        buf = self._fitting(B, nnz)
        # Mixed placements (say kv_indptr on the CPU, kv_indices on the GPU) move to the device first.
        parts = [x.to(self.device).contiguous() for x in (kv_indptr, kv_last_page_len, kv_indices[:nnz])]
        buf.tables.copy_from_device(*parts)
        raw = buf.tables.ptr(buf.tables.off_raw)
        self._launch_planner(buf, B, raw, raw + 4 * (B + 1), 0, 0, 0, copy_ctas=0)
        self._commit(_Planned(B, kv_indptr, kv_last_page_len, top, None, qo), buf)

    def _launch_planner(self, buf: _Buffers, B: int, indptr: int, last: int, src_indices: int, flag: int,
                        seq: int, copy_ctas: int) -> None:
        p = buf.plan_params
        p.batch, p.kv_indptr, p.last_page_len = B, indptr, last
        p.src_indices, p.done_flag, p.done_seq = src_indices, flag, seq
        self.planner.launch(1 + min(copy_ctas, 64), p)
