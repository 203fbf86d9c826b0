"""FlashInfer's decode variants on `meld.DecodeAttention` (issue 42, item 3): logits_soft_cap (each scaled score s
becomes c * tanh(s / c) before the softmax), window_left (the query attends to its request's last w + 1 keys) and
pos_encoding_mode="ROPE_LLAMA" (Llama's rotary embedding inside attention: keys at their positions, the query at
its request's last), through the operator, the torch op and the FlashInfer wrapper; fast_plan; head_dim 512
planned, others refused.

The reference is float64 attention computed here, request by request, from the page table as given (not from the
table plan() keeps for a window): meld's executor and kernel are compared with it, never with each other. Lengths
are off the page and tile sizes, windows end mid-page, outputs are NaN-poisoned first, and the topology is small
enough that long requests split, so pieces before the window (empty ones) merge like any other. GPU (`gpu`): the
kernel's builds (cp.async and TMA rings, head_dim 64/128/256, FP8, batch-invariant) against the same reference.
"""
import dataclasses
import functools
import math

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig, DecodeVariant
from meld.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan
from meld.ops import torch_ops
from meld.ops.page_table import window_page_table
from meld.scheduler import DecodeCost, Topology
from meld.workloads import paged

BF16 = torch.bfloat16
LENS = [37, 0, 250, 1, 1003, 115, 18]   # no length a multiple of the 16-token tile or of the page
SMALL = Topology(12, {1: 12})           # few CTAs: the long requests split into several pieces
# A planner that splits even short units: pieces of a windowed request then lie wholly before its window
# (keys of its first page that the window masks), so their partials are empty (l = 0) and must merge as such.
FINE = DecodeCost(item_overhead_tokens=16, min_split_tokens=16, min_cta_tokens=16, round_tokens=16)


def rotate(x, pos, theta, scale):
    """Llama's "rotate half" RoPE of x [..., n, D] at positions pos [n] (FlashInfer's: f_i = theta^(-2i/D) / scale,
    channel i < D/2 with i + D/2), in float64."""
    D = x.shape[-1]
    freq = theta ** (-2.0 * torch.arange(D // 2, dtype=torch.float64) / D) / scale
    angle = pos.double()[:, None] * freq
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference(q, k, v, pb, sm_scale, cap=0.0, window_left=-1, rope=None):
    """float64 decode attention over K and V [pages, page_size, Hkv, D] (NHD), the scaled scores capped to
    cap * tanh(s / cap) when cap > 0, each request's query attending to its last window_left + 1 keys (all when
    -1); rope = (theta, scale): q rotated at position n - 1 and each key at its own, as FlashInfer's decode does.
    Returns (out [B, Hq, D], lse [B, Hq], natural log); an empty request gives zeros and -inf."""
    B, Hq, D = q.shape
    P, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), -math.inf, dtype=torch.float64)
    indptr, last = pb.kv_indptr.tolist(), pb.kv_last_page_len.tolist()
    for b in range(B):
        pages = pb.kv_indices[indptr[b]:indptr[b + 1]].long().cpu()
        if not len(pages):
            continue
        n = (len(pages) - 1) * P + last[b]
        first = 0 if window_left < 0 else max(0, n - 1 - window_left)
        kb = k[pages].reshape(-1, Hkv, D)[first:n].double().cpu()
        vb = v[pages].reshape(-1, Hkv, D)[first:n].double().cpu()
        qb = q[b].double().cpu()
        if rope:
            kb = rotate(kb.transpose(0, 1), torch.arange(first, n), *rope).transpose(0, 1)
            qb = rotate(qb[None], torch.tensor([n - 1]), *rope)[0]
        s = torch.einsum("hgd,nhd->hgn", qb.view(Hkv, G, D), kb) * sm_scale
        if cap:
            s = cap * torch.tanh(s / cap)
        lse[b] = torch.logsumexp(s, dim=-1).reshape(Hq)
        out[b] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, dim=-1), vb).reshape(Hq, D)
    return out, lse


def _on(pb, device):
    """A PagedBatch's tables on `device`."""
    return dataclasses.replace(pb, **{f: getattr(pb, f).to(device) for f in ("kv_indptr", "kv_indices",
                                                                            "kv_last_page_len")})


