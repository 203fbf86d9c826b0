"""What the planner needs to know about the GPU: how many CTAs run at once, and in which clusters.

Thread-block clusters must fit inside one GPC, and the H200's GPCs hold different numbers of SMs, so a
single cluster size of 4 or 8 leaves SMs idle (132 SMs: 30 clusters of 4 cover 120). A mix of sizes
covers them all. `Topology` records, per cluster size, how many clusters of the real kernel can be
resident at once (`discover` asks the driver), and `cluster_mix` turns that table into the grids to
launch. It is a pure function, so the scheduler and its tests need no GPU.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


MAX_SMS = 1 << 20          # far beyond any GPU (an H200 has 132): a larger count is a mistake, and the planners
MAX_CTA_SLOTS = 1 << 20    # allocate arrays per CTA slot, so 10**12 would ask for terabytes


@dataclass(frozen=True)
class Topology:
    """The persistent grid a kernel can keep resident.

    Attributes:
        sm_count: streaming multiprocessors on the device.
        max_active_clusters: cluster size -> clusters of the kernel resident at once, from the occupancy
            calculator with the kernel's real shared memory, registers and threads. Size 1 gives the
            number of CTA slots (SMs x CTAs per SM); default {1: sm_count}.
    """

    sm_count: int
    max_active_clusters: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _is_int(self.sm_count) or self.sm_count < 1:
            raise ValueError(f"Topology.sm_count must be a positive int, got {self.sm_count!r}")
        if self.sm_count > MAX_SMS:
            raise ValueError(f"Topology.sm_count must be at most {MAX_SMS}, got {self.sm_count!r}")
        if not isinstance(self.max_active_clusters, Mapping):
            raise ValueError(f"Topology.max_active_clusters must be a mapping, got {self.max_active_clusters!r}")
        table = dict(self.max_active_clusters) or {1: self.sm_count}
        for size, n in table.items():
            if not (_is_int(size) and _is_int(n)) or size < 1 or size & (size - 1) or n < 0:
                raise ValueError(f"max_active_clusters must map powers of two to counts >= 0, got {size!r}: {n!r}")
            if size * n > MAX_CTA_SLOTS or size > MAX_CTA_SLOTS:
                raise ValueError(f"max_active_clusters[{size!r}] = {n!r} clusters of {size!r} CTAs: more than the "
                                 f"{MAX_CTA_SLOTS} CTA slots a Topology may have")
        if table.get(1, 0) < 1:
            raise ValueError(f"Topology needs max_active_clusters[1] >= 1, got {self}")
        object.__setattr__(self, "sm_count", int(self.sm_count))
        object.__setattr__(self, "max_active_clusters", {int(k): int(v) for k, v in sorted(table.items())})

    @property
    def num_ctas(self) -> int:
        """CTA slots of one persistent launch (every CTA resident at once): the planner's segments."""
        return self.max_active_clusters[1]

    @property
    def ctas_per_sm(self) -> int:
        return -(-self.num_ctas // self.sm_count)

    def resident(self, mix: Sequence[tuple[int, int]]) -> bool:
        """Whether each grid of `mix` (cluster sizes and counts, one grid per size) fits this table, every CTA
        of it resident at once: what a kernel that waits on another CTA of its grid needs (a topology given to
        an operator may promise more than the kernel's occupancy allows).

        >>> t = Topology(132, {1: 132, 2: 66, 4: 30})
        >>> t.resident(t.cluster_mix(4)), t.resident([(1, 264)])
        (True, False)
        """
        return all(n <= self.max_active_clusters.get(size, 0) for size, n in mix)

    def cluster_mix(self, preferred: int) -> list[tuple[int, int]]:
        """Cluster sizes and counts that cover every CTA slot, largest clusters first.

        Clusters live inside GPCs. Taking all `max_active_clusters[s]` clusters of size s leaves
        `m mod s` SMs free in a GPC of m SMs, and for sizes that divide each other
        floor(m / t) = (s / t) * floor(m / s) + floor((m mod s) / t), summed over GPCs:
        the clusters of size t that still fit are max_active_clusters[t] - (s / t) * (clusters of s taken).
        This is exact when the table comes from whole GPCs (as the driver's does); for any other table
        the counts are clamped, and size 1 fills whatever is left, so the mix always covers every slot.

        >>> Topology(132, {1: 132, 2: 66, 4: 30, 8: 15, 16: 7}).cluster_mix(4)
        [(4, 30), (2, 6)]
        """
        if not _is_int(preferred) or preferred < 1 or preferred & (preferred - 1):
            raise ValueError(f"preferred cluster size must be a power of two, got {preferred!r}")
        left, taken, mix = self.num_ctas, {}, []
        for size in sorted((s for s in self.max_active_clusters if s <= preferred), reverse=True):
            fits = self.max_active_clusters[size] - sum(s // size * n for s, n in taken.items())
            n = left if size == 1 else max(0, min(fits, left // size))
            if n:
                taken[size] = n
                mix.append((size, n))
                left -= size * n
        return mix

    @staticmethod
    def discover(kernel, sizes: tuple[int, ...] = (1, 2, 4, 8, 16)) -> "Topology":
        """The table for a loaded `meld.runtime.driver.Kernel`, from cuOccupancyMaxActiveClusters with
        the kernel's real shared memory, registers and threads (sizes above 8 are non-portable and
        are left out where the driver refuses them)."""
        import torch

        sm_count = torch.cuda.get_device_properties(kernel.device).multi_processor_count
        table = {s: n for s in sizes if (n := kernel.max_active_clusters(s)) > 0}
        table[1] = table.get(1) or sm_count * kernel.ctas_per_sm
        return Topology(sm_count, table)

    @staticmethod
    def h200(max_active_clusters: Mapping[int, int] | None = None) -> "Topology":
        """The H200 measured here, for planning without a GPU: 132 SMs and the table Topology.discover gave
        for the head_dim-128 kernels (one 160-200 KiB CTA per SM, bench/RESULTS.md)."""
        return Topology(132, max_active_clusters or {1: 132, 2: 66, 4: 30, 8: 15, 16: 7})


def cluster_rows(mix: Sequence[tuple[int, int]]) -> np.ndarray:
    """int32 [2, num_ctas]: for each CTA row of a launch of `mix` (cluster sizes and counts, in launch
    order), the first row of its cluster and the row after its cluster's last.

    >>> cluster_rows([(2, 2), (1, 1)]).tolist()
    [[0, 0, 2, 2, 4], [2, 2, 4, 4, 5]]
    """
    first, size = [], []
    for s, n in mix:
        first += [len(first) + i // s * s for i in range(s * n)]
        size += [s] * (s * n)
    first_a = np.asarray(first, dtype=np.int32)
    return np.stack([first_a, first_a + np.asarray(size, dtype=np.int32)])
