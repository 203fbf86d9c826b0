"""Fused MoE: the CPU reference executor and the GPU kernels against a float64 dense reference, the GPU
planner against the NumPy plan, and the layer's input checks."""
import dataclasses
import re

import numpy as np
import pytest
import torch

import meld
from meld.codegen.moe_kernel import (BLOCK_TOKEN_CHOICES, MAX_EXPERTS, MoeKernelConfig, block_tokens_for,
                                    route_smem_bytes, tile_token_widths, token_box_rows)
from meld.ir.work_table import MOE_TILE, ROW_BLOCKS
from meld.runtime.moe_reference import route
from meld.scheduler.moe_plan import GEMM1, GEMM2, plan_moe
from tests.kernel_matrix import nvcc


def weights(E, H, I, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    return w13.to(device), w2.to(device)


def dense_reference(x, w13, w2, ids, w):
    """float64, token by token: out[t] = sum_j w[t, j] W2[e] (SiLU(Wg[e] x[t]) * Wu[e] x[t])."""
    x, w13, w2, w = (t.double().cpu() for t in (x, w13, w2, w))
    ids = ids.long().cpu()
    I = w2.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        g, u = x[t] @ w13[e, :I].T, x[t] @ w13[e, I:].T
        out.index_add_(0, t, w[t, j, None] * ((g * torch.sigmoid(g) * u) @ w2[e].T))
    return out


def assert_close(out, ref, what=""):
    out = out.double().cpu()
    assert not out.isnan().any(), f"{what}: NaN in the output"
    err = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 2e-2 * scale + 1e-3, f"{what}: max error {err:.3g} against a scale of {scale:.3g}"


def skewed_logits(T, E, hot=0, seed=2):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    logits[: T // 2, hot] += 20.0
    return logits


# --- the plan -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,E,k,bt,lag", [(1, 8, 2, 16, 3), (50, 5, 3, 16, 0), (300, 16, 4, 32, 7), (97, 64, 8, 16, 132)])
def test_plan_covers_every_pair_once_in_dependency_order(T, E, k, bt, lag):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).numpy()
    n1, n2 = 3, 5
    p = plan_moe(ids, E, bt, n1, n2, lag)
    rows = p.pair_pos[p.pair_pos >= 0]
    assert sorted(rows.tolist()) == list(range(T * k))                      # every pair has its own row
    assert (p.row_token[p.pair_pos] == np.arange(T)[:, None]).all()
    for e in range(E):                                                       # an expert's rows, in token order
        r = np.arange(p.expert_off[e], p.expert_off[e + 1])
        assert (ids[p.row_token[r]] == e).any(axis=1).all() and (np.diff(p.row_token[r]) > 0).all()
    assert all(0 < n <= bt for n in p.row_blocks[:, 2])
    assert p.num_tiles == len(p.row_blocks) * (n1 + n2)
    t = p.tile_columns()
    seen = {}
    for ticket, (kind, rb, c, event) in enumerate(zip(t["gemm"], t["row_block"], t["col"], t["event_first"])):
        seen.setdefault((kind, rb), []).append(ticket)
        if kind == GEMM2:   # every gemm1 tile of the row block it waits for has a smaller ticket
            assert event == rb and len(seen.get((GEMM1, rb), [])) == n1
    assert all(len(v) == (n1 if kind == GEMM1 else n2) for (kind, _), v in seen.items())


def test_tile_rows_follow_the_closed_form_ticket_order():
    """The oracle's MOE_TILE rows are every (gemm, row block, col) once, at the ticket the closed form of
    templates/moe_plan.h gives it: gemm1 tile a (expert by expert, column-major) at a plus the gemm2 tiles of
    every expert due by then; an expert's gemm2 tiles from its due ticket, min(one past its last gemm1 tile +
    lag, every gemm1 tile), on. The rest of a row follows from those three fields."""
    rng = np.random.default_rng(5)
    E, n1, n2 = 12, 3, 4
    ids = np.stack([rng.permutation(E)[:3] for _ in range(200)])
    ids[ids == 7] = -1   # an empty expert
    for lag in (0, 7, 10 ** 4):
        p = plan_moe(ids, E, 16, n1, n2, lag)
        nrb = np.bincount(p.row_blocks[:, 0], minlength=E)
        rb_off = np.r_[0, np.cumsum(nrb)]
        due = np.minimum(rb_off[1:] * n1 + lag, rb_off[-1] * n1)
        want = {}
        for e in range(E):
            for c in range(n1):
                for r in range(nrb[e]):
                    a = rb_off[e] * n1 + c * nrb[e] + r
                    want[a + n2 * nrb[due <= a].sum()] = (GEMM1, rb_off[e] + r, c)
            for c in range(n2):
                for r in range(nrb[e]):
                    want[due[e] + rb_off[e] * n2 + c * nrb[e] + r] = (GEMM2, rb_off[e] + r, c)
        assert sorted(want) == list(range(p.num_tiles))
        rb, col, gemm = (np.array([want[i][j] for i in range(p.num_tiles)]) for j in (1, 2, 0))
        t = p.tile_columns()
        assert np.array_equal(t["gemm"], gemm) and np.array_equal(t["row_block"], rb) and np.array_equal(t["col"], col)
        assert np.array_equal(t["last_row_block"], rb) and np.array_equal(t["col_end"], col + 1)
        assert np.array_equal(t["event_first"], rb) and np.all(t["event_count"] == 1)
        assert np.all(t["kind"] == MOE_TILE.kind) and np.all(t["cta"] == -1) and np.all(t["slot"] == -1)
        assert not np.any([t[f] for f in ("arg1", "arg2", "arg3")])


def test_executor_refuses_a_gemm2_tile_before_its_row_block_event():
    """The CPU executor walks the rows as the kernel does: a gemm2 tile whose row block's gemm1 tiles are not
    all at smaller tickets (the kernel would wait for a ticket no CTA takes first) is an error, not a result."""
    from meld.runtime.moe_reference import execute_moe

    T, H, I, E, k = 3, 64, 64, 4, 2
    ids = np.array([[0, 1], [1, 2], [0, 2]])
    w13, w2 = weights(E, H, I)
    p = plan_moe(ids, E, 16, 1, 1, 0)
    t = p.tile_columns()
    first2 = int(np.argmax(t["gemm"] == GEMM2))
    late = int(np.nonzero((t["gemm"] == GEMM1) & (t["row_block"] == t["row_block"][first2]))[0][0])
    order = np.r_[np.delete(np.arange(p.num_tiles), late), late]   # its gemm1 tile moved to the end
    bad = dataclasses.replace(p, tiles=p.tiles.reshape(MOE_TILE.width, -1)[:, order].reshape(-1))
    x, w = torch.randn(T, H).bfloat16(), torch.rand(T, k)
    execute_moe(p, x, w13, w2, w)
    with pytest.raises(RuntimeError, match="before its row block"):
        execute_moe(bad, x, w13, w2, w)


def test_empty_experts_get_no_tiles():
    ids = np.zeros((40, 1), dtype=np.int64) + 3
    p = plan_moe(ids, 8, 16, 2, 2, 5)
    assert set(p.row_blocks[:, 0].tolist()) == {3}
    assert len(p.row_blocks) == 3 and p.num_tiles == 12


# --- codegen ------------------------------------------------------------------------------------------
def test_wide_tiles_run_the_token_widths_their_row_blocks_fill():
    """A wide kernel carries one wgmma shape per multiple of 32 tokens up to its block (an expert's last row
    block runs the narrowest that holds its rows); a narrow kernel only its block's."""
    assert tile_token_widths(128) == (32, 64, 96, 128) and tile_token_widths(64) == (32, 64)
    assert tile_token_widths(32) == (32,) and tile_token_widths(16) == (16,)
    assert [token_box_rows(b) for b in BLOCK_TOKEN_CHOICES] == [16, 32, 32, 32]
    src = MoeKernelConfig(block_tokens=128).render()
    assert all(f"m64n{n}k16" in src for n in (32, 64, 96, 128))
    assert "m64n32k16" not in MoeKernelConfig(block_tokens=16).render()


@pytest.mark.parametrize("bt", BLOCK_TOKEN_CHOICES)
@pytest.mark.parametrize("profile, k_boxes", [(False, 1), (True, 1), (False, 2)])
def test_kernels_compile_for_sm90a(bt, profile, k_boxes):
    cfg = MoeKernelConfig(block_tokens=bt, profile=profile, k_boxes=k_boxes)
    assert cfg.boxes == (k_boxes if cfg.narrow else 1) and cfg.stages >= 4
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert len(cubin) > 0
    assert "C7508" not in log, "ptxas ignored setmaxnreg: the consumer warpgroups would run on 168 registers"
    assert "wgmma" not in log.lower(), f"ptxas serialised the wgmma pipeline:\n{log}"
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills), f"registers spill:\n{log}"
    # The routing launch's static shared memory plus its key slots for the most experts fit one block.
    route_static = int(re.search(r"meld_moe_route'.*?(\d+) bytes smem", log, re.S).group(1))
    assert route_static + route_smem_bytes(MAX_EXPERTS) <= 227 * 1024