def _inputs(lens, P, Hq=8, Hkv=2, D=64, dtype=BF16, device="cpu", scale=1.0):
    """A paged batch with random K, V (NHD) and q; `scale` stretches q so that scores reach a small cap."""
    pb = _on(paged(lens, P), device)
    k, v = (torch.randn(pb.num_pages, P, Hkv, D, device=device).to(dtype) for _ in range(2))
    q = (torch.randn(len(lens), Hq, D, device=device) * scale).to(dtype)
    return pb, q, k, v


def _check(out, lse, ref, ref_lse, tol=1e-2, lse_tol=2e-3):
    assert not out.isnan().any() and not lse.isnan().any()
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e}"
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite().cpu(), finite)
    assert (lse.double().cpu() - ref_lse)[finite].abs().max().item() < lse_tol


# (logits_soft_cap, window_left, page_size): a cap that bites (scores reach it) and a loose one (Gemma 2's 50);
# windows of 0 (the last key alone), one inside a tile, ones ending mid-page and one longer than every request.
CASES = [(2.0, -1, 16), (50.0, -1, 5), (None, 0, 16), (None, 5, 1), (None, 37, 16), (None, 300, 7), (None, 5000, 16),
         (3.0, 100, 16), (3.0, 20, 64)]


@pytest.mark.parametrize("cap,window,P", CASES)
def test_executor_matches_float64(cap, window, P):
    pb, q, k, v = _inputs(LENS, P, scale=3.0)
    attn = meld.DecodeAttention(8, 2, 64, P, BF16, "cpu", topology=SMALL, logits_soft_cap=cap, window_left=window)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    items = attn.schedule.validate().items()
    if window < 0 or window >= 300:   # (a short window leaves too little work to split)
        assert (items["slot"] >= 0).any(), "the test must exercise split units and merges"
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan)
    attn.run(q, torch.stack([k, v], dim=1), out=out, lse=lse)
    _check(out, lse, *reference(q, k, v, pb, attn.sm_scale, cap or 0.0, window))
    if window >= 0:   # plan() left out the pages wholly before each window: fewer than page_size keys too many
        assert (attn.schedule.kv_len <= torch.tensor([min(n, window + P) for n in LENS]).numpy()).all()


# (rope_theta, rope_scale, logits_soft_cap, window_left, page_size, head_dim): Llama 2's and Llama 3's bases, a
# scaled one, alone and with a cap and a window (the pages before the window shift the positions plan() keeps:
# the keys' offsets from the query must not move).
ROPE_CASES = [(1e4, None, None, -1, 16, 64), (5e5, 8.0, None, -1, 5, 128), (1e4, 2.0, 3.0, 37, 16, 128),
              (1e6, None, None, 300, 7, 64), (1e4, None, 50.0, 3, 1, 64)]


@pytest.mark.parametrize("theta,scale,cap,window,P,D", ROPE_CASES)
def test_rope_on_the_executor(theta, scale, cap, window, P, D):
    pb, q, k, v = _inputs(LENS, P, D=D)
    attn = meld.DecodeAttention(8, 2, D, P, BF16, "cpu", topology=SMALL, logits_soft_cap=cap, window_left=window,
                                pos_encoding_mode="ROPE_LLAMA", rope_theta=theta, rope_scale=scale)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan)
    attn.run(q, torch.stack([k, v], dim=1), out=out, lse=lse)
    _check(out, lse, *reference(q, k, v, pb, attn.sm_scale, cap or 0.0, window, (theta, scale or 1.0)))
    plain = meld.DecodeAttention(8, 2, D, P, BF16, "cpu", topology=SMALL, logits_soft_cap=cap, window_left=window)
    plain.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert (plain.run(q, torch.stack([k, v], dim=1)) - out).abs().max() > 0.05, "RoPE changed nothing"


@pytest.mark.parametrize("window,P", [(5, 64), (3, 128)])
def test_pieces_wholly_before_the_window_merge_as_empty(window, P):
    pb, q, k, v = _inputs([1003, 700, 9], P)
    attn = meld.DecodeAttention(8, 2, 64, P, BF16, "cpu", topology=Topology(32, {1: 32}), cost=FINE,
                                window_left=window)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    s = attn.schedule.validate()
    it = s.items()
    assert ((it["slot"] >= 0) & (it["kv_end"] <= s.kv_len[it["req"]] - 1 - window)).any(), "no empty piece"
    out, lse = attn.run(q, torch.stack([k, v], dim=1), return_lse=True)
    _check(out, lse, *reference(q, k, v, pb, attn.sm_scale, 0.0, window))


