"""The expert-parallel MoE's kernels (templates/ep_moe.cuh) compile for sm_90a, the owner's MoE build that
skips absent pairs compiles, and the symmetric window's regions are aligned and disjoint. (Two GPUs run
the operator: tests/test_dist_gpu.py; the protocol on emulated ranks: tests/test_dist_emulation.py.)"""
import shutil

import pytest

from meld.codegen.ep_kernel import EP_ENTRIES, EpKernelConfig
from meld.codegen.moe_kernel import MoeKernelConfig
from meld.distributed.expert_parallel import window_layout
from tests.kernel_matrix import nvcc

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@needs_nvcc
@pytest.mark.parametrize("cfg", [EpKernelConfig(), EpKernelConfig(transport="proxy"), EpKernelConfig(watchdog_ms=100)],
                         ids=lambda c: c.name)
def test_ep_kernels_compile_for_sm90a_without_spills(cfg):
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert cubin[:4] == b"\x7fELF"
    for entry in EP_ENTRIES:
        assert f"Compiling entry function '{entry}'" in log
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert spills and all("0 bytes spill stores" in line for line in spills), log


@needs_nvcc
@pytest.mark.parametrize("bt", [16, 128])
def test_owner_moe_build_with_absent_pairs_compiles(bt):
    cfg = MoeKernelConfig(block_tokens=bt, absent_pairs=True)
    assert cfg.name.endswith("_absent") and "#define MELD_ABSENT_PAIRS 1" in cfg.render()
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert cubin[:4] == b"\x7fELF"
    assert "#define MELD_ABSENT_PAIRS 0" in MoeKernelConfig(block_tokens=bt).render()


@pytest.mark.parametrize("T,k,H,world", [(1, 1, 8, 2), (37, 3, 264, 2), (1024, 8, 2048, 2), (5, 2, 64, 8)])
def test_window_regions_are_aligned_disjoint_and_sized(T, k, H, world):
    L = window_layout(T, k, H, world)
    slots = T * k
    need = {"started": 8 * world, "sent": 8 * world, "back": 8 * world, "hdr": 4 * world * slots,
            "wts": 4 * world * slots, "rows": 2 * H * world * slots, "ret": 2 * H * world * world * slots}
    spans = sorted((L[n], L[n] + size) for n, size in need.items())
    assert all(L[n] % 256 == 0 for n in need)
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:])), spans
    assert spans[-1][1] <= L["nbytes"]


def test_ep_kernel_config_rejects_a_bad_watchdog_or_transport():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="watchdog_ms"):
            EpKernelConfig(watchdog_ms=bad)
    with pytest.raises(ValueError, match="transport"):
        EpKernelConfig(transport="nvshmem")
    assert "#define MELD_EP_PROXY 1" in EpKernelConfig(transport="proxy").render()
    assert "#define MELD_EP_PROXY 0" in EpKernelConfig().render()


def test_moe_expert_slice_arguments_are_checked():
    import meld

    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="first_expert"):
            meld.MoE(64, 32, 4, 2, device="cpu", first_expert=bad)
    with pytest.raises(ValueError, match="GPU only"):
        meld.MoE(64, 32, 4, 2, device="cpu", first_expert=4)
    with pytest.raises(ValueError, match="GPU only"):
        meld.MoE(64, 32, 4, 2, device="cpu", kernel_config=MoeKernelConfig(absent_pairs=True))
    assert meld.MoE(64, 32, 4, 2, device="cpu").first_expert == 0


def test_expert_parallel_construction_names_the_argument(tmp_path):
    """In a process group of one (gloo, CPU): every check before a window is allocated."""
    import torch
    import torch.distributed as dist

    from meld.distributed import ExpertParallelMoE

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoE(64, 32, 8, 2, max_num_tokens=4)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for kwargs, match in [(dict(hidden_size=60), "hidden_size=60: must be a multiple of 8"),
                              (dict(intermediate_size=0), "intermediate_size must be a positive int"),
                              (dict(top_k=9), "top_k=9: expected 1..min"),
                              (dict(num_experts=64, top_k=33), "top_k=33"),
                              (dict(max_num_tokens=0), "max_num_tokens must be a positive int"),
                              (dict(dtype=torch.float16), "dtype must be torch.bfloat16"),
                              (dict(kernel_config="fast"), "kernel_config must be"),
                              (dict(device="cpu"), "device must be a CUDA device")]:
            args = dict(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, max_num_tokens=4) | kwargs
            with pytest.raises(ValueError, match=match):
                ExpertParallelMoE(args.pop("hidden_size"), args.pop("intermediate_size"), args.pop("num_experts"),
                                  args.pop("top_k"), **args)
    finally:
        dist.destroy_process_group()