@pytest.mark.parametrize("bt", [16, 128])
def test_packed_weight_kernels_compile_for_sm90a(bt):
    """Weights packed by meld.pack_moe_weights: one bulk copy a stage (templates/moe.cuh, MELD_PACKED)."""
    cfg = MoeKernelConfig(block_tokens=bt, packed_weights=True)
    src = cfg.render()
    assert "#define MELD_PACKED 1" in src and cfg.name.endswith("_pw")
    cubin, log = nvcc(src, cfg.name)
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert len(cubin) > 0 and spills and all(" 0 bytes spill stores" in line for line in spills), log
    with pytest.raises(ValueError, match="k_boxes=2"):
        MoeKernelConfig(block_tokens=16, k_boxes=2, packed_weights=True)


@pytest.mark.parametrize("cfg", [MoeKernelConfig(block_tokens=16, l2_prefetch=True),
                                 MoeKernelConfig(block_tokens=16, packed_weights=True, l2_prefetch=True),
                                 MoeKernelConfig(block_tokens=128, l2_prefetch=True),
                                 MoeKernelConfig(block_tokens=16, weight_dtype="e4m3", l2_prefetch=True)],
                         ids=lambda c: c.name)
def test_l2_prefetch_kernels_compile_for_sm90a(cfg):
    """The option that asks L2 for a waiting gemm2 tile's weights past the ring (MELD_L2_PREFETCH): tensor-map
    prefetches, or bulk ones of packed weights, in narrow bf16 tiles (wide and FP8 ones build without it);
    off, the build is the default's (tools/same_code.py)."""
    src = cfg.render()
    assert "#define MELD_L2_PREFETCH 1" in src and cfg.name.endswith("_l2pf")
    assert "#define MELD_L2_PREFETCH 0" in MoeKernelConfig(block_tokens=16).render()
    cubin, log = nvcc(src, cfg.name)
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert len(cubin) > 0 and spills and all(" 0 bytes spill stores" in line for line in spills), log
    assert "C7508" not in log and "wgmma" not in log.lower(), log