def test_cap_changes_the_result_and_window_minus_one_is_all():
    """The variants are not no-ops here (a cap the scores reach; a window shorter than the requests), and
    window_left=-1, logits_soft_cap None or 0 are plain attention, bit for bit."""
    pb, q, k, v = _inputs(LENS, 16, scale=3.0)
    cache = torch.stack([k, v], dim=1)

    def run(**kw):
        attn = meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu", topology=SMALL, **kw)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        return attn.run(q, cache, return_lse=True)

    plain = run()
    for kw in (dict(logits_soft_cap=0.0), dict(logits_soft_cap=None, window_left=-1), dict(logits_soft_cap=0)):
        assert all(torch.equal(a, b) for a, b in zip(run(**kw), plain)), kw
    for kw in (dict(logits_soft_cap=2.0), dict(window_left=40)):
        assert (run(**kw)[0] - plain[0]).abs().max() > 0.05, kw


@pytest.mark.parametrize("window,P", [(37, 16), (0, 5)])
def test_batch_invariant_window(window, P):
    """Batch-invariant plans (chunks of a request's own length) with a window: exact, and a request's result the
    same alone as in the batch."""
    pb, q, k, v = _inputs(LENS, P)
    attn = meld.DecodeAttention(8, 2, 64, P, BF16, "cpu", topology=SMALL, batch_invariant=True, window_left=window,
                                logits_soft_cap=30.0)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = attn.run(q, torch.stack([k, v], dim=1), return_lse=True)
    _check(out, lse, *reference(q, k, v, pb, attn.sm_scale, 30.0, window))


def test_non_finite_scores_stay_nan_under_the_cap():
    """An Inf in K is NaN in its rows' out and lse (the cap must not turn it into a finite c); other rows exact."""
    pb, q, k, v = _inputs([40, 70], 16)
    k[int(pb.kv_indices[0]), 3, 1, 7] = math.inf   # request 0, kv head 1 (q heads 4-7)
    attn = meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu", topology=SMALL, logits_soft_cap=5.0, window_left=60)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = attn.run(q, torch.stack([k, v], dim=1), return_lse=True)
    assert out[0, 4:].isnan().all() and lse[0, 4:].isnan().all()
    ref, ref_lse = reference(q, k, v, pb, attn.sm_scale, 5.0, 60)
    assert torch.allclose(out[0, :4].double(), ref[0, :4], atol=2e-2) and not out[1].isnan().any()


@pytest.mark.parametrize("window", [0, 3, 16, 40, 10 ** 6])
@pytest.mark.parametrize("P", [1, 4, 16])
def test_window_page_table(window, P):
    """Each request keeps the pages holding its last window + 1 tokens, in order, and its last page's fill."""
    lens = [0, 1, 17, 64, 65, 129, 0, 3]
    pb = paged(lens, P)
    indices = torch.cat([pb.kv_indices, torch.full((5,), -7, dtype=torch.int32)])   # entries past kv_indptr[-1]
    indptr, kept = window_page_table(pb.kv_indptr, indices, pb.kv_last_page_len, P, window)
    assert indptr.dtype == kept.dtype == torch.int32 and len(kept) == len(indices) and indptr[0] == 0
    for b, n in enumerate(lens):
        pages = pb.kv_indices[pb.kv_indptr[b]:pb.kv_indptr[b + 1]]
        skip = max(0, n - 1 - window) // P if n else 0
        assert torch.equal(kept[indptr[b]:indptr[b + 1]], pages[skip:]), (b, n)


