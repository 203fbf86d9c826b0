"""Block-scaled FP8 MoE (MoE(weight_dtype=torch.float8_e4m3fn); templates/moe.cuh, MELD_FP8): its kernels
compile for sm_90a without spills, the CPU reference executor against float64, its input checks, and the GPU
kernel against float64 (marker gpu)."""
import functools

import numpy as np
import pytest
import torch

import meld
from meld.codegen.moe_kernel import FP8_BLOCK_TOKEN_CHOICES, MoeKernelConfig
from meld.runtime.moe_reference import dequantize_blocks, dequantize_groups, quantize_blocks, quantize_groups, route
from tests.kernel_matrix import nvcc
from tests.test_moe import dense_reference, skewed_logits

FP8 = torch.float8_e4m3fn
BENCH_SHAPES = [(2048, 768, 128, 8), (7168, 2048, 32, 8), (2880, 2880, 128, 4)]   # bench/moe.py: H, I, E, k


def fp8_weights(E, H, I, device="cpu", seed=1):
    """Block-scaled e4m3 w13, w13_scale, w2, w2_scale from N(0, 1/fan_in) weights (drawn on `device`, an expert
    at a time: a BENCH shape's float32 weights whole would take several GB per test process)."""
    g = torch.Generator(device).manual_seed(seed)

    def experts(n, k):
        q, s = zip(*(quantize_blocks(torch.randn(1, n, k, generator=g, device=device) / k ** 0.5) for _ in range(E)))
        return torch.cat(q), torch.cat(s)

    return (*experts(2 * I, H), *experts(H, I))


def quantised_reference(x, w13, s13, w2, s2, ids, w):
    """float64 over the dequantised weights, with x and act quantised per token per 128 as the layer does (on
    x's device, one expert's weights dequantised at a time)."""
    xq = dequantize_groups(*quantize_groups(x.float()))
    ids, w = ids.long(), w.double()
    I = w2.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        W13, W2 = dequantize_blocks(w13[e:e + 1], s13[e:e + 1])[0], dequantize_blocks(w2[e:e + 1], s2[e:e + 1])[0]
        g, u = xq[t] @ W13[:I].T, xq[t] @ W13[I:].T
        act = dequantize_groups(*quantize_groups((g * torch.sigmoid(g) * u).float()))
        out.index_add_(0, t, w[t, j, None] * (act @ W2.T))
    return out


def rel_err(out, ref):
    """||out - ref|| / ||ref|| (Frobenius): ../shared/BENCH.md's correctness figure."""
    return ((out.double() - ref).norm() / ref.norm()).item()


def max_err(out, ref):
    """max |out - ref| / max |ref|: a figure of the worst value (the stage checks' measure)."""
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