@pytest.mark.parametrize("E,H,I", [(3, 200, 136), (2, 128, 64)])
def test_packed_weights_are_swizzled_boxes_that_unpack(E, H, I):
    """Each 64 x 64 box as TMA's 128-byte swizzle leaves it in shared memory (row r's 16-byte chunk c at
    c ^ (r % 8)), zeros past the matrix, and the packing inverts."""
    from meld.ops.moe_weights import packed_shapes, unpack_moe_weights

    w13, w2 = weights(E, H, I)
    p13, p2 = meld.pack_moe_weights(w13, w2)
    assert (tuple(p13.shape), tuple(p2.shape)) == packed_shapes(H, I, E)
    for e, kb, cb, g in [(0, 0, 0, 0), (E - 1, p13.shape[1] - 1, p13.shape[2] - 1, 1)]:
        box = p13[e, kb, cb, g]
        for r in range(64):
            for c in range(8):
                row, k0 = cb * 64 + r, kb * 64 + (c ^ (r % 8)) * 8
                want = w13[e, g * I + row, k0:k0 + 8] if row < I and k0 < H else torch.zeros(8, dtype=w13.dtype)
                assert torch.equal(box[r, c * 8:c * 8 + 8], want), (e, kb, cb, g, r, c)
    u13, u2 = unpack_moe_weights(p13, p2, H, I)
    assert torch.equal(u13, w13) and torch.equal(u2, w2)
    with pytest.raises(ValueError, match="w13 .* and w2 .* are not"):
        meld.pack_moe_weights(w13, w2[:, :, :-8])


def test_cpu_executor_takes_packed_weights_and_checks_them():
    T, H, I, E, k = 9, 200, 136, 5, 2
    w13, w2 = weights(E, H, I)
    p13, p2 = meld.pack_moe_weights(w13, w2)
    x, logits = torch.randn(T, H).to(torch.bfloat16), torch.randn(T, E)
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=16)
    assert torch.equal(moe(x, logits, p13, p2), moe(x, logits, w13, w2))
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe(x, logits, p13, w2)
    with pytest.raises(ValueError, match="w13 must have shape"):
        moe(x, logits, p13[:, :1], p2)
    with pytest.raises(ValueError, match="packed by meld.pack_moe_weights go to a meld.MoE"):
        meld.fused_moe(x, p13, p2, logits, k)