# --- the torch op and the wrapper ---------------------------------------------------------------------------------
def test_op_and_compiled_model_run_the_variant():
    pb, q, k, v = _inputs(LENS, 16, scale=3.0)
    attn = meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu", topology=SMALL, logits_soft_cap=2.0, window_left=50)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    cache = torch.stack([k, v], dim=1)
    out, lse = torch_ops.decode_attention(attn, q, cache, return_lse=True)
    _check(out, lse, *reference(q, k, v, pb, attn.sm_scale, 2.0, 50))
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q, cache, torch.empty_like(q), torch.empty(q.shape[:2]), attn.handle, None, 1.0, 1.0))
    step = torch.compile(lambda q, c: attn.run(q, c) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(step(q, cache), out * 2)


@pytest.mark.parametrize("cap,window,layout,rope", [(2.0, -1, "NHD", None), (None, 37, "HND", None),
                                                    (0.0, 0, "NHD", (1e4, None)), (4.0, 90, "HND", (5e5, 4.0))])
def test_wrapper_plans_the_variant(cap, window, layout, rope):
    """plan(logits_soft_cap=, window_left=, pos_encoding_mode="ROPE_LLAMA", rope_theta=, rope_scale=) as FlashInfer
    takes them (lse base 2); run(window_left=) may repeat plan()'s; forward() takes plan()'s options."""
    P = 16
    pb, q, k, v = _inputs(LENS, P, scale=3.0)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), layout)
    mode = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=rope[0], rope_scale=rope[1]) if rope else \
        dict(rope_theta=123.0)   # (ignored without ROPE_LLAMA, as FlashInfer ignores it)
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, P, window_left=window, logits_soft_cap=cap,
           q_data_type=BF16, **mode)
    cache = torch.stack([k, v], dim=1) if layout == "NHD" else torch.stack([k, v], dim=1).transpose(2, 3)
    out, lse = w.run(q, cache, return_lse=True, window_left=window)
    _check(out, lse / math.log2(math.e), *reference(q, k, v, pb, 1 / 8, cap or 0.0, window,
                                                    rope and (rope[0], rope[1] or 1.0)))
    assert torch.equal(w.forward(q, cache, window_left=window, logits_soft_cap=cap, **mode), out)
    with pytest.raises(ValueError, match=f"window_left must be None or plan\\(\\)'s window_left={window}, got 3"):
        w.run(q, cache, window_left=3)
    with pytest.raises(NotImplementedError, match="logits_soft_cap=7.0 is not supported: forward"):
        w.forward(q, cache, window_left=window, logits_soft_cap=7.0, **mode)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode=.* is not supported: forward"):
        w.forward(q, cache, window_left=window, logits_soft_cap=cap, pos_encoding_mode="NONE" if rope else "ROPE_LLAMA")


def test_wrapper_refuses_alibi():
    pb = paged(LENS, 16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    args = (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 16)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode='ALIBI' is not supported: meld's kernel has no"):
        w.plan(*args, pos_encoding_mode="ALIBI", q_data_type=BF16)
    for kw, match in [(dict(rope_theta=-1.0), "rope_theta must be a positive number .*got -1.0"),
                      (dict(rope_scale=math.nan), "rope_scale must be a finite number, got nan"),
                      (dict(rope_theta="1e4"), "rope_theta must be a finite number, got '1e4'")]:
        with pytest.raises(ValueError, match=match):
            w.plan(*args, pos_encoding_mode="ROPE_LLAMA", q_data_type=BF16, **kw)
    assert w._op is None


def test_wrapper_keeps_one_operator_per_variant():
    pb, q, k, v = _inputs(LENS, 16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    args = (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 16)
    w.plan(*args, q_data_type=BF16, window_left=10)
    windowed = w._op
    w.plan(*args, q_data_type=BF16)
    assert w._op is not windowed and w._op.variant == DecodeVariant()
    w.plan(*args, q_data_type=BF16, window_left=10)
    assert w._op is windowed


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_wrapper_sm_scale_under_the_cap_and_tensor_cores_either_way(use_tensor_cores):
    """sm_scale scales the scores before the cap (FlashInfer's pre-tanh scale sm_scale / c); use_tensor_cores is
    accepted either way and changes nothing (the kernel is meld's)."""
    pb, q, k, v = _inputs(LENS, 16, scale=3.0)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), use_tensor_cores=use_tensor_cores)
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 16, window_left=60, logits_soft_cap=2.0,
           q_data_type=BF16, sm_scale=0.3)
    assert w.use_tensor_cores is use_tensor_cores
    out, lse = w.run(q, torch.stack([k, v], dim=1), return_lse=True)
    _check(out, lse / math.log2(math.e), *reference(q, k, v, pb, 0.3, 2.0, 60))


PLAN = dict(window_left=40, logits_soft_cap=2.0, q_data_type=BF16)


