"""One process per GPU of this node, each with torch.distributed initialised (NCCL, a file rendezvous):
how the tests and `bench/dist.py` start ranks. Engines start theirs with torchrun or their own launcher
and hand meld the process group. `share_gpu=True` puts every rank on GPU 0 with a gloo group instead
(NCCL refuses two ranks on one GPU): the cross-rank protocols run there through CUDA IPC windows
(`meld.distributed.window`), the ranks' kernels time-sliced, which tests them, not their speed."""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Callable

# NVLink multicast stays off on the machines here (the device tool's KINDS.md).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _rank_main(rank: int, world: int, store: str, share_gpu: bool, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(SAFE_ENV)
    dev = torch.device("cuda", 0 if share_gpu else rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo" if share_gpu else "nccl", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120),
                            **({} if share_gpu else {"device_id": dev}))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args, share_gpu: bool = False) -> None:
    """Run `fn(rank, world, *args)` in `world` processes, rank r on GPU r (every rank on GPU 0 with
    `share_gpu`: module docstring); an exception in any rank is raised here (torch.multiprocessing.spawn's)."""
    import torch.multiprocessing as mp

    os.environ.update(SAFE_ENV)
    with tempfile.TemporaryDirectory(prefix="meld-dist-") as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "store"), share_gpu, fn, args), nprocs=world, join=True)
