"""CUDA-graph capture as torch's rules ask for it, written once: warm up on a side stream (lazy
initialisation and allocations happen outside the capture), then capture on the graph's own stream."""
from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any], warmup: int = 1, pool=None, device=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of `fn()` and what the captured call returned (its tensors live in the graph's pool)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
