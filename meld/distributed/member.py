"""What every operator over a `torch.distributed` process group does the same way: join the group, open
its symmetric window, start the proxy thread of the proxy transport, make sure that thread still runs
before a launch, and stop it."""
from __future__ import annotations

import torch

from .window import SymmetricWindow


class GroupMember:
    """Mixin of the operators in meld.distributed (SeqParallelDecode, RowParallelLinear, ExpertParallelMoE)."""

    proxy = None

    def _join(self, group) -> None:
        """This rank's place in `group` (default: the default group): self.group, rank, world."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}: torch.distributed is not initialised (init_process_group first)")
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)

    def _open_window(self, nbytes: int, device: torch.device, transport: str, ordered: bool, chunk_bytes: int,
                     engine: str) -> None:
        """The symmetric window on `engine` (every byte zero before any rank counts on it) and, for the proxy
        transport, the proxy thread that carries its puts and signals (meld.distributed.proxy.GpuProxy)."""
        self.window = SymmetricWindow(nbytes, device, self.group, engine)
        if transport == "peer" and not self.window.every_rank_mapped:
            unmapped = [r for r, p in enumerate(self.window.ptrs) if not p]
            self.window.close()
            raise ValueError(f"{type(self).__name__}: transport='peer' stores into every rank's window, and ranks "
                             f"{unmapped} cannot be reached by loads and stores from rank {self.rank} (engine="
                             f"{engine!r} gives no pointer to them: another node, or PEs sharing a GPU without MPS): "
                             "use transport='proxy'")
        self.window.local.zero_()
        self._proxied = transport == "proxy"
        if self._proxied:
            from .proxy import GpuProxy
            self.proxy = GpuProxy(self.window, ordered=ordered, chunk_bytes=chunk_bytes)

    def _edge_params(self, **tables: torch.Tensor) -> dict[str, int]:
        """The parameters every cross-rank kernel takes: the peers' windows, this rank's place in the group,
        the proxy's ring (the proxy transport), and the addresses of the kernel's own `tables` by field."""
        return dict(xpeers=self.window.peers.data_ptr(), x_rank=self.rank, x_world=self.world,
                    **{k: t.data_ptr() for k, t in tables.items()}, **(self.proxy.ring_params() if self.proxy else {}))

    def _joined(self, device: torch.device) -> None:
        """The end of a rank's setup: nothing of it is pending, and every rank has got this far."""
        import torch.distributed as dist

        torch.cuda.synchronize(device)
        dist.barrier(self.group)

    def _check_proxy(self) -> None:
        """RuntimeError before a launch that would wait for a proxy thread which is closed or dead."""
        if self._proxied and (self.proxy is None or self.proxy.error is not None):
            raise RuntimeError(f"{type(self).__name__}: the proxy thread is "
                               f"{'closed' if self.proxy is None else f'dead: {self.proxy.error!r}'}")

    def close(self) -> None:
        """Stop the proxy thread (the proxy transport) and release an NVSHMEM window (collective on that engine:
        every rank closes its operators in the same order); the operator cannot run afterwards."""
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        window = getattr(self, "window", None)
        if window is not None:
            window.close()