def test_fast_plan_is_plan():
    """FlashInfer's fast_decode_plan (a function engines bind to a wrapper) and the method fast_plan plan as plan()
    does, global_override_indptr_cpu standing for indptr; they validate as plan() and a failed one changes
    nothing."""
    pb, q, k, v = _inputs(LENS, 16, scale=3.0)
    cache = torch.stack([k, v], dim=1)
    args = (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    w.plan(*args, **PLAN)
    want = w.run(q, cache, return_lse=True)
    for how in ("method", "function", "override"):
        w2 = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
        if how == "method":
            w2.fast_plan(*args, **PLAN)
        elif how == "function":
            functools.partial(fast_decode_plan, w2)(*args, **PLAN)
        else:   # the host copy is what meld plans from (the indptr given is never read)
            w2.fast_plan(torch.full_like(pb.kv_indptr, -1), *args[1:], global_override_indptr_cpu=pb.kv_indptr, **PLAN)
        assert all(torch.equal(a, b) for a, b in zip(w2.run(q, cache, return_lse=True), want)), how
    w.fast_plan(*args)   # q_data_type None: FlashInfer's plan default, float16
    assert w._op.dtype is torch.float16
    w.fast_plan(*args, **PLAN)
    op = w._op
    for kw, error, match in [
            (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be None, 0 .*got -1.0"),
            (dict(window_left=-3), ValueError, "window_left must be -1 .*got -3"),
            (dict(pos_encoding_mode="ALIBI"), NotImplementedError, "pos_encoding_mode='ALIBI' is not supported"),
            (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=0.0), ValueError,
             "rope_theta must be a positive number .*got 0.0"),
            (dict(global_override_indptr_cpu=pb.kv_indptr.long()), ValueError,
             "global_override_indptr_cpu must have dtype torch.int32, got torch.int64"),
            (dict(global_override_indptr_cpu=pb.kv_indptr[:3]), ValueError,
             r"global_override_indptr_cpu must have indptr's shape \(8,\), got \(3,\)")]:
        with pytest.raises(error, match=match):
            w.fast_plan(*args, **{**PLAN, **kw})
    assert w._op is op and all(torch.equal(a, b) for a, b in zip(w.run(q, cache, return_lse=True), want))
    with pytest.raises(ValueError, match="fast_decode_plan's first argument must be a BatchDecodeWithPagedKVCache"):
        fast_decode_plan(object(), *args)


def test_head_dim_512_plans_and_others_are_refused_by_name():
    pb = paged(LENS, 16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 512, 16, q_data_type=BF16)
    assert w._op.head_dim == 512
    with pytest.raises(NotImplementedError, match=r"head_dim=576 is not supported: .*\(64, 128, 256, 512\)"):
        w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 576, 16, q_data_type=BF16)
    assert w._op.head_dim == 512


