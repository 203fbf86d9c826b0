"""The operator shell: what every operator shares, written once. Its task graph and the family it lowers to,
the device it runs on (the CPU reference executor, or a Hopper GPU), kernels compiled once and loaded once per
module, the device's watchdog record and the profiler's buffers; device buffers sized by capacities and
installed with the plan that needs them (plan() is transactional); and run()'s order: checks, outputs, then
the GPU launch or the CPU reference executor. An operator adds its shapes, checks, buffers and launches."""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from .. import config
from ..codegen import compile_source
from ..codegen.lowering import Lowering, lower
from ..ir import TaskGraph
from ..runtime import torch_fastcall
from .checks import check_outputs, expect, grad_inputs, no_backward, plain, resolve_device
from .registry import register


def grown(caps: Mapping[str, int], need: Mapping[str, int]) -> dict[str, int] | None:
    """The capacities of new buffers for a plan that needs `need`, or None when the installed ones (`caps`)
    hold it. Each capacity the plan exceeds (or that has none yet) becomes twice its need, at least 1, so that
    later plans of about that size fit (and a graph captured after it replays them); the others stay."""
    if all(k in caps and n <= caps[k] for k, n in need.items()):
        return None
    return {k: caps[k] if k in caps and n <= caps[k] else max(1, 2 * n) for k, n in need.items()}