def test_block_tokens_is_one_of_the_row_blocks():
    T, H, I, E, k = 9, 64, 32, 4, 2
    w13, w2 = weights(E, H, I)
    x, logits = torch.randn(T, H).to(torch.bfloat16), torch.randn(T, E)
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=16)
    assert torch.equal(moe(x, logits, w13, w2, block_tokens=32), moe(x, logits, w13, w2))   # a GPU tiling choice
    moe.load_kernels()   # (nothing to load on the CPU)
    for bad in (48, 64.0, True, "64"):
        with pytest.raises(ValueError, match=f"block_tokens must be one of .*got {bad!r}"):
            moe(x, logits, w13, w2, block_tokens=bad)


def test_route_key_slots_are_whole_16_byte_loads():
    """A lane's keys (templates/moe.cuh: route_slots) are read four at a time, so its slots round up to 4."""
    assert route_smem_bytes(128) == 32 * 32 * 4 * 4        # 4 experts a lane
    assert route_smem_bytes(129) == 32 * 32 * 8 * 4        # a fifth expert on lane 0: a second 16-byte load
    assert route_smem_bytes(8) == 32 * 32 * 4 * 4          # one expert a lane, padded
    assert route_smem_bytes(MAX_EXPERTS) == 32 * 32 * 32 * 4


# --- the CPU reference executor -----------------------------------------------------------------------
@pytest.mark.parametrize("T,H,I,E,k", [(1, 64, 32, 4, 2), (37, 200, 136, 5, 3), (20, 64, 40, 6, 6), (9, 128, 64, 8, 1),
                                      (60, 264, 200, 4, 4)])
def test_cpu_executor_matches_dense_reference(T, H, I, E, k):
    w13, w2 = weights(E, H, I)
    x = torch.randn(T, H).to(torch.bfloat16)
    logits = torch.randn(T, E)
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=64)
    out = moe(x, logits, w13, w2)
    ids, w = route(logits, k, True)
    assert_close(out, dense_reference(x, w13, w2, ids, w), "cpu executor")
    assert torch.equal(out, meld.fused_moe(x, w13, w2, logits, k))


def test_routing_matches_torch_topk():
    logits = torch.randn(50, 16)
    ids, w = route(logits, 4, True)
    p = torch.softmax(logits, -1)
    tv, ti = p.topk(4, dim=-1)
    assert torch.equal(ids, ti)
    assert torch.allclose(w, tv / tv.sum(-1, keepdim=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=0), "top_k"), (dict(top_k=9), "top_k"), (dict(hidden_size=100), "hidden_size"),
    (dict(intermediate_size=-8), "intermediate_size"), (dict(num_experts=2000), "num_experts"),
    (dict(dtype=torch.float32), "dtype"), (dict(device="gpu"), "device"), (dict(max_num_tokens=0), "max_num_tokens"),
])
def test_constructor_errors_name_the_argument(kwargs, match):
    args = dict(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, device="cpu")
    with pytest.raises(ValueError, match=match):
        meld.MoE(**{**args, **kwargs})