# --- bad inputs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(logits_soft_cap=-1.0), r"logits_soft_cap must be None, 0 \(off\) or a positive number .*got -1.0"),
    (dict(logits_soft_cap=math.nan), "logits_soft_cap must be a finite number, got nan"),
    (dict(logits_soft_cap=math.inf), "logits_soft_cap must be a finite number, got inf"),
    (dict(logits_soft_cap="50"), "logits_soft_cap must be a finite number, got '50'"),
    (dict(logits_soft_cap=1e-40), "logits_soft_cap must be None, 0 .*got 1e-40"),
    (dict(window_left=-2), r"window_left must be -1 \(no window\) or a token count >= 0 .*got -2"),
    (dict(window_left=1.5), "window_left must be -1 .*got 1.5"),
    (dict(window_left=True), "window_left must be -1 .*got True"),
    (dict(window_left=2 ** 31), "window_left must be -1 .*got 2147483648"),
    (dict(pos_encoding_mode="ROPE"), r"pos_encoding_mode must be one of \('NONE', 'ROPE_LLAMA'\), got 'ROPE'"),
    (dict(rope_theta=1e4), "rope_theta=10000.0 is for pos_encoding_mode='ROPE_LLAMA', got pos_encoding_mode='NONE'"),
    (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=0), "rope_theta must be a positive number .*got 0"),
    (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=math.inf), "rope_scale must be a finite number, got inf"),
    (dict(window_left=4, kernel_config=DecodeKernelConfig.default("bfloat16", 64)),
     r"kernel_config is for .*DecodeVariant\(logits_soft_cap=0.0, window_left=-1, .*the operator is .*window_left=4"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu", **kwargs)


def test_kernel_config_errors():
    with pytest.raises(ValueError, match="logits_soft_cap=50: expected 0.0"):
        DecodeVariant(50)
    with pytest.raises(ValueError, match="xrank kernels compute plain softmax attention"):
        DecodeKernelConfig(xrank="peer", variant=DecodeVariant(window_left=3))
    with pytest.raises(ValueError, match="rope_scale=2.0 without RoPE"):
        DecodeVariant(rope_scale=2.0)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap must be None, 0 .*got -2.0"),
    (dict(logits_soft_cap=math.nan), ValueError, "logits_soft_cap must be a finite number, got nan"),
    (dict(window_left=-5), ValueError, "window_left must be -1 .*got -5"),
])
def test_wrapper_plan_errors_change_nothing(kwargs, error, match):
    pb, q, k, v = _inputs(LENS, 16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 8, 2, 64, 16, q_data_type=BF16, window_left=30)
    cache = torch.stack([k, v], dim=1)
    before, op = w.run(q, cache), w._op
    with pytest.raises(error, match=match):
        w.plan(pb.kv_indptr[:3], pb.kv_indices, pb.kv_last_page_len[:2], 8, 2, 64, 16, q_data_type=BF16, **kwargs)
    assert w._op is op and torch.equal(w.run(q, cache), before)


def test_a_bad_table_is_named_as_given_and_changes_nothing():
    """A window plan checks the table it was given (not the one it keeps) and a failed plan keeps the last."""
    pb, q, k, v = _inputs(LENS, 16)
    attn = meld.DecodeAttention(8, 2, 64, 16, BF16, "cpu", window_left=20)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    cache = torch.stack([k, v], dim=1)
    before = attn.run(q, cache)
    bad = pb.kv_last_page_len.clone()
    bad[4] = 17
    with pytest.raises(ValueError, match=r"kv_last_page_len\[4\]=17 is outside \[1, page_size=16\]"):
        attn.plan(pb.kv_indptr, pb.kv_indices, bad)
    assert torch.equal(attn.run(q, cache), before)


# --- GPU ----------------------------------------------------------------------------------------------------------
GPU_LENS = [37, 0, 250, 1, 1003, 115, 5000, 17, 64]


def _tma(dtype, D, **kw):
    return dataclasses.replace(DecodeKernelConfig.default(dtype, D, **kw), tma=True)


def _gpu_check(cap, window, P=16, D=128, Hq=32, Hkv=8, dtype=BF16, fp8=False, tma=False, rope=None, **op):
    """The kernel against float64, outputs poisoned first, two runs bit-identical. Its differences from that
    reference are its own arithmetic: P and the output rounded to the MMA type (about 2**-9 each), float32
    accumulation, and with RoPE the rotated keys rounded to it too (bfloat16: 2**-9 of each key, which moved lse by
    up to 9e-3 at these scores on the executor with that rounding added)."""
    pb, q, k, v = _inputs(GPU_LENS, P, Hq, Hkv, D, dtype, "cuda", scale=3.0)
    if fp8:
        k, v = (t.float().mul(4).to(torch.float8_e4m3fn) for t in (k, v))
        op["kv_dtype"] = torch.float8_e4m3fn
    if tma:
        name = {BF16: "bfloat16", torch.float16: "float16"}[dtype]
        op["kernel_config"] = _tma(name, D, kv_dtype="float8_e4m3fn" if fp8 else "", group_size=Hq // Hkv,
                                   variant=DecodeVariant(cap or 0.0, window, *(rope or (0.0, 1.0))))
    if rope:
        op.update(pos_encoding_mode="ROPE_LLAMA", rope_theta=rope[0], rope_scale=rope[1])
    attn = meld.DecodeAttention(Hq, Hkv, D, P, dtype, "cuda", logits_soft_cap=cap, window_left=window, **op)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    cache = torch.stack([k, v], dim=1)
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, device="cuda")
    attn.run(q, cache, out=out, lse=lse)
    again, again_lse = attn.run(q, cache, return_lse=True)
    ref, ref_lse = reference(q, k.cpu().double() if fp8 else k.cpu(), v.cpu().double() if fp8 else v.cpu(),
                             pb, attn.sm_scale, cap or 0.0, window, rope)
    _check(out, lse, ref, ref_lse, tol=1e-2 if rope else 5e-3, lse_tol=2e-2 if rope else 2e-3)
    assert torch.equal(out, again) and torch.equal(lse, again_lse), "results differ between two identical runs"
    return attn


