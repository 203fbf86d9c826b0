"""meld.serving, the decode loop: the block allocator's and the KV cache's invariants, page tables that
meld's plan() accepts, backends against a float64 reference, decode steps against a dense forward,
meld (CPU executor) against the SDPA reference over steps where requests join and leave, meld's MoE
against the torch pipeline, seeded traces, and `meld serve-bench` on the CPU; the DeepSeek model's MLA
(prefill and decode against its attention written out, its latent cache, meld.DecodeMLA against a float64
model). The `gpu` tests: graph replay after re-plans against eager, meld against SDPA, FlashInfer against
meld; for DeepSeek, graph replay on each MLA backend, each against float64 with NaN kept to its request, and
the full-size model through the CLI."""
import dataclasses
import json
import random

import pytest
import torch

import meld
from meld import cli
from meld.ops.page_table import check_page_table
from meld.runtime.reference import attention_reference, mla_reference
from meld.serving import (NULL_PAGE, BlockAllocator, DecoderModel, Engine, TraceConfig,
                          make_backend, make_trace, request_tokens, tiny_config)
from meld.serving.backends import FLASHMLA_PAGE_SIZE, BackendUnavailable, unavailable
from meld.serving.bench import compare, run_with_routing
from meld.serving.kv_cache import PagedLatentCache
from meld.serving.models import MeldMoE, RoutingTape, TorchMoE, apply_rope, make_cache, rms_norm
from meld.serving.torch_moe import topk_route
from meld.serving.trace import Request
from meld.workloads import lengths

P = 16
TOL = 2e-2   # relative L2 error of logits, bf16 end to end


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def setup(kind="llama", pages=96, device="cpu", page_size=P, **over):
    cfg = tiny_config(kind, **over)
    model = DecoderModel(cfg, device, moe="torch", moe_max_tokens=256)
    return cfg, model, make_cache(cfg, pages, page_size, device, seed=3)


def engine(model, cache, backend, max_batch=4, graphs=False, moe=None):
    cfg = model.config
    model.use_moe(moe or ("meld" if backend == "meld" else "torch"))
    be = make_backend(backend, cfg, cache.page_size, cache.pool.device, max_batch, cache.num_pages + max_batch)
    return Engine(model, be, cache, max_batch, graphs=graphs)


# --- allocator and cache -----------------------------------------------------------------------------------
def test_allocator_invariants():
    N = 50
    a = BlockAllocator(N, seed=1)
    assert a.num_free == N - 1   # page 0 is the null page
    rng = random.Random(0)
    owners: list[list[int]] = []
    for _ in range(400):
        if owners and (rng.random() < 0.45 or a.num_free == 0):
            a.free(owners.pop(rng.randrange(len(owners))))
        else:
            owners.append(a.alloc(rng.randint(0, min(4, a.num_free))))
        held = [p for o in owners for p in o]
        assert len(held) == len(set(held)), "a page owned twice"
        assert NULL_PAGE not in held and all(0 < p < N for p in held)
        assert a.num_free + len(held) == N - 1
    for o in owners:
        a.free(o)
    assert a.num_free == N - 1 and sorted(a._free) == list(range(1, N))


def test_allocator_errors_change_nothing():
    a = BlockAllocator(8)
    with pytest.raises(ValueError, match="out of pages: asked for 8, 7 of 8 free"):
        a.alloc(8)
    pages = a.alloc(3)
    a.free(pages[:1])
    for bad in ([pages[0]], [pages[1], pages[1]], [NULL_PAGE], [99], [-1]):
        with pytest.raises(ValueError, match="cannot free"):
            a.free(bad)
    assert a.num_free == 5
    a.free(pages[1:])
    assert a.num_free == 7


