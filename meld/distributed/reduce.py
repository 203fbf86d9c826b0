"""Reductions across ranks by the last arriving part: the one cross-rank protocol the operators share.

A result that several ranks compute parts of (a request's KV ranges in sequence-parallel attention, a
tile's K slices in a row-parallel GEMM) is reduced where its parts meet: each part is put into the
owner's parts window and counted there with a fetch-add, the fetch-add lands behind the put (one fence
per destination), and the part whose count completes the set merges the parts in part order and puts
the result to the ranks that need it. No rank waits for another's work, and the result does not depend
on the order in which the parts land. This is the protocol of the CPU emulation (`EmulatedTransport`);
the GPU kernels implement the same rule (templates/decode_attention.cuh, MELD_XRANK).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LastArriverReduce:
    """Windows `{name}.parts` [keys, max_parts, *shape], `{name}.count` [keys] and `{name}.out` [keys, *shape];
    `merge` maps one key's parts, in part order ([n, *shape]), to its result."""

    name: str
    merge: Callable[[np.ndarray], np.ndarray]

    def windows(self, transport, keys: int, max_parts: int, shape: tuple[int, ...]) -> list[np.ndarray]:
        """Allocate the windows on every rank (parts and results NaN until written); returns the results'."""
        transport.window(f"{self.name}.parts", (keys, max_parts, *shape), np.float64, np.nan)
        transport.window(f"{self.name}.count", (keys,), np.int64, 0)
        return transport.window(f"{self.name}.out", (keys, *shape), np.float64, np.nan)

    def contribute(self, transport, src: int, owner: int, key: int, part: int, parts: int, value: np.ndarray,
                   to: Sequence[int]) -> bool:
        """Rank `src`'s part `part` of `parts` of `key`; the last to arrive merges and puts the result to
        every rank in `to`. Returns whether this call merged."""
        transport.put(src, owner, f"{self.name}.parts", (key, part), value)
        if transport.fetch_add(src, owner, f"{self.name}.count", key, 1) != parts - 1:
            return False
        result = self.merge(transport.get(src, owner, f"{self.name}.parts", key)[:parts])
        for r in to:
            transport.put(src, r, f"{self.name}.out", key, result)
        return True


def run_ranks(world: int, rank_main: Callable[[int], None]) -> None:
    """`rank_main(r)` on one thread per rank; the first exception of any rank is raised here."""
    errors: list[BaseException] = []

    def main(r: int) -> None:
        try:
            rank_main(r)
        except BaseException as e:   # noqa: BLE001 - reported to the caller below
            errors.append(e)

    threads = [threading.Thread(target=main, args=(r,), name=f"meld-rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
