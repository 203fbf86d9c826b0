"""What the FlashInfer wrappers (`meld.compat.flashinfer`, `meld.compat.flashinfer_mla`) share: the refusal of
an option meld does not compute, FlashInfer's dtype arguments, its workspace and its CUDA-graph buffers."""
from __future__ import annotations

import torch

from ..ops.checks import check_output, expect

_LOG2E = 1.4426950408889634   # FlashInfer's lse is base 2, meld's natural


def _unsupported(option: str, value: object, why: str) -> NotImplementedError:
    return NotImplementedError(f"meld.compat.flashinfer: {option}={value!r} is not supported: {why}")


def _dtype(name: str, value: object) -> torch.dtype:
    """FlashInfer's canonicalize_torch_dtype: a torch.dtype or its name in torch ('bfloat16')."""
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name} must be a torch.dtype or the name of one, got {value!r}")
    return dtype


def _check_workspace(buf: object) -> None:
    """FlashInfer's float workspace: a tensor on the device the wrapper runs on (meld holds it, never reads it)."""
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"float_workspace_buffer must be a torch.Tensor, got {type(buf).__name__}")
    if buf.device.type not in ("cpu", "cuda"):
        raise ValueError(f"float_workspace_buffer must be on a CUDA device (or the CPU, for meld's CPU executor), "
                         f"got {buf.device}")


def _check_graph_buffers(buffers: dict[str, object], device: torch.device) -> None:
    """A CUDA-graph wrapper's page-table buffers (use_cuda_graph=True), which its plan() writes as FlashInfer's
    does: each a contiguous 1-D int32 tensor on `device`, no two sharing memory (nor one's elements)."""
    for name, buf in buffers.items():
        if not isinstance(buf, torch.Tensor):
            raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode, got {type(buf).__name__}")
        expect(name, buf, torch.int32, (None,), "a 1-D int32 buffer", device, contiguous=True)
    checked: dict[str, torch.Tensor] = {}
    for name, buf in buffers.items():
        check_output(name, buf, checked)
        checked[name] = buf