def test_call_errors_name_the_argument():
    H, I, E, k = 64, 32, 8, 2
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=16)
    w13, w2 = weights(E, H, I)
    x, logits = torch.randn(4, H).to(torch.bfloat16), torch.randn(4, E)
    cases = [
        (dict(x=x.float()), "x must have dtype"), (dict(x=torch.randn(17, H).bfloat16()), "max_num_tokens"),
        (dict(w13=w13[:, :-1]), "w13 must have shape"), (dict(w2=w2.transpose(1, 2)), "w2 must have shape"),
        (dict(logits=logits[:, :5]), "router_logits must have shape"),
        (dict(logits=None), "either router_logits"),
    ]
    for over, match in cases:
        a = {**dict(x=x, logits=logits, w13=w13, w2=w2), **over}
        with pytest.raises(ValueError, match=match):
            moe(a["x"], a["logits"], a["w13"], a["w2"])
    ids = torch.tensor([[0, 1], [2, 2], [0, 1], [3, 4]])
    with pytest.raises(ValueError, match="names an expert twice"):
        moe(x, None, w13, w2, topk_weights=torch.rand(4, 2), topk_ids=ids)
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\] = 8"):
        moe(x, None, w13, w2, topk_weights=torch.rand(4, 2), topk_ids=torch.tensor([[0, 1]] * 3 + [[2, 8]]))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_usual_inputs_skip_the_full_checks_only_where_they_pass():
    """An eager call's one cheap test (`MoE._usual_inputs`) takes a serving loop's inputs, and nothing the full
    checks refuse or that plain() would change: those go to the checks, which diagnose."""
    H, I, E, k = 64, 32, 8, 2
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=16)
    w13, w2 = weights(E, H, I)
    w13p, w2p = meld.pack_moe_weights(w13, w2)
    x, logits = torch.randn(4, H).to(torch.bfloat16), torch.randn(4, E)
    tw, ids = torch.rand(4, k), torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    base = dict(x=x, logits=logits, w13=w13, w2=w2, tw=None, ids=None)
    usual = [{}, dict(logits=logits.bfloat16(), w13=w13p, w2=w2p), dict(logits=None, tw=tw, ids=ids),
             dict(logits=None, tw=tw, ids=ids.int()), dict(x=x[:0], logits=logits[:0]),
             dict(x=x.t().contiguous().t(), logits=logits.t().contiguous().t())]   # (strided x and logits: fine)
    loose = torch.empty_strided(w13.shape, (w13.shape[1] * H, 1, w13.shape[1]), dtype=torch.bfloat16)
    other = [dict(x=x.float()), dict(x=x.clone().requires_grad_()), dict(w13=torch.nn.Parameter(w13, False)),
             dict(w13=loose), dict(w13=w13p), dict(w2=w2[:, :-1]), dict(logits=logits.double()),
             dict(logits=logits[:, :-1]), dict(logits=None), dict(tw=tw, ids=ids), dict(logits=None, ids=ids),
             dict(logits=None, tw=tw, ids=ids.float()), dict(x=torch.randn(17, H).bfloat16()),
             dict(x=torch.nested.nested_tensor([torch.randn(H), torch.randn(H)]).bfloat16()),
             dict(x=x.to("meta")), dict(w2=w2.float().numpy())]
    for i, over in enumerate(usual + other):
        a = {**base, **over}
        args = (a["x"], a["logits"], a["w13"], a["w2"], a["tw"], a["ids"])
        T = moe._usual_inputs(*args)
        assert (T is not None) == (i < len(usual)), (i, over.keys())
        if T is not None:   # the full checks pass and plain() keeps every tensor
            assert T == moe._check_x(a["x"])
            moe._check_weights(a["w13"], a["w2"])
            moe._check_routing(a["logits"], a["tw"], a["ids"], T)
            assert all(meld.ops.checks.plain(t) is t for t in args)


# --- GPU ----------------------------------------------------------------------------------------------
def gpu_case(T, H, I, E, k, logits=None, renormalize=True, capacity=None, kernel_config=None, **call):
    dev = "cuda"
    w13, w2 = weights(E, H, I, dev)
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    logits = (logits if logits is not None else torch.randn(T, E)).to(dev)
    moe = meld.MoE(H, I, E, k, device=dev, max_num_tokens=capacity or max(T, 1), renormalize=renormalize,
                   kernel_config=kernel_config)
    out = torch.full((T, H), float("nan"), device=dev, dtype=torch.bfloat16)   # poisoned
    moe(x, logits, w13, w2, out=out, **call)
    torch.cuda.synchronize()
    ids = moe._bufs["topk_ids"][: T * k].view(T, k).cpu()
    w = moe._bufs["topk_w"][: T * k].view(T, k).cpu()
    rids, rw = route(logits.cpu(), k, renormalize)
    assert torch.equal(ids.sort(1).values, rids.sort(1).values), "GPU routing chose other experts"
    assert torch.allclose(w.gather(1, ids.argsort(1)), rw.gather(1, rids.argsort(1)), rtol=1e-4, atol=1e-6)
    assert_close(out, dense_reference(x, w13, w2, ids, w), f"T={T} H={H} I={I} E={E} k={k}")
    return moe, x, logits, w13, w2, out


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k", [
    (1, 256, 128, 8, 2), (7, 200, 136, 5, 3), (100, 512, 256, 16, 4), (333, 264, 200, 12, 2),
    (64, 256, 128, 8, 1), (40, 128, 64, 6, 6), (1000, 256, 384, 32, 8), (2500, 512, 256, 4, 2),
    (20, 128, 64, 40, 36),     # top_k > 32: routing writes its pairs in chunks of 32 lanes
    (5, 2568, 64, 4, 2),       # rows of x longer than one dispatch chunk (2048 elements), one partial
    (500, 264, 136, 4, 2),     # wide tiles whose last column blocks skip weight boxes past I and past H
    (1, 200, 136, 5, 3),       # one token whose row is not whole 64-element K boxes: copied, not read from x
])
def test_gpu_matches_dense_reference(T, H, I, E, k):
    gpu_case(T, H, I, E, k)


