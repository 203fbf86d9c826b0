"""The plan() every paged decode operator shares (`DecodeAttention`, `DecodeMLA`): FlashInfer's page table,
validated and handed to the GPU planner (templates/decode_plan.h), which cuts the batch's units into one
segment per CTA and rewrites the work tables in place, so a CUDA graph that captured run() replays any
later plan within the capacities.

plan() is transactional: it validates everything before it changes anything, so a plan() that raises
leaves the previous plan, its tables and its buffers exactly as they were. An operator adds its shapes,
its kernel and buffers (`_make_buffers`), run() and the CPU executor's call.
"""
from __future__ import annotations

import ctypes
import itertools
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .. import config
from ..codegen import DecodePlanKernelConfig
from ..ir import Schedule
from ..runtime import host_helper
from ..scheduler import Topology
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


@dataclass
class _Buffers:
    """Everything on the device sized by the capacities: work tables, partials, counters, the kernel's
    launch (its parameter structs point into the others), the planner's parameters."""

    batch: int
    pages: int
    tables: object                      # meld.runtime.tables.WorkTables
    part_o: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor
    prof: torch.Tensor | None
    prof_clock: torch.Tensor | None     # sampled profiles: the launch number and the exit tickets
    plan_params: ctypes.Structure
    launcher: object                    # meld.runtime.driver.PersistentLaunch

class UnitNames:
    """Names a unit of a paged decode plan in the terms of the batch (`describe(unit)`), for `describe_unit` and
    the watchdog's message. Never raises (it runs inside error reporting): a number no plan so far has had (the
    kernel that tripped may run an older plan than the last) is answered as out of range. Holds no operator."""

    def __init__(self, describe):
        self.describe = describe
        self.units = 0   # the most units any plan so far had

    def __call__(self, unit: object) -> str:
        if not is_int(unit):
            return f"unit {unit!r} is not a unit number (an int)"
        if not 0 <= unit < self.units:
            have = f"units 0-{self.units - 1}" if self.units else "no units (no plan so far)"
            return f"unit {unit!r} is out of range: the plans so far have {have}"
        try:
            return self.describe(int(unit))
        except Exception as e:   # (a describe that fails must not hide the report it is part of)
            return f"unit {unit} (not described: {type(e).__name__}: {e})"


