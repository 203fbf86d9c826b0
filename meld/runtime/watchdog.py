"""Watchdogs: a kernel that waits too long says which task and which flag it waited on.

Every spin in a meld kernel gives up after a bounded time (`DecodeKernelConfig.watchdog_ms`). The first
thread to give up on a device claims the device's record (an atomic on a device word), writes what it
waited for into the record, which lives in pinned host memory, and traps. A trap leaves the CUDA
context unusable — every later call in the process fails — but host memory can still be read, so the
Python side turns the failure into a `WatchdogTimeout` naming the task: meld's own calls check the
record before they launch and when a driver call fails, and `check()` does it on request (after
torch.cuda.synchronize() raised, for instance).

The record's layout is declared once here and generated into the kernels' source (`ParamStruct`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..codegen.params import WATCHDOG_RECORD

# What a kernel waited for (`site` in the record); the numbers are the kernels' (common.cuh, events.cuh).
SITES = {
    1: "the TMA mbarrier of KV ring stage {detail} (its tile's copies never completed)",
    3: "the gemm1 tiles of row block {detail} (the gemm2 tile's input; their counter never completed; the phase "
       "parity field holds the count waited for)",
    4: "task slot {detail} to be released by the consumer warpgroups",
    5: "ring stage {detail} to be released by the consumer warpgroups",
    6: "task slot {detail} to be filled by the producer",
    7: "the TMA copies of ring stage {detail} (the tile's bytes never arrived)",
    8: "epilogue mailbox slot {detail} to be released by the epilogue warp",
    9: "epilogue mailbox slot {detail} to be filled by the consumer warpgroups",
    10: "cross-rank flag {detail} to reach its count (the phase parity field holds the count waited for)",
    11: "the other ranks' results: {detail} units must land in this rank's window before the launch ends "
        "(a rank that never launched, or died)",
    12: "a free slot in the proxy's command ring (a proxy that stopped taking records; the phase parity field "
        "holds the slot)",
    13: "rank {detail} to start this launch before writing into its window (the phase parity field holds the "
        "launch number)",
    14: "the consumer warpgroups to stage partial {detail} of this CTA for the sender",
    15: "the sender to finish reading staged partial {detail} of this CTA",
    16: "rank {detail}'s partial words to carry this launch's tag (the phase parity field holds the launch "
        "number; a rank that never launched, or died)",
    17: "the unit's query tile to be loaded into shared memory by the loader warps",
    18: "the score warpgroup to release the query buffer (its last Q.K^T of the unit before)",
    21: "every part of the split unit ({detail} of them) to arrive for its merge",
    22: "FP8 staging stage {detail} to be released by the converter warps",
}


class WatchdogTimeout(RuntimeError):
    """A meld kernel waited longer than its watchdog allows; the message names the task and the flag.
    The CUDA context of the process is unusable afterwards (the kernel trapped)."""


@dataclass
class _Kernel:
    name: str
    describe_unit: Callable[[int], str]


class Watchdog:
    """The record of one device: pinned host memory the kernels write, and the device word they claim."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host = torch.zeros(WATCHDOG_RECORD.size, dtype=torch.uint8, pin_memory=True)
        self.record = WATCHDOG_RECORD.ctype.from_address(self._host.data_ptr())
        self._claim = torch.zeros(1, dtype=torch.int32, device=device)
        self._kernels: list[_Kernel] = []

    @property
    def record_ptr(self) -> int:
        """Device-visible address of the record (pinned host memory is mapped into the device's space)."""
        return self._host.data_ptr()

    @property
    def claim_ptr(self) -> int:
        return self._claim.data_ptr()

    def register(self, name: str, describe_unit: Callable[[int], str]) -> int:
        """An id for a kernel that reports to this record (its `watchdog_kernel` parameter).
        `describe_unit` must not hold its operator (the registry lives as long as the process)."""
        self._kernels.append(_Kernel(name, describe_unit))
        return len(self._kernels) - 1

    def tripped(self) -> bool:
        return self.record.tripped != 0

    def message(self) -> str:
        r = self.record
        k = self._kernels[r.kernel] if 0 <= r.kernel < len(self._kernels) else _Kernel(f"kernel {r.kernel}", str)
        try:   # (a describer that fails must not hide the report)
            task = f"unit {r.unit} ({k.describe_unit(r.unit)})" if r.unit >= 0 else "no task"
        except Exception as e:
            task = f"unit {r.unit} (not described: {type(e).__name__}: {e})"
        what = SITES.get(r.site, "site {site}").format(detail=r.detail, site=r.site)
        return (f"meld watchdog on {self.device}: {k.name}, CTA {r.cta} (SM {r.sm}) warp {r.warp}, working on {task}, "
                f"waited {r.waited_ns / 1e6:.0f} ms for {what}, phase parity {r.parity}; the kernel trapped and "
                "this process's CUDA context is unusable")

    def check(self) -> None:
        if self.record.tripped:
            raise WatchdogTimeout(self.message())


_lock = threading.Lock()
_watchdogs: dict[int, Watchdog] = {}


def for_device(device: torch.device) -> Watchdog:
    """The one record of a CUDA device, shared by every operator on it."""
    with _lock:
        w = _watchdogs.get(device.index)
        if w is None:
            w = _watchdogs[device.index] = Watchdog(device)
        return w


def check(device: torch.device | int | None = None) -> None:
    """Raise `WatchdogTimeout` if a meld kernel on `device` (default: any device) gave up waiting."""
    index = None if device is None else torch.device("cuda", device).index if isinstance(device, int) \
        else torch.device(device).index
    for i, w in list(_watchdogs.items()):
        if index is None or i == index:
            w.check()


def translate(error: BaseException) -> None:
    """Called with a CUDA failure: raise the `WatchdogTimeout` behind it, if there is one."""
    for w in list(_watchdogs.values()):
        if w.tripped():
            raise WatchdogTimeout(w.message()) from error