# --- compile ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bt", FP8_BLOCK_TOKEN_CHOICES)
def test_fp8_kernels_compile_for_sm90a(bt):
    """Shapes are run-time values (bench/moe.py's three run on these builds: the layer takes them, below)."""
    cfg = MoeKernelConfig(block_tokens=bt, weight_dtype="e4m3")
    src = cfg.render()
    assert "#define MELD_FP8 1" in src and f"m64n{bt}k32.f32.e4m3.e4m3" in src and "bf16.bf16" not in src
    assert cfg.name.startswith("meld_moe_e4m3_")
    cubin, log = nvcc(src, cfg.name)
    assert len(cubin) > 0
    assert "C7508" not in log and "wgmma" not in log.lower(), log
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills), f"registers spill:\n{log}"
    for H, I, E, k in BENCH_SHAPES:
        moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=8192, weight_dtype=FP8)
        assert moe._kernel_config.fp8 and moe._column_blocks(bt) == (-(-I // 128), -(-H // 256))


def test_fp8_config_is_checked():
    for kw, match in [({"block_tokens": 128}, "block_tokens=128"), ({"block_tokens": 16, "k_boxes": 2}, "k_boxes=2"),
                      ({"block_tokens": 16, "packed_weights": True}, "packed_weights=True"),
                      ({"weight_dtype": "e5m2"}, "weight_dtype='e5m2'")]:
        with pytest.raises(ValueError, match=match):
            MoeKernelConfig(**{"weight_dtype": "e4m3", **kw})
    with pytest.raises(ValueError, match="must agree"):
        meld.MoE(256, 128, 4, 2, device="cpu", weight_dtype=FP8, kernel_config=MoeKernelConfig())
    cfg = MoeKernelConfig(block_tokens=32, weight_dtype="e4m3")
    assert meld.MoE(256, 128, 4, 2, device="cpu", kernel_config=cfg).weight_dtype == FP8
    with pytest.raises(ValueError, match="weight_dtype must be"):
        meld.MoE(256, 128, 4, 2, device="cpu", weight_dtype=torch.float16)
    with pytest.raises(ValueError, match="hidden_size must be a multiple of 16"):
        meld.MoE(264, 128, 4, 2, device="cpu", weight_dtype=FP8)


# --- the CPU reference executor -----------------------------------------------------------------------
def test_quantisers_round_trip():
    a = torch.randn(9, 300)
    a[3] = 0
    q, s = quantize_groups(a)
    assert q.dtype == FP8 and s.shape == (9, 3) and torch.equal(dequantize_groups(q, s)[3], torch.zeros(300).double())
    # the scales are IEEE quotients amax / 448 in float32, as the kernel's div.rn.f32 forms them
    amax = torch.nn.functional.pad(a, (0, 84)).view(9, 3, 128).abs().amax(-1).clamp_min(1e-10).numpy()
    assert torch.equal(s, torch.from_numpy(amax / np.float32(448)))
    assert ((dequantize_groups(q, s) - a.double()).norm() / a.norm()).item() < 0.03   # e4m3: 3 mantissa bits
    w = torch.randn(2, 200, 136)
    wq, ws = quantize_blocks(w)
    assert ws.shape == (2, 2, 2) and ((dequantize_blocks(wq, ws) - w.double()).norm() / w.norm()).item() < 0.03


@pytest.mark.parametrize("T,H,I,E,k", [(1, 256, 128, 8, 2), (37, 272, 176, 6, 3), (60, 400, 336, 4, 4)])
def test_fp8_cpu_executor_matches_float64(T, H, I, E, k):
    """Against float64 over the dequantised weights with the layer's activation quantisation (x and act per
    token per 128): rel err <= 1e-2 and max err <= 3e-2 (what remains is bf16 y and the float32 act that the
    quantisation rounds). The quantisation's own error: the test below."""
    w13, s13, w2, s2 = fp8_weights(E, H, I)
    x = torch.randn(T, H).to(torch.bfloat16)
    logits = torch.randn(T, E)
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=64, weight_dtype=FP8)
    out = moe(x, logits, w13, w2, w13_scale=s13, w2_scale=s2)
    ids, w = route(logits, k, True)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    ref = quantised_reference(x, w13, s13, w2, s2, ids, w)
    assert rel_err(out, ref) <= 1e-2 and max_err(out, ref) <= 3e-2


@pytest.mark.parametrize("H,I", [s[:2] for s in BENCH_SHAPES])
def test_fp8_activation_quantisation_error(H, I):
    """What quantising x and act per token per 128 (e4m3: 3 mantissa bits) costs by itself, on BENCH's H and I:
    quantised_reference against float64 with unquantised activations, both over the same dequantised weights,
    measured 4.2-4.6% (rel err; T = 4 and 16, two to eight experts a token, all three shapes), so the layer is
    checked against quantised_reference and this is its stated distance from float64 (issue 41). Two experts
    a token keep the CPU's cost down (the figure barely moves with k)."""
    T, E = 16, 2
    w13, s13, w2, s2 = fp8_weights(E, H, I)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = route(torch.randn(T, E), E, True)
    ref = dense_reference(x, dequantize_blocks(w13, s13), dequantize_blocks(w2, s2), ids, w)
    assert 3e-2 <= rel_err(quantised_reference(x, w13, s13, w2, s2, ids, w), ref) <= 6e-2


def layer_like_buffers(x, w13, s13, w2, s2, ids, w):
    """The intermediates the FP8 layer keeps (MoE._bufs' xs, xs_scale, act, act_scale, y at rows 0..T k - 1 in
    pair order) and its out, as the kernel forms them with float32 GEMMs: a model to check stage_errors on."""
    T, k = ids.shape
    I = w2.shape[2]
    toks = torch.arange(T).repeat_interleave(k)
    xs, xsc = quantize_groups(x.float()[toks])
    b = {"xs": xs, "xs_scale": xsc.T.contiguous(), "act": torch.empty(T * k, I, dtype=FP8),
         "act_scale": torch.empty(-(-I // 128), T * k), "y": torch.empty(T * k, x.shape[1], dtype=torch.bfloat16)}
    for ex in ids.unique().tolist():
        r = (ids.reshape(-1) == ex).nonzero(as_tuple=True)[0]
        gu = dequantize_groups(xs[r], xsc[r]).float() @ dequantize_blocks(w13[ex:ex + 1], s13[ex:ex + 1])[0].float().T
        g, u = gu[:, :I], gu[:, I:]
        b["act"][r], sc = quantize_groups(g * torch.sigmoid(g) * u)
        b["act_scale"][:, r] = sc.T
        b["y"][r] = (dequantize_groups(b["act"][r], sc).float()
                     @ dequantize_blocks(w2[ex:ex + 1], s2[ex:ex + 1])[0].float().T).to(torch.bfloat16)
    out = (w[..., None] * b["y"].float().view(T, k, -1)).sum(1).to(torch.bfloat16)
    return b, out


def test_stage_errors_name_the_stage_that_departs():
    """The GPU test below on a model of the layer's intermediates: within every stage's bounds as formed, and
    each fault caught by its own stage's check."""
    T, H, I, E, k = 37, 272, 176, 6, 3
    w13, s13, w2, s2 = fp8_weights(E, H, I)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = route(torch.randn(T, E), k, True)
    pos = torch.arange(T * k).view(T, k)
    bufs, out = layer_like_buffers(x, w13, s13, w2, s2, ids, w)
    check_stages(stage_errors(x, w13, s13, w2, s2, ids, w, pos, bufs, out))

    def fault(name, edit):
        b = {n: t.clone() for n, t in bufs.items()}
        edit(b)
        with pytest.raises(AssertionError, match=name):
            check_stages(stage_errors(x, w13, s13, w2, s2, ids, w, pos, b, out))

    fault("dispatch", lambda b: b["xs_scale"][1].mul_(1.01))
    fault("act scales", lambda b: b["act_scale"][0].mul_(1.01))
    fault("act codes", lambda b: b["act"].view(torch.uint8)[:, :64].add_(2))
    fault("gemm2", lambda b: b["y"].mul_(1.01))
    with pytest.raises(AssertionError, match="combine"):
        check_stages(stage_errors(x, w13, s13, w2, s2, ids, w, pos, bufs, (out.float() * 1.02).to(torch.bfloat16)))


def test_fp8_inputs_are_checked():
    H, I, E, k = 256, 128, 4, 2
    w13, s13, w2, s2 = fp8_weights(E, H, I)
    x, logits = torch.randn(5, H).to(torch.bfloat16), torch.randn(5, E)
    moe = meld.MoE(H, I, E, k, device="cpu", weight_dtype=FP8)
    ok = dict(w13_scale=s13, w2_scale=s2)
    cases = [
        ((x, logits, w13, w2), {}, "w13_scale must be a torch.Tensor"),
        ((x, logits, w13, w2), dict(ok, w13_scale=s13[:, :1]), r"w13_scale must have shape \(4, 2, 2\)"),
        ((x, logits, w13, w2), dict(ok, w2_scale=s2.to(torch.bfloat16)), "w2_scale must have dtype torch.float32"),
        ((x, logits, w13, w2), dict(ok, w2_scale=s2.transpose(1, 2)), r"w2_scale must have shape"),
        ((x.to(FP8), logits, w13, w2), ok, "x must have dtype torch.bfloat16, got torch.float8_e4m3fn"),
        ((x, logits, w13.to(torch.bfloat16), w2), ok, "w13 must have dtype torch.float8_e4m3fn"),
        ((x, logits, w13.view(E, 2, 128, 2, 128, 1), w2), ok, r"w13 must have shape \(4, 256, 256\)"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            moe(*args, **kw)
    bf16 = meld.MoE(H, I, E, k, device="cpu")
    with pytest.raises(ValueError, match="w2 must have dtype torch.bfloat16, got torch.float8_e4m3fn"):
        bf16(x, logits, w13.to(torch.bfloat16), w2)
    with pytest.raises(ValueError, match="w13_scale is for FP8 weights"):
        bf16(x, logits, w13.to(torch.bfloat16), w2.to(torch.bfloat16), w13_scale=s13)
    with pytest.raises(ValueError, match=r"block_tokens must be one of \(16, 32, 64\)"):
        moe(x, logits, w13, w2, block_tokens=128, **ok)
    moe(x, logits, w13, w2, **ok)   # the layer still runs after every refused call


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_fp8_nan_and_inf_scales_reach_exactly_their_experts_tokens():
    """IEEE propagation to exactly the values a bad scale reaches: a NaN scale of w13 (an expert e, rows 0..127,
    K block 1) makes NaN every output row of a token routed to e (its act group 0 is NaN, so all of its y);
    an infinite scale of w2 (rows 128..255 of H, K block 0) makes those tokens' columns 128..255 infinite or
    NaN and leaves the rest finite; a NaN in x, that token's row only."""
    T, H, I, E, k = 40, 256, 128, 6, 2
    w13, s13, w2, s2 = fp8_weights(E, H, I)
    x = torch.randn(T, H).to(torch.bfloat16)
    logits = skewed_logits(T, E)
    ids, _ = route(logits, k, True)
    moe = meld.MoE(H, I, E, k, device="cpu", max_num_tokens=T, weight_dtype=FP8)
    check_bad_scales(moe, x, logits, ids, w13, s13, w2, s2)


def check_bad_scales(moe, x, logits, ids, w13, s13, w2, s2):
    """The checks of the test above, on any device, into poisoned outputs; the experts made bad are token 0's
    first choice and the last token's last."""
    T, H = x.shape
    for bad_w13, e in [(True, int(ids[0, 0])), (False, int(ids[-1, -1]))]:
        a13, a2 = s13.clone(), s2.clone()
        if bad_w13:
            a13[e, 0, 1] = float("nan")
        else:
            a2[e, 1, 0] = float("inf")
        out = poisoned(T, H, x.device)
        moe(x, logits, w13, w2, w13_scale=a13, w2_scale=a2, out=out)
        out = out.cpu()
        hit = (ids.cpu() == e).any(dim=1)
        assert out[~hit].isfinite().all(), f"expert {e}'s bad scale reached other tokens"
        if bad_w13:
            assert out[hit].isnan().all(), f"expert {e}: NaN w13 scale, not every channel of its tokens NaN"
        else:
            assert not out[hit][:, 128:].isfinite().any() and out[hit][:, :128].isfinite().all()
    xn, t = x.clone(), T // 2
    xn[t, 100] = float("nan")
    out = poisoned(T, H, x.device)
    moe(xn, logits, w13, w2, w13_scale=s13, w2_scale=s2, out=out)
    out = out.cpu()
    assert out[t].isnan().all() and out[torch.arange(T) != t].isfinite().all()


def poisoned(T, H, device):
    return torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=device)


def _code_order(q):
    """e4m3 codes as integers in value order (one e4m3 step apart: 1; +0 and -0: 0)."""
    b = q.view(torch.uint8).int()
    return torch.where(b >= 0x80, -(b & 0x7F), b)


def stage_errors(x, w13, s13, w2, s2, ids, w, pos, bufs, out):
    """Where an FP8 layer's intermediates part from float64, each stage from the layer's own input to it (so a
    stage's error is its own): dispatch (xs and xs_scale at the pairs' rows `pos` [T, k]: quantize_groups(x)
    bit for bit), gemm1 with the act quantisation (act from float64 g, u of the layer's own xs: its codes move
    at most one e4m3 step where the GEMM's rounding carries a value across a rounding boundary), gemm2 (y
    against float64 of the layer's own act) and the combine (out against float64 of its own y). `bufs`:
    MoE._bufs (xs, xs_scale, act, act_scale, y)."""
    T, k = ids.shape
    I = w2.shape[2]
    rows, toks = pos.reshape(-1).long(), torch.arange(T, device=x.device).repeat_interleave(k)
    u8 = torch.uint8   # (e4m3 tensors are indexed as bytes)
    xq, xsc = quantize_groups(x.float())
    xs, xs_scale = bufs["xs"].view(u8)[rows].view(FP8), bufs["xs_scale"][:, rows].T
    act, act_scale, y = bufs["act"].view(u8)[rows].view(FP8), bufs["act_scale"][:, rows].T, bufs["y"][rows].double()
    e = {"xs codes differing": (xs.view(u8) != xq.view(u8)[toks]).float().mean().item(),
         "xs scales differing": (xs_scale != xsc[toks]).float().mean().item()}
    aq, asc = torch.empty_like(act.view(u8)), torch.empty_like(act_scale)
    yref = torch.empty_like(y)
    xd, ad = dequantize_groups(xs, xs_scale), dequantize_groups(act, act_scale)
    for ex in ids.unique().tolist():
        r = (ids.reshape(-1) == ex).nonzero(as_tuple=True)[0]
        W13 = dequantize_blocks(w13[ex:ex + 1], s13[ex:ex + 1])[0]
        g, u = xd[r] @ W13[:I].T, xd[r] @ W13[I:].T
        q, asc[r] = quantize_groups((g * torch.sigmoid(g) * u).float())
        aq[r] = q.view(u8)
        yref[r] = ad[r] @ dequantize_blocks(w2[ex:ex + 1], s2[ex:ex + 1])[0].T
    aq = aq.view(FP8)
    steps = (_code_order(act) - _code_order(aq)).abs()
    e["act scale rel"] = ((act_scale.double() - asc.double()).abs() / asc.double()).max().item()
    e["act codes differing"] = (steps > 0).float().mean().item()
    e["act code steps"] = int(steps.max())
    # codes more than a step off, how far in the reference's units (of 448 a group): the FP8 sums' own error
    # moves codes near zero, where they are dense, by several steps but little value
    off = (act.float() * (act_scale / asc).repeat_interleave(128, 1)[:, :I] - aq.float()).abs()[steps > 1]
    e["act off > 1 step, max diff of 448"] = off.max().item() if off.numel() else 0.0
    e["act codes differing by group"] = [round(c.float().mean().item(), 4) for c in (steps > 0).split(128, dim=1)]
    aref = dequantize_groups(aq, asc)
    e["act shift"] = ((ad - aref).sum() / aref.abs().sum()).item()   # a bias of the GEMM's sums, not noise
    e["act rel"] = rel_err(ad, aref)   # (a figure: what act's differing codes amount to, norm-wise)
    e["y rel"] = max_err(y, yref)
    e["y shift"] = ((y - yref).sum() / yref.abs().sum()).item()
    # the FP8 wgmma sums' own error: y off its float64 value rounded to bf16 (on the CPU test's shape, float32
    # sums: 0.02% of y; a model of the sums truncated to 13 bits per k32 step, 6.7%)
    e["y bf16 differing"] = (y != yref.to(torch.bfloat16).double()).float().mean().item()
    oref = (w.double()[..., None] * y.view(T, k, -1)).sum(1)
    e["out rel"] = max_err(out, oref)
    return e


def check_stages(e):
    """stage_errors' figures within what each stage's own rounding explains: dispatch exact; act scales within
    1e-3 (the FP8 sums' error at a group's maximum), at most 5% of act's codes differing, each at most one step
    or within that same 1e-3 of its group's maximum (0.448 of 448; near zero e4m3 steps are finer than the sums'
    error). A CPU model of the layer with the tensor cores' FP8 sums truncated to 12 bits a k32 step (qwen3's H
    and I, T = 4, 16) moves 1.1-1.2% of the codes, up to 18 steps where |code| < 0.5, by at most 0.16 of 448;
    the H200 measured 1.0%, up to 8 steps (2026-12-03). y and out within bf16 rounding (5e-3). (The shifts are figures for the report: gemm2 runs the same FP8 wgmma sums as gemm1
    without requantising after them, so a y within bounds with act codes off clears those sums.)"""
    assert e["xs codes differing"] == 0 and e["xs scales differing"] == 0, f"dispatch's x quantisation: {e}"
    assert e["act scale rel"] <= 1e-3, f"act scales: {e}"
    assert e["act codes differing"] <= 0.05 and e["act off > 1 step, max diff of 448"] <= 0.448, f"act codes: {e}"
    assert e["y rel"] <= 5e-3, f"gemm2: {e}"
    assert e["out rel"] <= 5e-3, f"combine: {e}"


# --- GPU ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=3)
def gpu_layer(H, I, E, k):
    """A layer of a BENCH shape (capacity 1024 tokens) and its weights, kept for the shape's cases (all three
    shapes' take 5 GB)."""
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=1024, weight_dtype=FP8)
    return moe, fp8_weights(E, H, I, "cuda")


def check_against_quantised_reference(out, x, w13, s13, w2, s2, ids, w, what):
    """The GPU layer's out against quantised_reference: rel err <= 1e-2 (../shared/BENCH.md's measure) and max
    err <= 3e-2, both printed (pytest -s). Every stage is within its own rounding (test_gpu_fp8_stages_match_
    float64); what remains is act codes that the tensor cores' FP8 sums (less precise than float32) carry across
    an e4m3 rounding boundary: ~1% of act, act scales within 7e-4 (H200, 2026-12-03). A CPU model of the layer
    with those sums truncated to 12 bits a k32 step gives those figures (1.1-1.2%, 5e-4 to 9e-4) and rel err
    0.003-0.006, max err 0.004-0.013 (qwen3's H and I, T = 1, 4, 16). The H200's 0.030-0.035 (max err, four
    cases) was largely the reference's: against one with torch-on-CUDA's scales (one bit off the kernel's) the
    same model measures max err 0.017-0.020, as bf16 x often lands exactly on an e4m3 rounding tie."""
    ref = quantised_reference(x, w13, s13, w2, s2, ids, w)
    err, worst = rel_err(out, ref), max_err(out, ref)
    print(f"\n{what}: rel err {err:.3g}, max err {worst:.3g}")
    assert err <= 1e-2 and worst <= 3e-2, f"{what}: rel err {err:.3g}, max err {worst:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", [1, 7, 128, 1024])
@pytest.mark.parametrize("H,I,E,k", BENCH_SHAPES)
def test_gpu_fp8_matches_float64(H, I, E, k, T, routing):
    """BENCH's shapes (gpt-oss: H and I not multiples of 128 or 256) on fresh inputs into poisoned outputs,
    against float64 with the layer's activation quantisation (check_against_quantised_reference; the
    quantisation's own error: test_fp8_activation_quantisation_error); a second run gives the same bits."""
    moe, (w13, s13, w2, s2) = gpu_layer(H, I, E, k)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = (torch.randn(T, E) if routing == "uniform" else skewed_logits(T, E, hot=E // 3, seed=T)).cuda()
    runs = []
    for _ in range(2):
        out = poisoned(T, H, "cuda")
        moe(x, logits, w13, w2, w13_scale=s13, w2_scale=s2, out=out)
        runs.append(out)
    torch.cuda.synchronize()
    ids = moe._bufs["topk_ids"][: T * k].view(T, k)
    w = moe._bufs["topk_w"][: T * k].view(T, k)
    rids, _ = route(logits.cpu(), k, True)
    assert torch.equal(ids.cpu().sort(1).values, rids.sort(1).values), "GPU routing chose other experts"
    out = runs[0]
    assert not out.isnan().any(), f"{int(out.isnan().any(1).sum())} rows hold NaN"
    assert torch.equal(runs[0], runs[1]), "repeat runs differ"
    check_against_quantised_reference(out, x, w13, s13, w2, s2, ids, w, f"{(H, I, E, k)} T={T} {routing}")


@pytest.mark.gpu
@pytest.mark.parametrize("bt", FP8_BLOCK_TOKEN_CHOICES)
def test_gpu_fp8_every_token_block_matches_float64(bt):
    """Every FP8 token block, forced, on a shape whose H and I are not multiples of 128 and whose experts' rows
    are not multiples of a block (tiles of every width, last row blocks part full, the scales past an expert's
    rows read unclamped), against float64 with the layer's activation quantisation; repeat runs bit-identical."""
    H, I, E, k, T = 400, 336, 6, 3, 100
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=T, weight_dtype=FP8)
    w13, s13, w2, s2 = fp8_weights(E, H, I, "cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    runs = []
    for _ in range(2):
        out = poisoned(T, H, "cuda")
        moe(x, logits, w13, w2, w13_scale=s13, w2_scale=s2, out=out, block_tokens=bt)
        runs.append(out)
    torch.cuda.synchronize()
    b = moe._bufs
    ids, w = b["topk_ids"][: T * k].view(T, k), b["topk_w"][: T * k].view(T, k)
    assert not runs[0].isnan().any() and torch.equal(runs[0], runs[1]), f"block_tokens={bt}: NaN or repeat runs differ"
    check_against_quantised_reference(runs[0], x, w13, s13, w2, s2, ids, w, f"block_tokens={bt}")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [5, 40])   # one routing CTA that dispatches itself; the dispatch launch
def test_gpu_fp8_nan_and_inf_scales_reach_exactly_their_experts_tokens(T):
    H, I, E, k = 256, 128, 6, 2
    w13, s13, w2, s2 = fp8_weights(E, H, I, "cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = skewed_logits(T, E).cuda()
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=T, weight_dtype=FP8)
    moe(x, logits, w13, w2, w13_scale=s13, w2_scale=s2)
    torch.cuda.synchronize()
    ids = moe._bufs["topk_ids"][: T * k].view(T, k).cpu()
    check_bad_scales(moe, x, logits, ids, w13, s13, w2, s2)


@pytest.mark.gpu
def test_gpu_fp8_cuda_graph_replays_a_new_routing():
    """A captured FP8 call replays new x, logits and routing (into a re-poisoned output) correctly."""
    T, H, I, E, k = 100, 512, 256, 16, 4
    w13, s13, w2, s2 = fp8_weights(E, H, I, "cuda")
    moe = meld.MoE(H, I, E, k, device="cuda", max_num_tokens=T, weight_dtype=FP8)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    out = poisoned(T, H, "cuda")
    call = lambda: moe(x, logits, w13, w2, w13_scale=s13, w2_scale=s2, out=out)   # noqa: E731
    call()   # loads the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    x.copy_(torch.randn(T, H, device="cuda"))
    logits.copy_(skewed_logits(T, E, hot=5, seed=9))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ids, w = moe._bufs["topk_ids"][: T * k].view(T, k), moe._bufs["topk_w"][: T * k].view(T, k)
    # A top-k of the replayed logits (their tail holds near-ties: probabilities of 1e-8, which float rounding may
    # order either way), k distinct experts a token
    probs = torch.softmax(logits.cpu().double(), -1)
    kth = probs.topk(k, -1).values[:, -1:]
    assert (probs.gather(1, ids.cpu().long()) >= kth * (1 - 1e-4)).all()
    assert (ids.cpu().sort(1).values.diff(dim=1) > 0).all()
    assert not out.isnan().any()
    check_against_quantised_reference(out, x, w13, s13, w2, s2, ids, w, "replay")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [(BENCH_SHAPES[0], 1), (BENCH_SHAPES[0], 1024), ((512, 256, 16, 4), 100)])
def test_gpu_fp8_stages_match_float64(shape, T):
    """Issue 41, stage by stage: each stage against float64 of the layer's own input to it (stage_errors,
    check_stages); the first stage beyond its own rounding is where the kernel departs. The figures and the
    end-to-end errors are printed (pytest -s)."""
    H, I, E, k = shape
    if shape in BENCH_SHAPES:
        moe, (w13, s13, w2, s2) = gpu_layer(H, I, E, k)
    else:
        moe, (w13, s13, w2, s2) = (meld.MoE(H, I, E, k, device="cuda", max_num_tokens=T, weight_dtype=FP8),
                                   fp8_weights(E, H, I, "cuda"))
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    out = poisoned(T, H, "cuda")
    moe(x, logits, w13, w2, w13_scale=s13, w2_scale=s2, out=out)
    torch.cuda.synchronize()
    b = moe._bufs
    ids, w = b["topk_ids"][: T * k].view(T, k).long(), b["topk_w"][: T * k].view(T, k)
    pos = b["pair_pos"][: T * k].view(T, k)
    e = stage_errors(x, w13, s13, w2, s2, ids, w, pos, b, out)
    ref = quantised_reference(x, w13, s13, w2, s2, ids, w)
    print(f"\nstages {shape} T={T}: {e}; end to end rel err {rel_err(out, ref):.4g}, max err {max_err(out, ref):.4g}")
    check_stages(e)


@pytest.mark.gpu
def test_gpu_quantisers_give_the_cpus_bits():
    """quantize_groups and quantize_blocks on the GPU give the CPU's codes and scales, bit for bit (so the GPU
    tests' references quantise as the kernel and the CPU executor do: a scale off by one bit moves codes)."""
    a = torch.randn(64, 2880).to(torch.bfloat16).float() * torch.rand(64, 1) * 100
    for quantise, t in [(quantize_groups, a), (quantize_blocks, a.view(2, 32, 2880))]:
        (q, s), (qg, sg) = quantise(t), quantise(t.cuda())
        assert torch.equal(q.view(torch.uint8), qg.cpu().view(torch.uint8)) and torch.equal(s, sg.cpu())