def test_cache_reserves_allocates_and_releases():
    cfg, _, kv = setup(pages=11)            # 10 usable pages
    kv.add(1, 5 * P)                        # reserves 5 pages, allocates none
    assert kv.allocator.num_free == 10 and kv.can_admit(5 * P) and not kv.can_admit(5 * P + 1)
    with pytest.raises(ValueError, match="request 2 needs 6 pages; 5 are free and unreserved"):
        kv.add(2, 6 * P)
    with pytest.raises(ValueError, match="request 3 needs 11 pages .* only 10 usable pages"):
        kv.add(3, 11 * P)
    with pytest.raises(ValueError, match="already in the KV cache"):
        kv.add(1, 1)
    slots = kv.extend(1, P + 3)
    assert len(kv.pages(1)) == 2 and kv.allocator.num_free == 8
    pages = kv.pages(1)
    assert slots.tolist() == [pages[t // P] * P + t % P for t in range(P + 3)]
    for n in range(P + 3, 5 * P):           # decode: one token at a time, a page at each boundary
        (slot,) = kv.append([1])
        assert slot == kv.pages(1)[n // P] * P + n % P and kv.length(1) == n + 1
    with pytest.raises(ValueError, match="more than the 80 it reserved"):
        kv.append([1])
    kv.add(2, 5 * P)
    assert not kv.can_admit(1)
    kv.release(1)
    kv.release(2)
    assert kv.allocator.num_free == 10 and kv.requests == [] and kv.can_admit(10 * P)


@pytest.mark.parametrize("pad_page", [None, NULL_PAGE])
def test_page_tables_plan_in_meld(pad_page):
    cfg, _, kv = setup(pages=200)
    lens = [1, 16, 17, 0, 100, 33, 250]
    for rid, n in enumerate(lens):
        kv.add(rid, max(n, 1))
        kv.extend(rid, n)
    rids = [6, 0, 3, 4, 1, 5, 2]
    attn = meld.DecodeAttention(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, P, cfg.dtype, "cpu",
                                max_batch_size=16, max_num_pages=kv.num_pages + 16)
    for pad_to in (None, 7, 16):
        t = kv.page_table(rids, pad_to=pad_to, pad_page=pad_page)
        assert t.batch == 7 and t.rows == (pad_to or 7)
        for x in (t.kv_indptr, t.kv_indices, t.kv_last_page_len):
            assert x.dtype == torch.int32 and x.device.type == "cpu" and x.is_contiguous()
        indptr, last = t.kv_indptr.numpy(), t.kv_last_page_len.numpy()
        assert check_page_table(indptr, last, len(t.kv_indices), P) == len(t.kv_indices)
        for row, rid in enumerate(rids):
            pages = t.kv_indices[indptr[row]:indptr[row + 1]].numpy()
            assert (pages == kv.pages(rid)).all() and t.kv_lens[row] == lens[rid]
            if lens[rid]:
                assert (len(pages) - 1) * P + last[row] == lens[rid]
        real = t.kv_indices[:indptr[7]].numpy()
        assert len(set(real.tolist())) == len(real) and NULL_PAGE not in real
        pad = t.kv_indices[indptr[7]:].numpy()
        assert (pad == NULL_PAGE).all() and len(pad) == (0 if pad_page is None else t.rows - 7)
        attn.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len)
        attn.schedule.validate()


def test_cache_write_lands_in_the_pages():
    cfg, _, kv = setup(pages=40)
    kv.add(0, 70)
    slots = kv.extend(0, 70)
    k = torch.randn(70, cfg.num_kv_heads, cfg.head_dim).bfloat16()
    v = torch.randn(70, cfg.num_kv_heads, cfg.head_dim).bfloat16()
    kv.write(1, torch.from_numpy(slots), k, v)
    pages = kv.pages(0)
    for t in (0, 15, 16, 69):
        assert torch.equal(kv.layer(1)[pages[t // P], 0, t % P], k[t])
        assert torch.equal(kv.layer(1)[pages[t // P], 1, t % P], v[t])
    assert kv.layer(0).abs().sum() == 0   # other layers untouched


# --- backends ----------------------------------------------------------------------------------------------
LENS = [5, 0, 200, 16, 1, 77]   # (request 1 is empty: zeros)


def planned_backend(backend: str, *setup_args, **setup_kw):
    """A model's cache holding requests of LENS tokens (random rows), `backend` planned over them, and a random q:
    (config, cache, backend, q, page table)."""
    cfg, _, kv = setup(*setup_args, **setup_kw)
    for rid, n in enumerate(LENS):
        kv.add(rid, max(n, 1))
        kv.extend(rid, n)
    kv.pool.normal_()
    be = make_backend(backend, cfg, P, "cpu", 8, kv.num_pages + 8)
    q = torch.randn(len(LENS), cfg.num_qo_heads, cfg.head_dim).bfloat16()
    t = kv.page_table(list(range(len(LENS))))
    be.plan(t)
    return cfg, kv, be, q, t


@pytest.mark.parametrize("backend", ["meld", "sdpa"])
def test_backend_attention_matches_float64(backend):
    cfg, kv, be, q, t = planned_backend(backend, pages=120)
    for layer in range(cfg.num_layers):
        out = be.run(layer, q, kv.layer(layer))
        ref, _ = attention_reference(q, kv.layer(layer), t.kv_indptr, t.kv_indices, t.kv_last_page_len)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert rel(out, ref) < 1e-2
        assert (out[1] == 0).all()       # the empty request gives zeros


def test_sdpa_groups_under_a_budget():
    """Requests too long for one SDPA call together are split into length-sorted groups; same result."""
    cfg, _, kv = setup(pages=120)
    lens = [300, 5, 120, 64, 250]
    for rid, n in enumerate(lens):
        kv.add(rid, n)
        kv.extend(rid, n)
    kv.pool.normal_()
    q = torch.randn(len(lens), cfg.num_qo_heads, cfg.head_dim).bfloat16()
    t = kv.page_table(list(range(len(lens))))
    whole, split = (make_backend("sdpa", cfg, P, "cpu", 8, 200) for _ in range(2))
    split.budget_tokens = 300
    for be in (whole, split):
        be.plan(t)
    assert len(whole._groups) == 1 and len(split._groups) == 4
    assert rel(split.run(0, q, kv.layer(0)), whole.run(0, q, kv.layer(0))) < 1e-2


def test_flashinfer_unavailable_is_clear():
    cfg = tiny_config("llama")
    why = unavailable("flashinfer", "cpu")
    assert "CUDA GPUs only" in why and unavailable("meld", "cpu") is None and unavailable("sdpa", "cpu") is None
    with pytest.raises(BackendUnavailable, match="CUDA GPUs only"):
        make_backend("flashinfer-tc", cfg, P, "cpu", 4, 64)
    assert "unknown attention backend 'x'" in unavailable("x", "cpu")


# --- the model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek"])
def test_decode_steps_equal_a_dense_forward(kind):
    """Prefill, then decode steps through the paged cache: each step's logits are those of a dense
    forward over the whole sequence (positions, RoPE, cache writes and page lookups all agree)."""
    cfg, model, kv = setup(kind, pages=64)
    be = make_backend("sdpa", cfg, P, "cpu", 4, 64)
    tokens = torch.randint(cfg.vocab_size, (40,))
    kv.add(0, 40)
    model.prefill(tokens[:30], torch.from_numpy(kv.extend(0, 30)), kv)
    for n in range(30, 40):
        slots = torch.from_numpy(kv.append([0]))
        be.plan(kv.page_table([0]))
        step = model.decode(tokens[n:n + 1], torch.tensor([n]), slots, be, kv)
        scratch = make_cache(cfg, 8, P)
        scratch.add(0, n + 1)
        dense = model.prefill(tokens[:n + 1], torch.from_numpy(scratch.extend(0, n + 1)), scratch)
        assert rel(step, dense) < TOL


# --- DeepSeek: MLA ------------------------------------------------------------------------------------------
def _float64(x):
    """x (a tensor, or a dataclass of them) in float64: the same weights, for a float64 reference model."""
    if isinstance(x, torch.Tensor):
        return x.double()
    if dataclasses.is_dataclass(x):
        return type(x)(**{f.name: _float64(getattr(x, f.name)) for f in dataclasses.fields(x)})
    return x


def float64_model(model: DecoderModel) -> DecoderModel:
    ref = DecoderModel(dataclasses.replace(model.config, dtype=torch.float64), "cpu", moe="torch",
                       moe_max_tokens=model.prefill_chunk)
    ref.embed, ref.final_norm, ref.lm_head = (_float64(t) for t in (model.embed, model.final_norm, model.lm_head))
    ref.layers = [_float64(w) for w in model.layers]
    return ref


def test_mla_prefill_and_decode_equal_attention_written_out():
    """The model's MLA is DeepSeek's attention written out per head: K = [c W_UK^T, k_pe], V = c W_UV, causal
    softmax at 1/sqrt(nope + rope). In float64, its prefill (unabsorbed, SDPA) over the first L - 1 tokens,
    and a decode step of the last one (absorbed: W_UK folded into the query, W_UV applied to the latent output
    of the sdpa backend) over the cache the prefill wrote."""
    cfg, model, _ = setup("deepseek")
    ref = float64_model(model)
    w, m, c = ref.layers[0], ref.layers[0].mla, ref.config
    L, Hq = 23, cfg.num_qo_heads
    x = torch.randn(L, cfg.hidden_size, dtype=torch.float64)
    cache = make_cache(c, 4, P)
    cache.add(0, L)
    pos = torch.arange(L)
    prefill = ref._attention(0, w, x[:-1], pos[:-1], torch.from_numpy(cache.extend(0, L - 1)), cache, None)
    slot = torch.from_numpy(cache.append([0]))
    be = make_backend("sdpa", c, P, "cpu", 1, 8)
    be.plan(cache.page_table([0]))
    step = ref._attention(0, w, x[-1:], pos[-1:], slot, cache, be)

    cos, sin = ref.cos[pos], ref.sin[pos]
    q = (rms_norm(x @ m.q_a.T, m.q_a_norm, c.rms_eps) @ m.q_b.T).view(L, Hq, -1)
    q = torch.cat([q[..., :c.qk_nope_head_dim], apply_rope(q[..., c.qk_nope_head_dim:], cos, sin)], dim=-1)
    ckv = rms_norm((x @ m.kv_a.T)[:, :c.kv_lora_rank], m.kv_norm, c.rms_eps)
    k_pe = apply_rope((x @ m.kv_a.T)[:, None, c.kv_lora_rank:], cos, sin).expand(L, Hq, -1)
    k = torch.cat([torch.einsum("nc,hdc->nhd", ckv, m.w_uk), k_pe], dim=-1)
    v = torch.einsum("nc,hcv->nhv", ckv, m.w_uv)
    s = torch.einsum("nhd,mhd->hnm", q, k) / (c.qk_nope_head_dim + c.qk_rope_head_dim) ** 0.5
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -torch.inf)
    want = torch.einsum("hnm,mhv->nhv", s.softmax(-1), v).reshape(L, -1) @ w.o.T
    assert rel(prefill, want[:-1]) < 1e-10 and rel(step, want[-1:]) < 1e-10
    assert torch.equal(cache.layer(0)[cache.pages(0)[0], 3, :c.kv_lora_rank], ckv[3])   # the latent row cached


def test_latent_cache_writes_rows_and_checks():
    cfg, _, kv = setup("deepseek", pages=12)
    assert isinstance(kv, PagedLatentCache) and kv.layer(1).shape == (12, P, 576)
    kv.add(0, 40)
    slots = kv.extend(0, 40)
    rows = torch.randn(40, 576).bfloat16()
    kv.write(1, torch.from_numpy(slots), rows)
    pages = kv.pages(0)
    assert all(torch.equal(kv.layer(1)[pages[t // P], t % P], rows[t]) for t in (0, 15, 16, 39))
    assert kv.layer(0).abs().sum() == 0
    with pytest.raises(ValueError, match="latent"):
        kv.write(0, torch.from_numpy(slots), rows[:, :512])
    with pytest.raises(ValueError, match="slots must be token slots of the pool"):
        kv.write(0, torch.tensor([12 * P]), rows[:1])


@pytest.mark.parametrize("backend", ["meld", "sdpa"])
def test_mla_backend_attention_matches_float64(backend):
    cfg, kv, be, q, t = planned_backend(backend, "deepseek", pages=60)
    C = cfg.kv_lora_rank
    for layer in range(cfg.num_layers):
        cache = kv.layer(layer)
        out = be.run(layer, q, cache)
        ref, _ = mla_reference(q[..., :C], q[..., C:], cache[..., :C], cache[..., C:], t.kv_indptr, t.kv_indices,
                               t.kv_last_page_len, cfg.sm_scale)
        assert out.shape == (len(LENS), cfg.num_qo_heads, C) and out.dtype == q.dtype
        assert rel(out, ref) < 1e-2 and (out[1] == 0).all()


def test_deepseek_meld_decode_matches_a_float64_model():
    """The DeepSeek model on the meld backend (meld.DecodeMLA, meld's MoE; bf16) against the same weights in
    float64 on the SDPA backend with torch's MoE, over decode steps where requests join and leave. The
    reference's routing is replayed (RoutingTape): a near-tie would flip a token's experts otherwise."""
    cfg, model, kv = setup("deepseek", pages=80)
    ref_model = float64_model(model)
    trace = make_trace(TraceConfig.tiny(10, 2.0, seed=4))
    tape = RoutingTape(cfg.top_k)
    ref = run_with_routing(ref_model, engine(ref_model, make_cache(ref_model.config, 80, P), "sdpa"), trace, 8, tape)
    got = run_with_routing(model, engine(model, kv, "meld"), trace, 8, tape.replay())
    batches = [set(rids) for rids, _ in got.logits]
    assert any(b - a for a, b in zip(batches, batches[1:])) and any(a - b for a, b in zip(batches, batches[1:]))
    assert ref.logits[0][1].dtype == torch.float32 and got.moe == "meld" and ref.backend == "sdpa"
    c = compare(got, ref)
    assert c["check_steps"] == 8 and c["check_rel_err"] < TOL and c["check_argmax_agree"] >= 0.9


def test_deepseek_backends_refused_clearly():
    cfg, llama = tiny_config("deepseek"), tiny_config("llama")
    with pytest.raises(ValueError, match="the flashinfer-tc backend has no MLA attention, which model 'deepseek'"):
        make_backend("flashinfer-tc", cfg, P, "cpu", 4, 64)
    with pytest.raises(ValueError, match="flashmla backend runs MLA only .* model 'llama'"):
        make_backend("flashmla", llama, 64, "cpu", 4, 64)
    with pytest.raises(ValueError, match="flashmla backend runs page size 64 only, got 16"):
        make_backend("flashmla", cfg, 16, "cpu", 4, 64)
    for name in ("flashinfer", "flashmla"):
        assert "CUDA GPUs only" in unavailable(name, "cpu", cfg, 64)
        with pytest.raises(BackendUnavailable, match="CUDA GPUs only"):
            make_backend(name, cfg, 64, "cpu", 4, 64)
    assert unavailable("meld", "cpu", cfg, P) is None and unavailable("sdpa", "cpu", cfg, P) is None
    with pytest.raises(ValueError, match="need num_kv_heads=1 and head_dim=576"):
        tiny_config("deepseek", head_dim=128)
    with pytest.raises(ValueError, match="MLA .* needs positive"):
        tiny_config("deepseek", v_head_dim=0)


def test_moe_meld_cpu_matches_torch_pipeline():
    cfg = tiny_config("qwen3-moe")
    model = DecoderModel(cfg, "cpu")
    w = model.layers[0]
    x = torch.randn(37, cfg.hidden_size).bfloat16()
    logits = (x @ w.router.T).float()
    meld_out = MeldMoE(cfg, "cpu", 64)(x, logits, (w.w13, w.w2))
    torch_out = TorchMoE(cfg.top_k)(x, logits, (w.w13, w.w2))
    assert rel(meld_out, torch_out) < 1e-2


def test_fp8_experts_are_block_scaled_and_torch_runs_what_they_stand_for():
    """moe_dtype="fp8": each layer's experts in e4m3 with a scale per 128 x 128 block, which meld's MoE reads; the
    bf16 w13 / w2 (torch's MoE) are their dequantised values. The two MoEs then differ by meld's activation
    quantisation alone (x and act per token per 128 channels in e4m3: a few percent)."""
    from meld.runtime.moe_reference import dequantize_blocks

    cfg = tiny_config("qwen3-moe", moe_dtype="fp8")
    model = DecoderModel(cfg, "cpu", moe="meld")
    w = model.layers[1]
    q13, q2, s13, s2 = w.fp8
    assert q13.dtype == q2.dtype == torch.float8_e4m3fn and s13.shape == (8, 2, 2) and s2.shape == (8, 2, 1)
    assert torch.equal(w.w13, dequantize_blocks(q13, s13).bfloat16()) and model.moe_weights(w) is w.fp8
    x = torch.randn(37, cfg.hidden_size).bfloat16()
    logits = (x @ w.router.T).float()
    meld_out = model.moe(x, logits, model.moe_weights(w))
    model.use_moe("torch")
    torch_out = model.moe(x, logits, model.moe_weights(w))
    assert model.moe_name == "torch" and 1e-3 < rel(meld_out, torch_out) < 8e-2
    with pytest.raises(ValueError, match="moe_dtype must be one of"):
        tiny_config("qwen3-moe", moe_dtype="int4")
    with pytest.raises(ValueError, match="needs MoE layers"):
        tiny_config("llama", moe_dtype="fp8")


def test_trace_is_seeded_and_skewed():
    cfg = TraceConfig(num_requests=64, arrival_rate=4)
    a, b = make_trace(cfg), make_trace(cfg)
    assert a == b and a != make_trace(TraceConfig(num_requests=64, arrival_rate=4, seed=2))
    assert [r.prompt_len for r in a] == lengths("skewed", 64)   # BENCH.md's skewed batch, exactly
    assert all(16 <= r.output_len <= 2048 for r in a) and len({r.output_len for r in a}) > 20
    assert [r.arrival for r in a] == [i // 4 for i in range(64)]
    tiny = make_trace(TraceConfig.tiny(30, 1.5))
    assert all(4 <= r.prompt_len <= 200 and 2 <= r.output_len <= 20 for r in tiny)
    assert torch.equal(request_tokens(a[3], 1000, 0), request_tokens(a[3], 1000, 0))
    assert not torch.equal(request_tokens(a[3], 1000, 0), request_tokens(a[4], 1000, 0))
    with pytest.raises(ValueError, match="arrival_rate"):
        make_trace(TraceConfig(arrival_rate=0))


# --- the loop ----------------------------------------------------------------------------------------------
def _run(model, kv, backend, trace, steps=10, **kw):
    return engine(model, kv, backend, **kw).run(trace, steps, record_logits=steps, samples=3)


def test_routing_tape_replays_the_recorded_experts():
    """A replaying run routes each MoE call to the recorded experts whatever its own router logits say,
    weighted by its own softmax over them; a run that makes other calls fails clearly."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=g)
    tape = RoutingTape(top_k=2)
    w, ids = tape(logits)
    assert torch.equal(ids, topk_route(logits, 2, True)[1]) and torch.allclose(w.sum(-1), torch.ones(5))
    other = -logits   # routes elsewhere on its own
    w2, ids2 = tape.replay()(other)
    assert torch.equal(ids2, ids) and not torch.equal(topk_route(other, 2, True)[1], ids)
    p = torch.softmax(other, -1).gather(1, ids)
    assert torch.allclose(w2, p / p.sum(-1, keepdim=True))
    with pytest.raises(RuntimeError, match="holds 1 MoE calls"):
        tape(other)
    with pytest.raises(RuntimeError, match="routes 4 tokens; the recorded run routed 5"):
        tape.replay()(other[:4])


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_meld_matches_sdpa_as_requests_join_and_leave(kind):
    """The meld backend on the CPU executor (and meld's MoE) against the SDPA reference (and torch's MoE)
    over decode steps whose batches change: requests finish and others are admitted in between."""
    cfg, model, kv = setup(kind, pages=80)
    trace = make_trace(TraceConfig.tiny(10, 2.0, seed=4))
    got, ref = _run(model, kv, "meld", trace), _run(model, kv, "sdpa", trace)
    batches = [set(rids) for rids, _ in got.logits]
    assert any(b - a for a, b in zip(batches, batches[1:])), "no request joined"
    assert any(a - b for a, b in zip(batches, batches[1:])), "no request left"
    c = compare(got, ref)   # float64 on the CPU: no routing flip, nothing set aside
    assert c["check_steps"] == 10 and c["check_rel_err"] < TOL and c["check_argmax_agree"] >= 0.9
    assert got.moe == ("meld" if cfg.is_moe else "-") and ref.moe == ("torch" if cfg.is_moe else "-")


def test_engine_accounting_under_a_small_pool():
    """A pool too small for the whole batch: admission waits for pages, never exceeds the batch or the
    pool, every request finishes with exactly its output length, and every page comes back."""
    cfg, model, kv = setup(pages=20)   # 19 usable pages
    trace = [Request(i, i // 3, p, o) for i, (p, o) in enumerate([(100, 9), (40, 3), (5, 30), (200, 4), (17, 1),
                                                                  (60, 12), (33, 5), (120, 2)])]
    eng = engine(model, kv, "sdpa", max_batch=3)
    refused, real_can_admit = [], kv.can_admit

    def can_admit(tokens):
        ok = real_can_admit(tokens)
        refused.append(not ok)
        return ok

    kv.can_admit = can_admit
    res = eng.run(trace, max_steps=1000)
    assert any(refused), "the pool never held admission back"
    assert res.admitted == res.finished == len(trace)
    assert sum(s.batch for s in res.steps) == sum(r.output_len - 1 for r in trace)
    assert max(s.batch for s in res.steps) == 3
    assert kv.requests == [] and kv.allocator.num_free == kv.usable_pages
    with pytest.raises(ValueError, match="request 0 needs 20 KV pages .* the pool has 19"):
        eng.run([Request(0, 0, 300, 20)], 5)
    with pytest.raises(ValueError, match="beyond the model's max_position=4096"):
        eng.run([Request(0, 0, 4000, 100)], 5)


def test_attention_timing_and_summary():
    cfg, model, kv = setup(pages=80)
    eng = engine(model, kv, "meld")
    res = eng.run(make_trace(TraceConfig.tiny(8)), 9, samples=3)
    assert [s for s, _ in res.samples] == [0, 3, 6]
    eng.time_attention(res, reps=1)
    s = res.summary()
    assert s["steps"] == 9 and s["tokens_per_s"] > 0 and s["step_p99_ms"] >= s["step_p50_ms"] > 0
    # attention is timed alone, after the run: its share of the steps' time is a ratio of two measurements, which
    # a loaded machine can put above 1, so the formula is what is checked
    timed = [i for i, _ in res.samples]
    attn, steps = sum(res.attention_seconds[i] for i in timed), sum(res.steps[i].seconds for i in timed)
    assert s["attn_share"] == pytest.approx(attn / steps) and attn > 0 and s["mode"] == "eager"


def test_graphs_need_a_gpu():
    cfg, model, kv = setup()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        engine(model, kv, "meld", graphs=True)


def _compiled_decode_matches_eager(kind, device, backend):
    cfg, model, kv = setup(kind, pages=40, device=device)
    be = make_backend("meld", cfg, P, device, 4, 44)
    model.use_moe("meld")
    for rid, n in enumerate([20, 3]):
        kv.add(rid, n + 1)
        kv.extend(rid, n)
    slots = torch.from_numpy(kv.append([0, 1])).to(device)
    be.plan(kv.page_table([0, 1]))
    tokens, positions = torch.tensor([5, 7], device=device), torch.tensor([20, 3], device=device)
    eager = model.decode(tokens, positions, slots, be, kv)
    compiled = torch.compile(model.decode, fullgraph=True, backend=backend)
    return compiled(tokens, positions, slots, be, kv), eager


def test_decode_compiles_fullgraph_with_meld():
    """torch.compile(fullgraph=True) traces a decode step with meld attention and meld's MoE (their custom
    ops): no graph break, and the same logits as eager."""
    got, eager = _compiled_decode_matches_eager("qwen3-moe", "cpu", "aot_eager")
    assert torch.equal(got, eager)


@pytest.mark.gpu
@pytest.mark.cublas_output   # the model's projections feed meld
@pytest.mark.parametrize("kind,backend", [("llama", "inductor"), ("qwen3-moe", "aot_eager")])
def test_gpu_decode_compiles_fullgraph_with_meld(kind, backend):
    """The same on the GPU: Inductor compiles the Llama step around meld's attention op (its own fused
    kernels round differently: close, not equal); the MoE step traced with meld's two ops runs the eager
    kernels, so bit for bit."""
    got, eager = _compiled_decode_matches_eager(kind, "cuda", backend)
    if backend == "aot_eager":
        assert torch.equal(got, eager)
    else:
        assert not got.isnan().any() and rel(got, eager) < TOL


# --- the CLI -----------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the defaults are the full-size model")
@pytest.mark.parametrize("model", ["llama", "qwen3-moe"])
def test_cli_serve_bench_on_the_cpu(model, capsys, tmp_path):
    out = tmp_path / "rows.json"
    argv = ["serve-bench", "--model", model, "--backend", "meld,sdpa", "--max-batch", "2,3", "--steps", "5",
            "--check", "--check-steps", "3", "--samples", "2", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "CPU reference executor" in text and "eager" in text
    assert text.count("| backend | moe | mode |") == 2 and text.count("| OK rel err") == 4
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["max_batch"]) for r in rows] == [("meld", 2), ("sdpa", 2), ("meld", 3), ("sdpa", 3)]
    assert all(r["steps"] == 5 and r["check_ok"] and r["attn_share"] > 0 for r in rows)   # (> 1 under load)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the defaults are the full-size model")
def test_cli_serve_bench_fp8_experts_on_the_cpu(capsys, tmp_path):
    """--moe-dtype fp8: meld's FP8 MoE in the loop, checked against SDPA with torch's MoE on the dequantised experts,
    under the FP8 default tolerance (its activation quantisation)."""
    out = tmp_path / "rows.json"
    argv = ["serve-bench", "--model", "qwen3-moe", "--moe-dtype", "fp8", "--backend", "meld,sdpa", "--max-batch",
            "2", "--steps", "3", "--check", "--check-steps", "2", "--samples", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "(FP8 block-scaled experts)" in text and text.count("| OK rel err") == 2
    doc = json.loads(out.read_text())
    assert [(r["backend"], r["moe"]) for r in doc["rows"]] == [("meld", "meld-fp8"), ("sdpa", "torch")]
    assert doc["meta"]["check_tolerance"] == 8e-2 and doc["meta"]["config"]["moe_dtype"] == "fp8"
    assert all(r["check_ok"] and r["steps"] == 3 for r in doc["rows"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the defaults are the full-size model")
def test_cli_serve_bench_deepseek_on_the_cpu(capsys, tmp_path):
    """The DeepSeek model (MLA + MoE) through the loop on the CPU executor, meld and SDPA, each checked."""
    out = tmp_path / "rows.json"
    argv = ["serve-bench", "--model", "deepseek", "--backend", "meld,sdpa", "--max-batch", "2", "--steps", "2",
            "--check", "--check-steps", "2", "--samples", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "deepseek: 2 layers" in text and "MLA 64 heads, latent 512 + rope 64" in text
    assert text.count("| OK rel err") == 2
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["moe"]) for r in rows] == [("meld", "meld"), ("sdpa", "torch")]
    assert all(r["steps"] == 2 and r["check_ok"] and r["attn_share"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_cli_serve_bench_skips_a_backend_that_does_not_import(capsys, monkeypatch):
    """A backend whose package does not import is skipped with its reason printed and the others run; with
    none left, the reasons end the run (exit status 2)."""
    from meld.serving import bench

    monkeypatch.setattr(bench, "not_installed", lambda name: f"{name} is not installed" if name == "sdpa" else None)
    argv = ["serve-bench", "--device", "cpu", "--size", "tiny", "--backend", "sdpa,meld", "--max-batch", "2",
            "--steps", "1", "--samples", "0"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "skipped backend sdpa: sdpa is not installed" in text and text.count("| meld | - | eager | 2 |") == 1
    _fails(argv[:5] + ["--backend", "sdpa"] + argv[7:], capsys, "sdpa is not installed")


def _fails(argv, capsys, *named):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for text in named:
        assert text in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cli_serve_bench_fails_clearly(capsys):
    _fails(["serve-bench", "--backend", "meld,flashinfer"], capsys, "--backend", "flashinfer backend runs on CUDA GPUs")
    _fails(["serve-bench", "--device", "cuda"], capsys, "--device", "(available: cpu)")
    _fails(["serve-bench", "--size", "full"], capsys, "--size", "needs a GPU")
    _fails(["serve-bench", "--backend", "meld,vllm"], capsys, "'vllm' is not a backend")
    _fails(["serve-bench", "--model", "deepseek-v2"], capsys, "--model", "'deepseek-v2'", "'deepseek'")
    _fails(["serve-bench", "--max-batch", "4,0"], capsys, "--max-batch")
    _fails(["serve-bench", "--arrival-rate", "-1"], capsys, "--arrival-rate")
    _fails(["serve-bench", "--model", "deepseek", "--backend", "flashmla"], capsys, "--backend",
           "flashmla backend runs on CUDA GPUs")
    _fails(["serve-bench", "--model", "deepseek", "--backend", "meld,flashinfer-tc"], capsys, "--backend",
           "flashinfer-tc backend has no MLA attention")
    _fails(["serve-bench", "--backend", "flashmla"], capsys, "--backend", "runs MLA only")
    _fails(["serve-bench", "--model", "deepseek", "--backend", "flashmla", "--page-size", "16"], capsys,
           "--backend", "page size 64 only, got 16")
    _fails(["serve-bench", "--page-size", "0"], capsys, "--page-size")
    _fails(["serve-bench", "--moe-dtype", "fp8"], capsys, "--moe-dtype", "need an MoE model", "--model llama")
    _fails(["serve-bench", "--moe-dtype", "e5m2"], capsys, "--moe-dtype", "'e5m2'")


def test_cli_serve_bench_reports_pool_errors(capsys):
    _fails(["serve-bench", "--device", "cpu", "--size", "tiny", "--kv-pages", "4"], capsys,
           "KV pages", "give the pool more pages")


# --- GPU ---------------------------------------------------------------------------------------------------
def _gpu_trace():
    return make_trace(TraceConfig.tiny(24, 6.0, seed=5))


def _importorskip(backend: str) -> None:
    if backend.startswith("flashinfer") or backend == "flashmla":
        pytest.importorskip("flash_mla" if backend == "flashmla" else "flashinfer")


def _check_graph_replay(kind: str, backend: str, page_size: int = P) -> None:
    """Each step re-plans and replays its bucket's graph: the replayed logits equal an eager forward of the
    same plan and inputs (K/V writes are idempotent), and the whole run agrees with an eager engine."""
    _importorskip(backend)
    cfg, model, kv = setup(kind, pages=400 * P // page_size, device="cuda", page_size=page_size)
    eng = engine(model, kv, backend, max_batch=8, graphs=True)
    replayed, diffs = eng._decode, []

    def checked(running):
        logits, rows, seconds, table = replayed(running)
        logits = logits.clone()
        diffs.append(rel(eng._forward(rows)[:len(running)], logits))
        return logits, rows, seconds, table

    eng._decode = checked
    got = eng.run(_gpu_trace(), 30, record_logits=30)
    assert len({s.rows for s in got.steps}) > 1, "the run never changed bucket"
    assert max(diffs) < 1e-3
    ref = engine(model, kv, backend, max_batch=8).run(_gpu_trace(), 30, record_logits=30)
    assert compare(got, ref)["check_rel_err"] < TOL


@pytest.mark.gpu
@pytest.mark.cublas_output   # the model's projections feed meld
@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
@pytest.mark.parametrize("backend", ["meld", "flashinfer"])
def test_gpu_graph_replay_after_replans_equals_eager(kind, backend):
    _check_graph_replay(kind, backend)


@pytest.mark.gpu
@pytest.mark.cublas_output   # the model's projections feed meld
@pytest.mark.parametrize("backend", ["meld", "flashinfer", "flashmla"])
def test_gpu_deepseek_graph_replay_after_replans_equals_eager(backend):
    """The same for the DeepSeek model's MLA backends, at FlashMLA's page size (64) as serve-bench runs them
    together: meld.DecodeMLA, FlashInfer's MLA wrapper per bucket, FlashMLA's per-bucket table and metadata."""
    _check_graph_replay("deepseek", backend, FLASHMLA_PAGE_SIZE)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["meld", "flashinfer", "flashmla", "sdpa"])
def test_gpu_mla_backends_match_float64(backend):
    """Each MLA backend on the GPU against the float64 reference over fresh random latent rows and lengths that
    are not whole pages (one token, a page and one, a long one), batch 5 (no bucket size); then NaN in one
    latent row of request 2: meld's and SDPA's rows of that request are NaN, every backend's other rows equal
    the clean run's (a bad request does not reach the others)."""
    _importorskip(backend)
    cfg, _, kv = setup("deepseek", pages=40, device="cuda", page_size=FLASHMLA_PAGE_SIZE)
    lens = [300, 1, 65, 777, 130]
    for rid, n in enumerate(lens):
        kv.add(rid, n)
        kv.extend(rid, n)
    kv.pool.normal_()
    be = make_backend(backend, cfg, FLASHMLA_PAGE_SIZE, "cuda", 8, kv.num_pages + 8)
    t = kv.page_table(list(range(len(lens))))
    be.plan(t)
    q = torch.randn(len(lens), cfg.num_qo_heads, cfg.head_dim, device="cuda").bfloat16()
    C, cache = cfg.kv_lora_rank, kv.layer(1)
    out = be.run(1, q, cache)
    ref, _ = mla_reference(q[..., :C], q[..., C:], cache[..., :C], cache[..., C:], t.kv_indptr, t.kv_indices,
                           t.kv_last_page_len, cfg.sm_scale)
    assert out.shape == (len(lens), cfg.num_qo_heads, C) and out.dtype == q.dtype
    assert rel(out, ref) < 1e-2
    cache[kv.pages(2)[1], 0, 7] = float("nan")   # request 2's token 64
    bad = be.run(1, q, cache)
    others = [0, 1, 3, 4]
    assert torch.equal(bad[others], out[others])
    if backend in ("meld", "sdpa"):
        assert bad[2].isnan().all()


@pytest.mark.gpu
@pytest.mark.cublas_output   # the model's projections feed meld
@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek"])
def test_gpu_meld_matches_sdpa(kind):
    """meld (its MoE too) against SDPA (and torch's MoE), graphs on; the MoE model eager, on the SDPA run's
    routing (RoutingTape: bf16 near-ties would flip some tokens' experts between any two backends)."""
    cfg, model, kv = setup(kind, pages=400, device="cuda")
    tape = RoutingTape(cfg.top_k) if cfg.is_moe else None
    ref = run_with_routing(model, engine(model, kv, "sdpa", max_batch=8), _gpu_trace(), 20, tape)
    got = run_with_routing(model, engine(model, kv, "meld", max_batch=8, graphs=not cfg.is_moe), _gpu_trace(), 20,
                           tape and tape.replay())
    c = compare(got, ref)
    assert c["check_steps"] == 20 and c["check_rel_err"] < TOL and c["check_argmax_agree"] >= 0.9


@pytest.mark.gpu
@pytest.mark.cublas_output   # the model's projections feed meld
@pytest.mark.parametrize("backend", ["flashinfer", "flashinfer-tc"])
def test_gpu_flashinfer_matches_meld(backend):
    pytest.importorskip("flashinfer")
    cfg, model, kv = setup(pages=400, device="cuda")
    got = _run(model, kv, backend, _gpu_trace(), steps=20, max_batch=8, graphs=True, moe="torch")
    ref = _run(model, kv, "meld", _gpu_trace(), steps=20, max_batch=8, graphs=True, moe="torch")
    assert compare(got, ref)["check_rel_err"] < TOL


@pytest.mark.gpu
@pytest.mark.cublas_output   # the model's projections feed meld
def test_gpu_serve_bench_full_size_smoke(capsys):
    """The full-size models for a few steps through the CLI, graphs on, checked against SDPA (qwen3-moe also with
    FP8 experts)."""
    for model, experts in (("llama", "bf16"), ("qwen3-moe", "bf16"), ("qwen3-moe", "fp8")):
        argv = ["serve-bench", "--model", model, "--backend", "meld,sdpa", "--max-batch", "8", "--requests", "12",
                "--steps", "6", "--layers", "1", "--check", "--check-steps", "2", "--samples", "2",
                "--kv-pages", "20000", *(["--moe-dtype", experts] if experts != "bf16" else [])]
        assert cli.main(argv) == 0, capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.whole_gpu       # ~75 GB at its peak: beside the suite's other workers, they ran out of memory
@pytest.mark.cublas_output   # the model's projections feed meld
def test_gpu_serve_bench_deepseek_full_size(capsys, tmp_path):
    """DeepSeek-V3's shapes (one layer: 128 heads, 256 experts) through the CLI for a few steps, graphs on, page
    size 64: meld and the peers that import here, each checked against SDPA with torch's MoE."""
    out = tmp_path / "rows.json"
    argv = ["serve-bench", "--model", "deepseek", "--backend", "meld,flashinfer,flashmla", "--max-batch", "8",
            "--requests", "12", "--steps", "6", "--layers", "1", "--check", "--check-steps", "2", "--samples", "2",
            "--kv-pages", "5000", "--json", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["backend"] == "meld" and rows[0]["moe"] == "meld" and rows[0]["mode"] == "graphs"
    assert all(r["check_ok"] and r["steps"] == 6 and r["attn_share"] > 0 for r in rows)