class PagedDecode(Operator):
    """Base of the paged decode operators. A subclass sets `page_size`, `units_per_request`, `head_blocks`,
    `num_kv_heads`, `group_size`, `heads_per_unit`, `cost`, `topology`, `profile_every`, the capacities and
    `graph`, calls `_init_plan_state(describe)` (describe names a unit: `UnitNames`), on a GPU loads `planner`
    and makes `_buf` (`_make_buffers`), and calls `_launched()` after each run() launch."""

    def _init_plan_state(self, describe) -> None:
        self._unit_names = UnitNames(describe)   # what the watchdog registers (it must not hold the operator)
        self._planned: _Planned | None = None
        self._plan_kernel_last = False   # the last kernel this op put on a stream was plan()'s
        self._schedule: Schedule | None = None   # of `_planned`, computed on first use
        self._buf: _Buffers | None = None
        self._watchdog = None
        self._helper_out = (ctypes.c_int(-1), ctypes.c_longlong(0))   # the C helper's max page and error index
        self._helper_out_ptrs = tuple(ctypes.byref(v) for v in self._helper_out)
        self._recorder = None   # MELD_RECORD's recorder, read by each plan() before it changes anything

    def _make_buffers(self, max_batch: int, max_pages: int) -> _Buffers:
        raise NotImplementedError

    def __getstate__(self) -> dict:
        """copy / deepcopy / pickle: an operator on the CPU executor copies whole (its plan too); one on a GPU
        cannot be copied (its launch parameters point at its own device buffers): a TypeError says so."""
        if self._buf is not None:
            raise TypeError(f"{type(self).__name__} on {self.device} cannot be copied or pickled: its kernel's "
                            "parameters point at its own device buffers; build another with the same arguments")
        state = dict(self.__dict__)
        del state["_helper_out"], state["_helper_out_ptrs"]   # ctypes pointers: made anew for the copy
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._helper_out = (ctypes.c_int(-1), ctypes.c_longlong(0))
        self._helper_out_ptrs = tuple(ctypes.byref(v) for v in self._helper_out)

    def describe_unit(self, unit: int) -> str:
        """A unit of work in the terms of the batch ("request 3, kv head 1, q heads 4-7"); a number outside
        the units of the plans so far is answered as out of range (never an exception)."""
        return self._unit_names(unit)

    def _run_start(self, return_lse: object) -> _Planned:
        """run()'s first checks: a plan, a bool return_lse, no watchdog trip pending. Returns the plan."""
        planned = self._planned
        if planned is None:
            raise RuntimeError(f"{type(self).__name__}.run: call plan() first")
        if return_lse is not True and return_lse is not False:
            raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
        if self._watchdog is not None:
            self._watchdog.check()
        return planned

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
        return (self._buf.prof, (self.units_per_request, self.head_blocks),
                dict(cluster=launcher.cluster_of_cta(), grid=launcher.grid_of_cta()))

    @staticmethod
    def _servable(topology: Topology) -> Topology:
        limit = DecodePlanKernelConfig().max_ctas
        if topology.num_ctas > limit:
            raise ValueError(f"topology={topology}: {topology.num_ctas} CTA slots, but the planner serves grids of at "
                             f"most {limit} CTAs (its per-CTA scratch must fit one CTA's shared memory)")
        return topology

    def _capacity_for(self, batch: int, pages: int) -> tuple[int, int]:
        """The table capacities a plan of `batch` requests and `pages` page indices needs (the current ones
        when they suffice); a capacity given at construction is a limit."""
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(f"batch of {batch} requests exceeds max_batch_size={self.max_batch_size} given at "
                             "construction")
        if self.max_num_pages is not None and pages > self.max_num_pages:
            raise ValueError(f"kv_indptr[-1]={pages} page indices exceed max_num_pages={self.max_num_pages} given "
                             "at construction")
        if self._buf is None:
            return batch, pages
        cb, cp = self._buf.batch, self._buf.pages
        return (cb if batch <= cb else max(batch, 2 * cb)), (cp if pages <= cp else max(pages, 2 * cp))

    def _buffers_for(self, batch: int, pages: int) -> _Buffers:
        """The current buffers, or larger ones (not yet installed: plan() installs them on success)."""
        cap = self._capacity_for(batch, pages)
        if cap == (self._buf.batch, self._buf.pages):
            return self._buf
        torch.cuda.synchronize(self.device)   # the GPU may still read the old buffers, staging included
        return self._make_buffers(*cap)

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
    def schedule(self) -> Schedule:
        """The `meld.ir.Schedule` of the last plan(), from the host build of the GPU planner (on a GPU: a
        copy of the tables the GPU planner wrote, computed when first asked for)."""
        if self._schedule is None:
            if self._planned is None:
                raise RuntimeError(f"{type(self).__name__}.schedule: call plan() first")
            # (the lowering's planner: plan_decode_host, the host build of the GPU planner's source)
            self._schedule = self.lowering.planner(_host(self._planned.indptr), _host(self._planned.last),
                                                   self.page_size, self.num_kv_heads, self.group_size, self.topology,
                                                   self.cost, self.heads_per_unit, self._plan_clusters, self._chunk)
        return self._schedule

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
             *, check: bool = True) -> None:
        """Plan a batch from FlashInfer's paged layout (int32 tensors, CPU or this op's device).

        Args:
            kv_indptr: [B + 1] page-table offsets of each request in kv_indices.
            kv_indices: [>= kv_indptr[-1]] page indices into the KV cache.
            kv_last_page_len: [B] tokens in each request's last page (1..page_size; any for empty requests).
            check: validate the values (page indices, last-page lengths). CPU inputs are always checked
                and never synchronise with the device. GPU inputs are planned on the GPU; checking them
                reads them on the host (a synchronisation) — pass check=False to plan with no host
                involvement at all (then plan() can itself be captured in a CUDA graph).
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
        if self.device.type == "cpu":
            self._plan_cpu(B, kv_indptr, kv_indices, kv_last_page_len)
        elif on_host:
            self._plan_host(B, kv_indptr, kv_indices, kv_last_page_len)
        else:
            self._plan_device(B, kv_indptr, kv_indices, kv_last_page_len, check)
        if dump is not None:   # the plan is installed: a dump that fails now (a full disk) only warns
            try:
                config.dump(f"{self.graph.name}.schedule.json", self.schedule.to_json())
            except ValueError as e:
                warnings.warn(f"{e}; the plan was installed, its schedule not dumped", RuntimeWarning, stacklevel=2)

    def _commit(self, planned: _Planned, buf: _Buffers | None = None) -> None:
        """Install a validated plan (and grown buffers): the only place plan() changes the operator;
        and record the batch when MELD_RECORD samples it."""
        rec = self._recorder   # (resolved when plan() started)
        if rec is not None and rec.due() and not any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                                                     for t in (planned.indptr, planned.last)):
            rec.record(self.graph.name, self.shape_bucket, kv_lens(_host(planned.indptr), _host(planned.last),
                                                                   self.page_size))
        self._planned, self._schedule = planned, None
        self._unit_names.units = max(self._unit_names.units, planned.batch * self.units_per_request)
        self._plan_kernel_last = True
        if buf is not None:
            self._buf = buf

    def _plan_cpu(self, B, kv_indptr, kv_indices, kv_last_page_len) -> None:
        indptr, last = kv_indptr.numpy(), kv_last_page_len.numpy()
        nnz = check_page_table(indptr, last, kv_indices.numel(), self.page_size)
        self._capacity_for(B, nnz)
        indices = kv_indices[:nnz].clone()
        self._commit(_Planned(B, indptr.copy(), last.copy(), max_page(indices.numpy()), indices))

    def _plan_host(self, B, kv_indptr, kv_indices, kv_last_page_len) -> None:
        """A page table on the host: validated and staged in pinned memory in one pass, then read from
        there by the GPU planner (one driver call, no wait for the device)."""
        indptr = kv_indptr.numpy()
        nnz = int(indptr[-1])
        buf = self._buffers_for(B, max(0, min(nnz, kv_indices.numel())))   # bad tables stage no more than that
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
        self._commit(_Planned(B, raw[:B + 1], raw[B + 1:], top, None), buf)

    def _plan_device(self, B, kv_indptr, kv_indices, kv_last_page_len, check: bool) -> None:
        """A page table already on this GPU: device copies and the planner, no host staging; `check`
        reads it back to validate it first."""
        if check:
            nnz = check_page_table(_host(kv_indptr), _host(kv_last_page_len), kv_indices.numel(), self.page_size)
            top = max_page(_host(kv_indices[:nnz]))
        else:          # trust the values: no host involvement at all
            nnz, top = kv_indices.numel(), -1
        buf = self._buffers_for(B, nnz)
        # Mixed placements (say kv_indptr on the CPU, kv_indices on the GPU) move to the device first.
        parts = [x.to(self.device).contiguous() for x in (kv_indptr, kv_last_page_len, kv_indices[:nnz])]
        buf.tables.copy_from_device(*parts)
        raw = buf.tables.ptr(buf.tables.off_raw)
        self._launch_planner(buf, B, raw, raw + 4 * (B + 1), 0, 0, 0, copy_ctas=0)
        self._commit(_Planned(B, kv_indptr, kv_last_page_len, top, None), buf)

    def _launch_planner(self, buf: _Buffers, B: int, indptr: int, last: int, src_indices: int, flag: int,
                        seq: int, copy_ctas: int) -> None:
        p = buf.plan_params
        p.batch, p.kv_indptr, p.last_page_len = B, indptr, last
        p.src_indices, p.done_flag, p.done_seq = src_indices, flag, seq
        self.planner.launch(1 + min(copy_ctas, 64), p)
