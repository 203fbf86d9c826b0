"""Split K for the fused MoE (MoeKernelConfig.split_k; templates/moe_plan.h: moe_split): the slices the planners
choose, the host planner against the NumPy oracle, the CPU reference executor's split against float64, the
kernels compiling for sm_90a, and on the GPU the three layer shapes of issue 40 (and one whose H and I are no
multiples of a tile) against float64 at a few tokens."""
import dataclasses

import numpy as np
import pytest
import torch

import meld
from meld.codegen.moe_kernel import MoeKernelConfig, block_tokens_for, tile_columns
from meld.ir.work_table import MOE_TILE
from meld.runtime.moe_reference import route
from meld.scheduler.moe_plan import GEMM1, GEMM2, MoeSplit, plan_moe, plan_moe_host
from tests.kernel_matrix import nvcc
from tests.test_moe import assert_close, dense_reference, weights

H200_SMS = 132


def split_plan(ids, E, H, I, ctas=H200_SMS, planner=plan_moe_host, lag=None):
    T = ids.shape[0]
    bt = block_tokens_for(T, ids.shape[1], E)
    c1, c2 = tile_columns(bt)
    return planner(ids, E, bt, -(-I // c1), -(-H // c2), ctas if lag is None else lag, (c1, c2),
                   MoeSplit(ctas, 64, H, I))


def slices(plan):
    t = plan.tile_columns()
    return tuple(int(t["slices"][t["gemm"] == g].max()) for g in (GEMM1, GEMM2))


def uniform_ids(T, E, k, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(E)[:k] for _ in range(T)])


@pytest.mark.parametrize("name,H,I,E,k,want", [
    # issue 40's layers at one token: (gemm1 tiles, gemm2 tiles) = (k * I / 64, k * H / 128) against 132 SMs
    ("qwen3-30b-a3b", 2048, 768, 128, 8, (2, 2)),      # 96 and 128 tiles
    ("gpt-oss-120b", 2880, 2880, 128, 4, (1, 2)),     # 180 and 92 tiles (4 x 45, 4 x 23: last columns partial)
    ("deepseek-v3", 7168, 2048, 256, 8, (1, 1)),      # 256 and 448: they fill the SMs, no split
])
def test_slices_of_the_issue_layers_at_one_token(name, H, I, E, k, want):
    p = split_plan(uniform_ids(1, E, k), E, H, I)
    assert slices(p) == want, name
    t = p.tile_columns()
    for g, n in ((GEMM1, -(-I // 64)), (GEMM2, -(-H // 128))):
        tiles = k * n
        assert (t["gemm"] == g).sum() == tiles * want[g]
        assert want[g] == 1 or H200_SMS <= tiles * want[g] < 2 * H200_SMS   # one wave, under two


def test_no_split_when_tiles_fill_the_sms_and_slices_of_whole_stages():
    """Many tokens: the split plan is the plain plan (slice 0 of 1). Short K: at most a slice per 4 stages."""
    ids = uniform_ids(64, 128, 8)
    a, b = split_plan(ids, 128, 2048, 768), plan_moe_host(ids, 128, 16, 12, 16, H200_SMS, (64, 128))
    ta, tb = a.tile_columns(), b.tile_columns()
    assert slices(a) == (1, 1)
    for f in ("row_block", "col", "gemm"):
        assert np.array_equal(ta[f], tb[f]), f
    assert slices(split_plan(uniform_ids(1, 8, 1), 8, 512, 200)) == (2, 1)   # 8 and 4 stages: 2 and 1 slices


@pytest.mark.parametrize("seed", range(4))
def test_host_planner_equals_the_numpy_oracle_with_split(seed):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(2, 40))
    k = int(rng.integers(1, min(E, 8) + 1))
    T = int(rng.integers(1, 40))
    ids = uniform_ids(T, E, k, seed)
    ids[rng.random(ids.shape) < 0.05] = -1
    H, I = (int(v) * 8 for v in rng.integers(8, 400, 2))
    ctas, lag = int(rng.integers(4, 200)), int(rng.integers(0, 300))
    a = split_plan(ids, E, H, I, ctas, plan_moe, lag)
    b = split_plan(ids, E, H, I, ctas, plan_moe_host, lag)
    for f in ("expert_off", "pair_pos", "row_token", "row_blocks", "tiles"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def test_slice_columns_cover_k_once():
    sp = MoeSplit(132, 64, 1000, 840)
    for g, K in ((GEMM1, 1000), (GEMM2, 840)):
        for S in (1, 2, 3, 4):
            cols = [sp.slice_columns(g, s, S) for s in range(S)]
            assert cols[0].start == 0 and cols[-1].stop == K
            assert all(a.stop == b.start and a.start % 64 == 0 for a, b in zip(cols, cols[1:]))


@pytest.mark.parametrize("T", [1, 5])
def test_cpu_executor_splits_and_matches_float64(T):
    """A layer of few tiles (so both phases split) on the CPU: the float64 reference within bf16 rounding,
    and the plan it ran had slices."""
    H, I, E, k = 1096, 584, 8, 2   # 18 and 10 ring stages; neither a multiple of a tile
    w13, w2 = weights(E, H, I, seed=3)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=16, kernel_config=MoeKernelConfig(split_k=True))
    ids, w = route(logits, k, True)
    plan = moe.plan_for(ids.numpy(), T)
    s1, s2 = slices(plan)
    assert s1 > 1 and s2 > 1, (s1, s2)
    out = moe(x, logits, w13, w2)
    assert_close(out, dense_reference(x, w13, w2, ids, w), f"split K, T={T}")
    plain = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=16)(x, logits, w13, w2)
    assert (out.double() - plain.double()).abs().max() <= 2e-2 * plain.double().abs().max()


def test_config_split_k_narrow_only_and_fp8_refused():
    wide = MoeKernelConfig(block_tokens=64, split_k=True)
    assert not wide.split and wide.render() .replace("split_k=True", "split_k=False") == MoeKernelConfig(
        block_tokens=64).render()
    narrow = MoeKernelConfig(block_tokens=16, split_k=True)
    assert narrow.split and narrow.name.endswith("_sk") and "#define MELD_SPLIT_K 1" in narrow.render()
    with pytest.raises(ValueError, match="split_k with weight_dtype='e4m3'"):
        MoeKernelConfig(block_tokens=16, weight_dtype="e4m3", split_k=True)
    with pytest.raises(ValueError, match="split_k"):
        meld.MoE(256, 128, 8, 2, device="cpu", weight_dtype=torch.float8_e4m3fn,
                 kernel_config=MoeKernelConfig(block_tokens=16, weight_dtype="e4m3", split_k=True))


@pytest.mark.parametrize("bt", [16, 32])
def test_split_kernels_compile_for_sm90a(bt):
    cfg = MoeKernelConfig(block_tokens=bt, split_k=True)
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert len(cubin) > 0 and "C7508" not in log and "wgmma" not in log.lower(), log
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills), f"registers spill:\n{log}"


