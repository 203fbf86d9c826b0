"""What the planner needs to know about the GPU: how many workers run at once."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """The persistent grid a kernel can keep resident.

    Attributes:
        sm_count: streaming multiprocessors on the device.
        ctas_per_sm: CTAs of the kernel resident per SM, from the occupancy calculator with the
            kernel's real shared memory, registers and threads (`meld.runtime.Kernel.occupancy`).
    """

    sm_count: int
    ctas_per_sm: int = 1

    def __post_init__(self) -> None:
        if self.sm_count < 1 or self.ctas_per_sm < 1:
            raise ValueError(f"Topology needs sm_count >= 1 and ctas_per_sm >= 1, got {self}")

    @property
    def num_ctas(self) -> int:
        """Grid size of one persistent launch: every CTA resident at once."""
        return self.sm_count * self.ctas_per_sm

    @staticmethod
    def h200(ctas_per_sm: int = 1) -> "Topology":
        """The H200 measured here (132 SMs); for planning without a GPU."""
        return Topology(132, ctas_per_sm)
