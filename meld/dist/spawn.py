"""One process per GPU of this node, each with torch.distributed initialised (NCCL, a file rendezvous):
how the tests and `bench/dist.py` start ranks. Engines start theirs with torchrun or their own launcher
and hand meld the process group."""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Callable

# NVLink multicast stays off on the machines here (the device tool's KINDS.md).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _rank_main(rank: int, world: int, store: str, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args) -> None:
    """Run `fn(rank, world, *args)` in `world` processes, rank r on GPU r; an exception in any rank is
    raised here (torch.multiprocessing.spawn's)."""
    import torch.multiprocessing as mp

    os.environ.update(SAFE_ENV)
    with tempfile.TemporaryDirectory(prefix="meld-dist-") as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world, join=True)