class Operator:
    """Base of meld's operators. Subclasses call `_setup` first, then `_kernels` for each module. One with a
    plan() makes its buffers in `_make_buffers`, takes them from `_buffers_for` and installs them with the plan
    by `_commit`; an attention operator's run() is `_run`, over its `_check_run`, `_launch` and `_execute_cpu`."""

    graph: TaskGraph
    lowering: Lowering
    device: torch.device
    handle: int        # names this operator to its torch custom op (meld.ops.torch_ops)
    _watchdog = None   # the device's watchdog record, on a GPU (`_register_watchdog`)
    _prof = None       # the profile buffer `last_trace` reads, of an operator whose buffers are fixed
    _buf = None        # device buffers sized by capacities (their `caps`): `_buffers_for`, `_commit`
    _planned = None    # what run() needs of the last plan() that succeeded: replaced whole by `_commit`
    _run_inputs: tuple[str, ...] = ()   # run()'s tensors by name, for `_run`
    _lse_meaning = "batch, heads"       # lse's shape in words, for `_run`'s checks
    _fastcall = True   # the torch op's C++ fast path may replay its launches (meld.runtime.torch_fastcall)
    _replayable = False   # whether its op records a call's launches now: the ones every such call makes (`_op_route`)
    _op_call = None   # the entry point's call of its op on `_op_route` (set by meld.ops.torch_ops, which imports this)

    def _setup(self, graph: TaskGraph, device: object) -> None:
        self.handle = register(self)
        self.graph = graph
        self.lowering = lower(graph)
        self.device = resolve_device(device)
        if self.device.type == "cuda":   # (the torch ops' C++ kernels, built on first use)
            from .torch_ops import fast_path
            fast_path()
        config.dump(f"{graph.name}.taskgraph.json", graph.to_json())

    def __getstate__(self) -> dict:
        """copy / deepcopy / pickle: an operator on the CPU executor copies whole (its plan too); one on a GPU
        cannot be copied (its kernels' parameters point at its own device buffers): a TypeError says so."""
        if self.device.type != "cpu":
            raise TypeError(f"{type(self).__name__} on {self.device} cannot be copied or pickled: its kernel's "
                            "parameters point at its own device buffers; build another with the same arguments")
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        """A copy (copy, deepcopy, unpickling) is another operator: it gets its own handle."""
        self.__dict__.update(state)
        self.handle = register(self)

    # --- plan(): buffers sized by capacities, installed with the plan that needs them ---------------------
    def _make_buffers(self, caps: dict[str, int]):
        """New device buffers for capacities `caps` (an object with `caps`, which the kernels' parameters
        point into)."""
        raise NotImplementedError

    def _buffers_for(self, need: dict[str, int]):
        """The installed buffers when `need` fits their capacities: the plan rewrites them in place, at the same
        addresses, so a CUDA graph captured after one plan replays later plans that fit. Otherwise new ones
        (`grown` capacities), which `_commit` installs with the plan: a plan() that raises keeps the old ones,
        and graphs captured before must be captured again."""
        caps = grown({} if self._buf is None else self._buf.caps, need)
        if caps is None:
            return self._buf
        if self._buf is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the GPU may still read the old buffers, freed once replaced
        return self._make_buffers(caps)

    def _commit(self, planned: object, buf: object = None) -> None:
        """Install a validated plan and the buffers it was written into (None: the installed ones): the one
        assignment by which plan() changes the operator, after everything that can fail."""
        self._planned, self._buf = planned, self._buf if buf is None else buf

    # --- the eager route through the torch op ------------------------------------------------------------
    def _op_route(self) -> bool:
        """Whether an eager call of the entry point goes through its torch op (meld.ops.torch_ops), whose C++ fast
        path replays the launches its Python kernel recorded (meld.runtime.torch_fastcall; its host time a call
        against the Python path's: bench/RESULTS.md, 2026-12-03 fifth and sixth sessions): the fast path is
        installed on this device, the op records this operator's launches now (`_replayable`), and no torch
        function or dispatch mode and no functorch transform (vmap, ...) is active (they would see the op where
        they see the direct call's tensor operations). The caller checks that the op's schema carries its
        arguments as they are; the op's Python kernel runs the direct path's body, so its checks and errors hold.
        (Where the fast path is not installed, the first test says so.)"""
        return (torch_fastcall.installed(self.device) and self._fastcall and self._replayable
                and not torch._C._is_torch_function_mode_enabled() and not torch._C._len_torch_dispatch_stack()
                and torch._C._functorch.maybe_current_level() is None)

    # --- run(): checks, outputs, then the GPU launch or the CPU reference executor -------------------------
    def _run(self, inputs: tuple, return_lse: object, out: torch.Tensor | None, lse: torch.Tensor | None,
             **options: object):
        """The body of an attention operator's run() on `inputs` (its `_run_inputs`; one may be a tuple of
        tensors, as DecodeAttention's (k_cache, v_cache)) and its `options` (DecodeAttention's k_scale and
        v_scale): the operator checks them against the plan (`_check_run`, which gives out's shape, the tensors
        read by name and what the executor and the launch take), then on the CPU the reference executor
        computes out and lse (`_execute_cpu`), on a GPU its kernels write them (`_launch`); a batch of no
        requests launches nothing."""
        planned = self._run_start(return_lse)
        grads = None   # (the usual case, plain tensors that need no grad, tested first: run() is hot)
        if not all(type(t) is torch.Tensor and not t.requires_grad for t in inputs):
            grads = grad_inputs(*(x for t in inputs for x in (t if isinstance(t, tuple) else (t,))))
            inputs = tuple(plain(t) for t in inputs)   # (a tuple stays one: its operator's checks take it apart)
        shape, reads, args = self._check_run(planned, *inputs, **options)
        out, lse = self._run_outputs(out, lse, shape, return_lse, reads)
        if self.device.type == "cpu":
            o, l = self._execute_cpu(planned, *args)
            plain(out).copy_(o)
            if lse is not None:
                plain(lse).copy_(l)
        elif shape[0]:
            self._launch(*args, plain(out), plain(lse))
        out, lse = self._tied(grads, out, lse)
        return (out, lse) if return_lse else out

    def _run_start(self, return_lse: object):
        """run()'s first checks: a plan, a bool return_lse, no watchdog trip pending. Returns the plan."""
        planned = self._planned
        if planned is None:
            raise RuntimeError(f"{type(self).__name__}.run: call plan() first")
        if return_lse is not True and return_lse is not False:
            raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
        if self._watchdog is not None:
            self._watchdog.check()
        return planned

    def _check_run(self, planned: object, *inputs: object,
                   **options: object) -> tuple[tuple[int, int, int], dict[str, torch.Tensor], tuple]:
        """ValueError unless run()'s inputs (and options) fit the operator and `planned`. Returns out's shape,
        the tensors run() reads by argument name (no output may share their memory: `_run_outputs`), and the
        checked arguments `_execute_cpu` and `_launch` take (by default the inputs: `_reads`)."""
        raise NotImplementedError

    def _reads(self, inputs: tuple) -> tuple[dict[str, torch.Tensor], tuple]:
        """`_check_run`'s last two results for an operator whose inputs are plain tensors, read as they are."""
        return dict(zip(self._run_inputs, inputs)), inputs

    def _execute_cpu(self, planned: object, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        """out and lse of `planned` by the CPU reference executor (`self.lowering.executor`), from `_check_run`'s
        arguments."""
        raise NotImplementedError

    def _launch(self, *args: object) -> None:
        """The GPU launches of `_check_run`'s arguments, writing the outputs (the last two arguments: out and
        lse)."""
        raise NotImplementedError

    def _run_outputs(self, out, lse, shape: tuple[int, int, int], want_lse: bool,
                     reads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """run()'s outputs as given (checked: dtype, shape, device, contiguous, no memory shared with `reads`, the
        inputs, or with each other) or allocated: out [B, H, D] like the first input and, when asked for or
        given, lse [B, H] float32."""
        if out is not None:
            expect("out", out, self.dtype, shape, f"like {self._run_inputs[0]}", self.device, contiguous=True)
        if lse is not None:
            expect("lse", lse, torch.float32, shape[:2], self._lse_meaning, self.device, contiguous=True)
        if out is not None or lse is not None:   # (what run() allocates needs no check)
            check_outputs({"out": out, "lse": lse}, reads)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        if lse is None and want_lse:
            lse = torch.empty(shape[:2], dtype=torch.float32, device=self.device)
        return out, lse

    def _tied(self, grads: tuple | None, out: torch.Tensor, lse: torch.Tensor | None):
        """out and lse (the caller's tensors, in place) tied to the inputs that require grad (`grad_inputs`),
        so a backward says meld has none."""
        out, *rest = no_backward(f"meld.{type(self).__name__}.run", grads, (out, *([lse] if lse is not None else [])))
        return out, rest[0] if rest else None

    # --- the device ---------------------------------------------------------------------------------------
    def _require_hopper(self, exact: bool = False):
        """The device's properties; ValueError where meld's kernels cannot run (sm_90 needed; `exact`:
        sm_90 itself, for kernels built for sm_90a's wgmma)."""
        from ..runtime.driver import device_info

        info = device_info(self.device)
        if info.capability < (9, 0) or (exact and info.capability != (9, 0)):
            need = "sm_90a (Hopper: wgmma)" if exact else "sm_90 (Hopper) or newer"
            raise ValueError(f"device {self.device} ({info.name}, sm_{info.capability[0]}{info.capability[1]}) "
                             f"is not supported: meld's {self.lowering.family} kernels need {need}")
        return info

    def _kernels(self, cfg, entries: dict[str, tuple[int, int]]) -> dict:
        """Compile `cfg.render()` once and load its `entries` ({entry: (threads, dynamic smem bytes)})."""
        from ..runtime.driver import Kernel

        compiled = compile_source(cfg.render(), cfg.name)
        return {e: Kernel(compiled, e, self.device, threads, smem) for e, (threads, smem) in entries.items()}

    def _tuned(self, dtype: str, shape: str):
        """The tuning database's entry (`meld.tuning.db.TuningEntry`) for this operator, dtype and shape
        bucket on this GPU with these kernel sources, or None: MELD_TUNING_DB unset, the CPU executor, or no
        such entry (entries recorded elsewhere are ignored with a warning). A file that cannot be read or is
        no database (a directory, JSON nested too deeply to parse) is a ValueError naming MELD_TUNING_DB, as
        an entry whose configuration does not fit the operator is: the database asked for cannot be used."""
        path = config.tuning_db()
        if path is None or self.device.type != "cuda":
            return None
        from ..tuning.db import TuningDB, TuningKey

        try:
            db = TuningDB.load(path)
        except ValueError as e:
            raise ValueError(f"MELD_TUNING_DB: {e}") from None
        return db.lookup(TuningKey.here(self.graph.name, dtype, shape, self.device), warn=True)

    def _header(self, prof: torch.Tensor | None = None, prof_clock: torch.Tensor | None = None, prof_cap: int = 0,
                prof_every: int = 1, num_ctas: int = 0) -> dict[str, int]:
        """The KERNEL_HEADER fields (meld/codegen/params.py) of this operator's kernels: its watchdog id and
        the profiler's buffers (`_profile_buffers`; no buffer: no records); a persistent launch's grids then
        set cta_offset and wait_inputs."""
        return dict(watchdog=self._watchdog.record_ptr, watchdog_claim=self._watchdog.claim_ptr,
                    watchdog_kernel=self._watchdog_id, prof=prof.data_ptr() if prof is not None else 0,
                    prof_clock=prof_clock.data_ptr() if prof_clock is not None else 0,
                    prof_cap=prof_cap if prof is not None else 0, prof_every=prof_every, num_ctas=num_ctas,
                    cta_offset=0, wait_inputs=0)

    # --- profiles -----------------------------------------------------------------------------------------
    def _profile_buffers(self, profile: bool, ctas: int, cap: int,
                         every: int = 1) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A profiling build's buffers (None, None otherwise): `cap` records for each of `ctas` CTAs after its
        header ([ctas][1 + cap][4], zeroed), and for a build that samples one launch in `every` the sampler's
        launch number and exit tickets."""
        prof = torch.zeros(ctas, 1 + cap, 4, dtype=torch.int64, device=self.device) if profile else None
        clock = torch.zeros(2, dtype=torch.int32, device=self.device) if profile and every > 1 else None
        return prof, clock

    def last_trace(self):
        """Per-task timestamps of the last launch of this operator's persistent kernel (waits for it; with
        MELD_PROFILE_EVERY=N, of the last launch sampled): a `meld.runtime.profile.Trace`. Needs a launch of
        the kernel built with profiling (MELD_PROFILE=1 or a kernel_config with profile=True); raises
        RuntimeError otherwise, and on the CPU reference executor, which records no trace."""
        name = type(self).__name__
        if self.device.type == "cpu":
            raise RuntimeError(f"{name}.last_trace: the CPU reference executor records no trace "
                               "(profiles come from the GPU kernel)")
        records = self._profile_records()
        if records is None:
            raise RuntimeError(f"{name}.last_trace: needs a launch of the kernel built with profiling "
                               "(MELD_PROFILE=1 or a kernel_config with profile=True)")
        from ..runtime.profile import Trace

        buf, names, places = records
        torch.cuda.synchronize(self.device)
        return Trace.from_buffer(buf.cpu().numpy(), *names, **places)

    def _profile_records(self) -> tuple[torch.Tensor, tuple[int, int], dict] | None:
        """The profile buffer last_trace reads ([CTAs][1 + cap][4]), Trace.from_buffer's unit naming (units per
        request, head blocks) and the CTAs' places (clusters, grids); None: nothing recorded. By default
        `_prof`, its records named by task."""
        return None if self._prof is None else (self._prof, (1, 1), {})

    def _register_watchdog(self, name: str, describe: Callable[[int], str]) -> None:
        """This operator's kernels report to the device's record under one id (`describe` names a task from
        its number and must not hold the operator)."""
        from ..runtime import watchdog

        self._watchdog = watchdog.for_device(self.device)
        self._watchdog_id = self._watchdog.register(name, describe)
