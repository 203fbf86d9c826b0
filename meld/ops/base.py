"""What every operator shares, written once: its task graph and the family it lowers to, the device it
runs on (the CPU reference executor, or a Hopper GPU), kernels compiled once and loaded once per module,
and the device's watchdog record. An operator adds its shapes, checks, buffers and launch order."""
from __future__ import annotations

from typing import Callable

import torch

from .. import config
from ..codegen import compile_source
from ..codegen.lowering import Lowering, lower
from ..ir import TaskGraph
from .checks import check_outputs, expect, no_backward, resolve_device
from .registry import register


class Operator:
    """Base of meld's operators. Subclasses call `_setup` first, then `_kernels` for each module."""

    graph: TaskGraph
    lowering: Lowering
    device: torch.device
    handle: int   # names this operator to its torch custom op (meld.ops.torch_ops)

    def _setup(self, graph: TaskGraph, device: object) -> None:
        self.handle = register(self)
        self.graph = graph
        self.lowering = lower(graph)
        self.device = resolve_device(device)
        config.dump(f"{graph.name}.taskgraph.json", graph.to_json())

    def __setstate__(self, state: dict) -> None:
        """A copy (copy, deepcopy, unpickling) is another operator: it gets its own handle."""
        self.__dict__.update(state)
        self.handle = register(self)

    def _run_outputs(self, out, lse, shape: tuple[int, int, int], want_lse: bool, out_meaning: str,
                     lse_meaning: str, reads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """run()'s outputs as given (checked: dtype, shape, device, contiguous, no memory shared with `reads`, the
        inputs, or with each other) or allocated: out [B, H, D] and, when asked for or given, lse [B, H] float32."""
        if out is not None:
            expect("out", out, self.dtype, shape, out_meaning, self.device, contiguous=True)
        if lse is not None:
            expect("lse", lse, torch.float32, shape[:2], lse_meaning, self.device, contiguous=True)
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
        the profiler's buffers; a persistent launch's grids then set cta_offset and wait_inputs."""
        return dict(watchdog=self._watchdog.record_ptr, watchdog_claim=self._watchdog.claim_ptr,
                    watchdog_kernel=self._watchdog_id, prof=prof.data_ptr() if prof is not None else 0,
                    prof_clock=prof_clock.data_ptr() if prof_clock is not None else 0, prof_cap=prof_cap,
                    prof_every=prof_every, num_ctas=num_ctas, cta_offset=0, wait_inputs=0)

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
        request, head blocks) and the CTAs' places (clusters, grids); None: nothing recorded."""
        return None

    def _register_watchdog(self, name: str, describe: Callable[[int], str]) -> None:
        """This operator's kernels report to the device's record under one id (`describe` names a task from
        its number and must not hold the operator)."""
        from ..runtime import watchdog

        self._watchdog = watchdog.for_device(self.device)
        self._watchdog_id = self._watchdog.register(name, describe)