@pytest.mark.gpu
@pytest.mark.parametrize("cap,window,P,D,rope", [
    (2.0, -1, 16, 128, None), (50.0, -1, 5, 64, None), (None, 0, 16, 128, None), (None, 37, 1, 256, None),
    (None, 300, 7, 128, None), (3.0, 100, 64, 64, None),
    (None, -1, 16, 128, (1e4, 1.0)), (None, -1, 5, 64, (5e5, 8.0)), (3.0, 20, 16, 256, (1e6, 1.0)),
    (None, 300, 7, 128, (1e4, 2.0))])
def test_gpu_matches_float64(cap, window, P, D, rope):
    _gpu_check(cap, window, P, D, rope=rope)


@pytest.mark.gpu
@pytest.mark.parametrize("options", ["tma", "fp8", "fp8-tma", "group-16", "batch-invariant", "clusters",
                                     "empty-pieces", "rope-tma-float16", "rope-group-16-invariant"])
def test_gpu_options(options):
    kw = {"tma": dict(tma=True, P=16), "fp8": dict(fp8=True, P=5), "fp8-tma": dict(fp8=True, tma=True, P=16),
          "group-16": dict(Hq=64, Hkv=4), "batch-invariant": dict(batch_invariant=True),
          "clusters": dict(cluster_size=4),
          "empty-pieces": dict(cost=FINE, P=64, window=5),
          "rope-tma-float16": dict(rope=(1e4, 1.0), tma=True, dtype=torch.float16, P=16),
          "rope-group-16-invariant": dict(rope=(5e5, 8.0), Hq=64, Hkv=4, batch_invariant=True)}[options]
    _gpu_check(4.0, kw.pop("window", 77), **kw)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_across_replans():
    """A captured run() of a window operator replays plans of other batches (the planner's table is rewritten in
    place; the pages left out differ per plan)."""
    from meld.runtime.cuda_graphs import capture

    P, lens_a, lens_b = 16, [300, 40, 7, 1000], [5, 900, 0, 333]
    pa, q, k, v = _inputs(lens_a, P, 32, 8, 128, BF16, "cuda", scale=3.0)
    pb = paged(lens_b, P)
    pages = max(pa.num_pages, pb.num_pages)
    k, v = (torch.randn(pages, P, 8, 128, device="cuda").to(BF16) for _ in range(2))
    cache = torch.stack([k, v], dim=1)
    attn = meld.DecodeAttention(32, 8, 128, P, BF16, "cuda", logits_soft_cap=4.0, window_left=64, max_batch_size=4,
                                max_num_pages=pages)
    attn.plan(pa.kv_indptr.cpu(), pa.kv_indices.cpu(), pa.kv_last_page_len.cpu())
    out = torch.full_like(q, math.nan)
    graph, _ = capture(lambda: attn.run(q, cache, out=out))
    for t in (pa, pb):
        attn.plan(t.kv_indptr.cpu(), t.kv_indices.cpu(), t.kv_last_page_len.cpu())
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference(q, k.cpu(), v.cpu(), t, attn.sm_scale, 4.0, 64)
        assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.gpu
def test_gpu_wrapper_and_device_table():
    """The wrapper on the GPU with the table on the device, planned with check=False (no host sync: the window's
    pages are dropped by torch ops on the device)."""
    pb, q, k, v = _inputs(GPU_LENS, 16, 32, 8, 128, BF16, "cuda", scale=3.0)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device="cuda"))
    w.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, 32, 8, 128, 16, window_left=90, logits_soft_cap=4.0,
           q_data_type=BF16, check=False)
    out, lse = w.run(q, torch.stack([k, v], dim=1), return_lse=True)
    _check(out, lse / math.log2(math.e), *reference(q, k.cpu(), v.cpu(), pb, 128 ** -0.5, 4.0, 90), tol=5e-3)