@pytest.mark.gpu
@pytest.mark.racecheck
@pytest.mark.parametrize("T,H,I,E,k,cfg", [(1, 256, 128, 8, 2, {}), (5, 2568, 64, 4, 2, {}),
                                           (500, 264, 136, 4, 2, {}), (40, 128, 64, 6, 6, {"k_boxes": 2})])
def test_gpu_small_cases(T, H, I, E, k, cfg):
    """Narrow and wide tiles, the dispatch launch and two K boxes a stage at sizes compute-sanitizer's
    racecheck runs in seconds."""
    gpu_case(T, H, I, E, k, kernel_config=MoeKernelConfig(**cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k", [(1, 256, 128, 8, 2), (7, 200, 136, 5, 3), (100, 512, 256, 16, 4),
                                       (40, 128, 64, 6, 6), (5, 2568, 64, 4, 2), (1, 320, 136, 5, 3)])
def test_gpu_two_k_boxes_a_stage_match_dense_reference(T, H, I, E, k):
    """Narrow tiles with two K boxes a ring stage (H and I not multiples of 128: a last box past K; one
    token whose row ends inside a stage is copied, not read from x)."""
    gpu_case(T, H, I, E, k, kernel_config=MoeKernelConfig(k_boxes=2))


@pytest.mark.gpu
def test_gpu_all_tokens_to_one_expert_and_most_experts_empty():
    T, E = 600, 64
    logits = torch.randn(T, E)
    logits[:, 5] += 30.0
    logits[:, 9] += 25.0
    gpu_case(T, 256, 128, E, 2, logits=logits)
    gpu_case(T, 256, 128, E, 1, logits=skewed_logits(T, E, hot=3))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k", [(1, 256, 128, 8, 2), (40, 200, 136, 6, 3), (500, 264, 136, 4, 2),
                                       (2500, 512, 256, 4, 2)])
def test_gpu_packed_weights_give_the_same_bits(T, H, I, E, k):
    """Packed weights land in shared memory as the 2-D tensor copies leave them: the same output bits."""
    moe, x, logits, w13, w2, out = gpu_case(T, H, I, E, k)
    p13, p2 = meld.pack_moe_weights(w13, w2)
    assert torch.equal(moe(x, logits, p13, p2), out)