# --- GPU -----------------------------------------------------------------------------------------------
# issue 40's layers (fewer experts where the tiles at a few tokens do not depend on them), and one whose H
# and I are no multiples of 64 or 128
GPU_SHAPES = {"qwen3": (2048, 768, 128, 8), "gpt-oss": (2880, 2880, 32, 4), "deepseek": (7168, 2048, 32, 8),
              "odd": (1000, 840, 16, 4)}


def gpu_weights(E, H, I, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    return w13, w2


def reference64(x, w13, w2, ids, w):
    """dense_reference on the GPU in float64 (only the routed experts' weights widened)."""
    I = w2.shape[2]
    x, w = x.double(), w.double().to(x.device)
    ids = ids.to(x.device)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        a, b = w13[e].double(), w2[e].double()
        g, u = x[t] @ a[:I].T, x[t] @ a[I:].T
        out.index_add_(0, t, w[t, j, None] * ((g * torch.sigmoid(g) * u) @ b.T))
    return out.cpu()


def run_poisoned(moe, x, logits, w13, w2):
    out = torch.full((x.shape[0], moe.hidden_size), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe(x, logits, w13, w2, out=out)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_split_against_float64(shape):
    """T in {1, 2, 5, 16}, routed uniformly and all onto the same k experts (fewest tiles): float64 within bf16
    rounding into a poisoned output; the GPU planner's tiles (slices included) equal the host planner's; a
    repeat run bit-identical; a NaN in one token's x reaching exactly that token's row, the others' rows
    unchanged. Every shape but deepseek's (whose tiles fill the SMs) splits somewhere."""
    H, I, E, k = GPU_SHAPES[shape]
    w13, w2 = gpu_weights(E, H, I, seed=len(shape))
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=16, kernel_config=MoeKernelConfig(split_k=True))
    g = torch.Generator().manual_seed(H)
    seen = set()
    for T in (1, 2, 5, 16):
        for skewed in (False, True):
            what = f"{shape} T={T}{' skewed' if skewed else ''}"
            x = torch.randn(T, H, generator=g).bfloat16().cuda()
            logits = torch.randn(T, E, generator=g)
            if skewed:
                logits[:, :k] += 30.0
            logits = logits.cuda()
            out = run_poisoned(moe, x, logits, w13, w2)
            b = moe._bufs
            ids = b["topk_ids"][: T * k].view(T, k).cpu()
            w = b["topk_w"][: T * k].view(T, k).cpu()
            plan = moe.plan_for(ids.numpy(), T)
            seen.add(slices(plan))
            n = plan.num_tiles
            assert int(b["counters"][1]) == n, what
            rows = b["tasks"].view(MOE_TILE.width, moe._tile_cap)[:, :n].cpu().numpy()
            assert np.array_equal(rows, plan.tiles.reshape(MOE_TILE.width, n)), f"{what}: tiles differ"
            assert_close(out, reference64(x, w13, w2, ids, w), f"{what}, slices {slices(plan)}")
            assert torch.equal(run_poisoned(moe, x, logits, w13, w2), out), f"{what}: runs differ"
            if T > 1:
                bad = x.clone()
                bad[T // 2, H // 3] = float("nan")
                nan_out = run_poisoned(moe, bad, logits, w13, w2)
                assert nan_out[T // 2].isnan().all(), f"{what}: the NaN did not reach its whole row"
                ok = torch.arange(T) != T // 2
                assert torch.equal(nan_out[ok], out[ok]), f"{what}: the NaN reached other tokens"
    assert (seen == {(1, 1)}) == (shape == "deepseek"), seen


@pytest.mark.gpu
def test_gpu_split_cuda_graph_replays_new_routings():
    """One capture at T = 5 replayed over routings of other row-block counts (so other slice counts), each
    against float64, and against the same layer without split K within bf16 rounding."""
    H, I, E, k = GPU_SHAPES["qwen3"]
    w13, w2 = gpu_weights(E, H, I, seed=5)
    cfg = MoeKernelConfig(split_k=True)
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=16, kernel_config=cfg)
    plain = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=16)
    T = 5
    x = torch.randn(T, H, device="cuda").bfloat16()
    logits = torch.randn(T, E, device="cuda")
    static_out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe(x, logits, w13, w2, out=static_out)   # (loads the kernels outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe(x, logits, w13, w2, out=static_out)
    seen = set()
    for r in range(4):
        x.copy_(torch.randn(T, H, device="cuda").bfloat16())
        l2 = torch.randn(T, E, device="cuda")
        if r % 2:   # every token on the same k experts: fewer row blocks
            l2[:, :k] += 30.0
        logits.copy_(l2)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ids, w = route(l2.cpu(), k, True)
        seen.add(slices(moe.plan_for(ids.numpy(), T)))
        assert_close(static_out, reference64(x, w13, w2, ids, w), f"replay {r}")
        ref = plain(x, l2, w13, w2).double()
        assert (static_out.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert len(seen) > 1, f"every replay split the same way: {seen}"
    assert dataclasses.replace(cfg, block_tokens=16).split


@pytest.mark.gpu
@pytest.mark.parametrize("k_boxes,packed", [(2, False), (1, True)])
def test_gpu_split_with_two_k_boxes_and_packed_weights(k_boxes, packed):
    """Slices of two-box stages, and of weights packed by meld.pack_moe_weights, against float64 (poisoned
    output), at one token and at five on k experts."""
    H, I, E, k = GPU_SHAPES["odd"]
    w13, w2 = gpu_weights(E, H, I, seed=9)
    wk13, wk2 = meld.pack_moe_weights(w13, w2) if packed else (w13, w2)
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=8,
                   kernel_config=MoeKernelConfig(split_k=True, k_boxes=k_boxes))
    for T in (1, 5):
        x = torch.randn(T, H, device="cuda").bfloat16()
        logits = torch.randn(T, E, device="cuda")
        logits[:, :k] += 30.0 * (T > 1)
        out = run_poisoned(moe, x, logits, wk13, wk2)
        ids, w = route(logits.cpu(), k, True)
        s = slices(moe.plan_for(ids.numpy(), T))
        assert s != (1, 1), s
        assert_close(out, reference64(x, w13, w2, ids, w), f"T={T} k_boxes={k_boxes} packed={packed} slices {s}")