@pytest.mark.gpu
def test_gpu_routing_order_ties_and_nan():
    """GPU routing's order: a NaN logit first, then larger logits, the smaller expert first among equal ones;
    the same experts and weight bits whether the token's routing CTA plans alone (T = 4) or is one of two."""
    H, I, E, k = 256, 128, 64, 6
    rows = torch.randn(4, E)
    rows[1, [17, 3, 9]] = rows[1].max() + 1.0    # a three-way tie at the top
    rows[2] = 0.5
    rows[2, 40] = 2.0                           # the rest all equal: the smallest ids fill the places
    rows[3, 11] = float("nan")
    w13, w2 = weights(E, H, I, "cuda")
    picks = []
    for T in (4, 40):    # one routing CTA; two
        moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=T)
        x = torch.randn(T, H, device="cuda").bfloat16()
        moe(x, rows.repeat(T // 4, 1).cuda(), w13, w2)
        torch.cuda.synchronize()
        picks.append((moe._bufs["topk_ids"][:4 * k].cpu(), moe._bufs["topk_w"][:4 * k].cpu().view(torch.int32)))
    assert torch.equal(picks[0][0], picks[1][0]) and torch.equal(picks[0][1], picks[1][1])
    ids = picks[0][0].view(4, k)
    assert ids[1, :3].tolist() == [3, 9, 17] and ids[2].tolist() == [40, 0, 1, 2, 3, 4] and ids[3, 0] == 11


@pytest.mark.gpu
@pytest.mark.parametrize("T", [5, 700])   # the lone routing CTA plans; the last of 22 plans
def test_gpu_plan_matches_numpy_plan(T):
    """The GPU planner's tables equal the NumPy oracle's: every MOE_TILE row (all fields) in ticket order, the
    row blocks, the tickets' count, the rows of each pair and each expert."""
    E, k = 16, 4
    moe, *_ = gpu_case(T, 256, 200, E, k, logits=skewed_logits(T, E))
    # Only what the launch wrote is read back (the tables' tails past this call's work hold bytes nothing
    # wrote: compute-sanitizer's initcheck reports a copy of them).
    b = moe._bufs
    ids = b["topk_ids"][: T * k].cpu().numpy().reshape(T, k)
    host = moe.plan_for(ids, T)
    n1, n2 = (-(-moe.intermediate_size // host.columns[0]), -(-moe.hidden_size // host.columns[1]))
    p = plan_moe(ids, E, block_tokens_for(T, k, E), n1, n2, moe._sm_count, host.columns)   # the NumPy oracle
    n, nrb = p.num_tiles, len(p.row_blocks)
    assert int(b["counters"][1]) == n
    rows = b["tasks"].view(MOE_TILE.width, moe._tile_cap)[:, :n].cpu().numpy()
    assert np.array_equal(rows, p.tiles.reshape(MOE_TILE.width, n)), "route's MOE_TILE rows differ from the oracle's"
    blocks = ROW_BLOCKS.unpack(b["rb"][: nrb * ROW_BLOCKS.width].cpu().numpy(), nrb)
    assert np.array_equal(np.stack([blocks[f] for f in ("expert", "first_row", "rows")], 1), p.row_blocks)
    assert np.array_equal(b["pair_pos"][: T * k].cpu().numpy().reshape(T, k), p.pair_pos)
    assert np.array_equal(b["expert_off"][:len(p.expert_off)].cpu().numpy(), p.expert_off)


@pytest.mark.gpu
def test_gpu_replans_of_fewer_tiles_read_only_their_own_rows():
    """One layer, calls of many then few then many tokens (the task table's rows past a call's tickets hold an
    earlier call's), H and I not multiples of a tile: each call against float64 into a poisoned output, fresh
    inputs every call, and a NaN in x reaching exactly its token's row."""
    H, I, E, k = 264, 200, 12, 3
    dev = "cuda"
    w13, w2 = weights(E, H, I, dev, seed=7)
    moe = meld.MoE(H, I, E, k, device=dev, max_num_tokens=400)
    g = torch.Generator().manual_seed(11)
    for T, nan_row in ((333, None), (3, None), (333, 101), (2, 1)):
        x = torch.randn(T, H, generator=g).bfloat16().to(dev)
        logits = torch.randn(T, E, generator=g).to(dev)
        if nan_row is not None:
            x[nan_row, 5] = float("nan")
        out = torch.full((T, H), float("nan"), device=dev, dtype=torch.bfloat16)
        moe(x, logits, w13, w2, out=out)
        torch.cuda.synchronize()
        ids, w = route(logits.cpu(), k, True)
        ok = [t for t in range(T) if t != nan_row]
        assert_close(out[ok], dense_reference(x[ok], w13, w2, ids[ok], w[ok]), f"T={T}")
        if nan_row is not None:
            assert out[nan_row].isnan().all(), f"T={T}: the NaN in x[{nan_row}] did not reach its whole row"


@pytest.mark.gpu
def test_gpu_bit_identical_runs_and_cuda_graph_replay():
    T, H, I, E, k = 300, 256, 128, 16, 4
    moe, x, logits, w13, w2, out = gpu_case(T, H, I, E, k, capacity=512)
    again = moe(x, logits, w13, w2)
    assert torch.equal(out, again)
    g = torch.cuda.CUDAGraph()
    static_out = torch.empty_like(out)
    with torch.cuda.graph(g):
        moe(x, logits, w13, w2, out=static_out)
    x2, l2 = torch.randn_like(x.float()).bfloat16(), torch.randn_like(logits)
    x.copy_(x2)
    logits.copy_(l2)
    g.replay()
    torch.cuda.synchronize()
    ids, w = route(l2.cpu(), k, True)
    assert_close(static_out, dense_reference(x2, w13, w2, ids, w), "graph replay with new routing")


def _check_precomputed(x, H, I, E, k, bad_ids):
    """meld's MoE on precomputed (weights, ids) against the dense reference; then each (row, col, id) of
    `bad_ids` put into a copy of the ids makes exactly that token NaN, counted once by errors()."""
    T, dev = x.shape[0], x.device
    w13, w2 = weights(E, H, I, dev)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(dev)
    w = torch.rand(T, k, device=dev)
    moe = meld.MoE(H, I, E, k, device=dev, max_num_tokens=T)
    out = moe(x, None, w13, w2, topk_weights=w, topk_ids=ids)
    assert_close(out, dense_reference(x, w13, w2, ids, w), f"precomputed routing, E={E} top_k={k}")
    for row, col, bad_id in bad_ids:
        bad = ids.clone()
        bad[row, col] = bad_id(ids[row])
        out = moe(x, None, w13, w2, topk_weights=w, topk_ids=bad)
        assert out[row].isnan().all() and not out[:row].isnan().any() and moe.errors() == 1


@pytest.mark.gpu
def test_gpu_precomputed_routing_and_top_k_equal_to_experts():
    T, H, I, E, k = 50, 256, 128, 8, 3
    x = torch.randn(T, H, device="cuda").bfloat16()
    # out of range; a repeat (the first of the two is valid, the token still becomes NaN)
    _check_precomputed(x, H, I, E, k, [(3, 1, lambda r: E + 5), (5, 2, lambda r: r[0])])
    gpu_case(T, H, I, E, E)
    # top_k > 32: pairs are checked in chunks of 32 lanes, a repeat across chunks counts too
    _check_precomputed(x, H, I, 40, 36, [(7, 34, lambda r: r[1])])


@pytest.mark.gpu
def test_gpu_nan_in_nan_out():
    T, H, I, E, k = 40, 256, 128, 8, 2
    dev = "cuda"
    w13, w2 = weights(E, H, I, dev)
    x = torch.randn(T, H, device=dev).bfloat16()
    logits = torch.randn(T, E, device=dev)
    x[5, 17] = float("nan")
    logits[9, 2] = float("nan")
    out = meld.fused_moe(x, w13, w2, logits, k)
    assert out[5].isnan().any() and out[9].isnan().all()
    ok = [t for t in range(T) if t not in (5, 9)]
    assert not out[ok].isnan().any()


@pytest.mark.gpu
def test_gpu_trace_records_every_tile():
    T, H, I, E, k = 500, 256, 128, 16, 4
    w13, w2 = weights(E, H, I, "cuda")
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=T, kernel_config=MoeKernelConfig(profile=True))
    x, logits = torch.randn(T, H, device="cuda").bfloat16(), skewed_logits(T, E).cuda()
    out = moe(x, logits, w13, w2)
    ids, w = route(logits.cpu(), k, True)
    assert_close(out, dense_reference(x, w13, w2, ids, w), "profiling build")
    trace = moe.last_trace()
    n = int(moe._bufs["counters"][1])
    tiles = sorted(t.unit for t in trace.tasks if t.kind in ("gemm1", "gemm2"))
    assert tiles == list(range(n)), "every ticket is recorded once"
    assert sum(t.kind == "combine" for t in trace.tasks) > 0 and trace.overflowed == 0


@pytest.mark.parametrize("seed", range(6))
def test_host_planner_equals_the_numpy_oracle(seed):
    """The host build of the planner rules (templates/moe_plan.h, shared with the GPU planner) against the
    independent NumPy plan: random shapes, invalid pairs, empty experts, lags shorter and longer than a plan."""
    from meld.scheduler.moe_plan import plan_moe_host

    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 40))
    k = int(rng.integers(1, E + 1))
    T = int(rng.integers(1, 300))
    hot = rng.choice(E, size=max(1, E // 3), replace=False)     # most experts empty
    ids = np.stack([rng.permutation(hot if len(hot) >= k else np.arange(E))[:k] for _ in range(T)])
    ids[rng.random(ids.shape) < 0.05] = -1
    bt, n1, n2, lag = int(rng.choice([16, 32, 64, 128])), int(rng.integers(1, 7)), int(rng.integers(1, 9)), \
        int(rng.integers(0, 300))
    a, b = plan_moe(ids, E, bt, n1, n2, lag), plan_moe_host(ids, E, bt, n1, n2, lag)
    for f in ("expert_off", "pair_pos", "row_token", "row_blocks", "tiles"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("T,E,k", [(8192, 128, 8), (1024, 32, 1), (16, 256, 8), (300, 7, 3)])
def test_row_block_capacity_holds_every_block_size_and_routing(T, E, k):
    """The row-block buffers (MoE._rb_cap) hold a plan at every block_tokens a call may choose, for uniform
    routing and for routing skewed onto few experts (an expert-parallel owner's rows: top_k = 1 over slots)."""
    moe = meld.MoE(64, 32, E, k, device="cpu", max_num_tokens=T)
    rng = np.random.default_rng(T)
    uniform = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    skewed = np.stack([np.arange(k) + rng.integers(0, 2) * k for _ in range(T)]) % E
    for ids in (uniform, skewed):
        for bt in BLOCK_TOKEN_CHOICES:
            blocks = plan_moe(ids, E, bt, 1, 1, 0).row_blocks.shape[0]
            assert blocks <= moe._rb_cap, (bt, blocks, moe._rb_cap)
