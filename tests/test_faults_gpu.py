"""Faults and load: a kernel whose signal never comes trips its watchdog, which names the task; plan()
runs eight batches ahead of a stream held up by a slow kernel; two operators on two streams, and on two
threads; the largest tables the capacities allow."""
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import meld
from meld.runtime.reference import attention_reference
from meld.workloads import lengths, paged

pytestmark = pytest.mark.gpu
DEV = "cuda"
ROOT = Path(__file__).resolve().parents[1]


def _ref(q, kv, pb):
    return attention_reference(q, kv, *(t.to(q.device) for t in (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)))[0]


def _err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


# --- the watchdog ----------------------------------------------------------------------------------

WITHHELD = textwrap.dedent("""
    import dataclasses, sys, time, torch, meld
    from meld.codegen import DecodeKernelConfig
    from meld.runtime import watchdog
    from meld.workloads import paged
    cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128), tma=True, debug_withhold_signal=True,
                              watchdog_ms=200)
    pb = paged([3000, 50, 700], 16)
    attn = meld.DecodeAttention(8, 2, 128, 16, torch.bfloat16, "cuda", kernel_config=cfg)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    kv = torch.randn(pb.num_pages, 2, 16, 2, 128, device="cuda").bfloat16()
    q = torch.randn(3, 8, 128, device="cuda").bfloat16()
    torch.cuda.synchronize()
    print("CTA", int(attn.schedule.items()["cta"][0]))   # the CTA of unit 0's first piece
    t0 = time.monotonic()
    attn.run(q, kv)
    try:
        torch.cuda.synchronize()
        print("SYNC returned")
    except RuntimeError as e:
        print(f"SYNC {time.monotonic() - t0:.3f} {type(e).__name__}")
    for what, call in (("CHECK", watchdog.check), ("RUN", lambda: attn.run(q, kv)),
                       ("PLAN", lambda: attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len))):
        try:
            call()
            print(what, "no error")
        except watchdog.WatchdogTimeout as e:
            print(what, e)
""")


def _tripped_child(script: str) -> tuple[dict[str, str], str]:
    """Run a withheld-signal script in a child process (a trap leaves the CUDA context unusable); assert its
    kernel did not finish and its watchdog tripped within the 200 ms limit (plus slack). Returns its output
    lines by first word, and the whole output for messages."""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = r.stdout + r.stderr
    lines = {line.split(" ", 1)[0]: line for line in r.stdout.splitlines()}
    assert "SYNC" in lines, output
    sync = lines["SYNC"].split()
    assert sync[1] != "returned", "the kernel finished: the signal was not withheld\n" + output
    assert float(sync[1]) < 0.2 + 3.0, f"the watchdog took {sync[1]} s to trip (bound 0.2 s)"
    return lines, output


@pytest.mark.trap
def test_a_withheld_signal_trips_the_watchdog_which_names_the_task():
    """A debug build never issues unit 0's first tile: warp 0 of the CTA that runs it waits on that ring
    stage's mbarrier. The watchdog gives up after 200 ms, and the error names the kernel, CTA, warp, unit
    and flag. The trap leaves the process's CUDA context unusable, so the kernel runs in a child process."""
    lines, output = _tripped_child(WITHHELD)
    assert "CTA" in lines, output
    cta = lines["CTA"].split()[1]
    for what in ("CHECK", "RUN", "PLAN"):
        msg = lines[what]
        assert "meld watchdog on cuda:0: meld_decode_attention_bf16_d128_w8_s2_tma_wd200_withhold" in msg, msg
        assert f"CTA {cta} (SM " in msg and ") warp 0, working on unit 0 (request 0, kv head 0, q heads 0-3)" in msg, msg
        assert "for the TMA mbarrier of KV ring stage 0" in msg and "phase parity 0" in msg, msg


# --- load --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["host", "device"])
def test_eight_plans_ahead_of_a_slow_stream(where):
    """The host plans and launches eight batches while a slow kernel holds the stream: host page tables
    wait for staging buffers (two) without a wrong answer; device page tables never wait."""
    batches = [lengths(d, 32) for d in ("skewed", "one-long", "ragged", "uniform2k")] * 2
    batches = [[n + 17 * i for n in lens] for i, lens in enumerate(batches)]
    plans = [paged(lens, 16) for lens in batches]
    kv = torch.randn(max(p.num_pages for p in plans), 2, 16, 8, 128, device=DEV).bfloat16()
    qs = [torch.randn(32, 32, 128, device=DEV).bfloat16() for _ in plans]
    outs = [torch.full((32, 32, 128), float("nan"), device=DEV).bfloat16() for _ in plans]
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, DEV, max_batch_size=32,
                                max_num_pages=max(p.kv_indices.numel() for p in plans))
    tables = [(p.kv_indptr, p.kv_indices, p.kv_last_page_len) for p in plans]
    if where == "device":
        tables = [tuple(t.to(DEV) for t in ts) for ts in tables]
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    torch.cuda._sleep(3_000_000_000)       # about 1.5 s of one busy SM (longer than the host needs even under
    t0 = time.monotonic()                  # compute-sanitizer, which slows every launch)
    for ts, q, out in zip(tables, qs, outs):
        attn.plan(*ts, check=False) if where == "device" else attn.plan(*ts)
        attn.run(q, kv, out=out)
    host_s = time.monotonic() - t0
    done.record()
    if where == "device":
        assert not done.query(), "device page tables must never wait for the stream"
    else:
        assert host_s > 1.0, "the third plan must have waited for the first planner's staging buffer"
    torch.cuda.synchronize()
    for p, q, out in zip(plans, qs, outs):
        assert not out.isnan().any()
        assert _err(out, _ref(q, kv, p)) < 1e-2


def test_plan_gives_up_waiting_for_a_staging_buffer_and_changes_nothing(monkeypatch):
    """A planner that never reports its staging buffer free (as behind a hung stream): plan() raises
    within the bound, names what it waited for, and the last plan still runs."""
    from meld.runtime import tables

    monkeypatch.setattr(tables, "HOST_WAIT_S", 0.3)
    pb = paged(lengths("skewed", 16), 16)
    kv = torch.randn(pb.num_pages, 2, 16, 8, 128, device=DEV).bfloat16()
    q = torch.randn(16, 32, 128, device=DEV).bfloat16()
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, DEV)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    before = attn.run(q, kv)
    t = attn.tables
    t._expect[t._turn] = -5          # the flag the next plan() waits for never comes
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="has not released staging buffer .* after 0.3 s"):
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert time.monotonic() - t0 < 2.0
    assert torch.equal(attn.run(q, kv), before)


def _worker(attn, batches, kv, stream, results):
    with torch.cuda.stream(stream):
        for pb in batches:
            q = torch.randn(len(pb.kv_last_page_len), attn.num_qo_heads, attn.head_dim, device=DEV).bfloat16()
            attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
            results.append((q, pb, attn.run(q, kv)))


@pytest.mark.parametrize("threads", [False, True], ids=["one-thread", "two-threads"])
def test_two_operators_on_two_streams(threads):
    """Two operators (other shapes, other caches), each on its own stream, planned and run in turn from
    one thread or concurrently from two: every output right."""
    shapes = [(32, 8, 128), (16, 2, 64)]
    batches = [[paged(lengths(d, B), 16) for d in ("skewed", "one-long", "ragged") for B in (8, 64)]] * 2
    ops = [meld.DecodeAttention(hq, hkv, d, 16, torch.bfloat16, DEV) for hq, hkv, d in shapes]
    kvs = [torch.randn(max(p.num_pages for p in batches[i]), 2, 16, hkv, d, device=DEV).bfloat16()
           for i, (_, hkv, d) in enumerate(shapes)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())   # the caches are made on this stream
    results = [[], []]
    if threads:
        ts = [threading.Thread(target=_worker, args=(ops[i], batches[i], kvs[i], streams[i], results[i]))
              for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        for k in range(len(batches[0])):
            for i in range(2):
                _worker(ops[i], batches[i][k:k + 1], kvs[i], streams[i], results[i])
    torch.cuda.synchronize()
    for i in range(2):
        assert len(results[i]) == len(batches[i])
        for q, pb, out in results[i]:
            assert _err(out, _ref(q, kvs[i], pb)) < 1e-2


def test_the_largest_tables_the_capacities_allow():
    """B = 4096 requests over 2**22 pages (page size 1: a 1 GiB cache), at the capacities."""
    B, pages = 4096, 1 << 22
    pb = paged([pages // B] * B, 1, spare_pages=0)
    kv = torch.randn(pages, 2, 1, 1, 64, device=DEV).bfloat16()
    q = torch.randn(B, 8, 64, device=DEV).bfloat16()
    attn = meld.DecodeAttention(8, 1, 64, 1, torch.bfloat16, DEV, max_batch_size=B, max_num_pages=pages)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out = attn.run(q, kv)
    assert _err(out, _ref(q, kv, pb)) < 1e-2
    with pytest.raises(ValueError, match="max_batch_size=4096"):
        attn.plan(*(torch.zeros(B + 2, dtype=torch.int32),) * 2, torch.ones(B + 1, dtype=torch.int32))


MOE_WITHHELD = textwrap.dedent("""
    import time, torch, meld
    from meld.codegen.moe_kernel import MoeKernelConfig, block_tokens_for
    from meld.runtime import watchdog
    cfg = MoeKernelConfig(watchdog_ms=200, debug_withhold_signal=True)
    moe = meld.MoE(256, 128, 8, 2, device="cuda", max_num_tokens=64, kernel_config=cfg)
    w13 = torch.randn(8, 256, 256, device="cuda").bfloat16() * 0.05
    w2 = torch.randn(8, 256, 128, device="cuda").bfloat16() * 0.05
    x, logits = torch.randn(40, 256, device="cuda").bfloat16(), torch.randn(40, 8, device="cuda")
    moe._variant(block_tokens_for(40, 2, 8))   # compiled before the clock starts: only the wait is timed
    torch.cuda.synchronize()
    t0 = time.monotonic()
    moe(x, logits, w13, w2)
    try:
        torch.cuda.synchronize()
        print("SYNC returned")
    except RuntimeError as e:
        print(f"SYNC {time.monotonic() - t0:.3f} {type(e).__name__}")
    for what, call in (("CHECK", watchdog.check), ("RUN", lambda: moe(x, logits, w13, w2))):
        try:
            call()
            print(what, "no error")
        except watchdog.WatchdogTimeout as e:
            print(what, e)
""")


@pytest.mark.trap
def test_moe_waiting_on_a_row_block_that_never_completes_trips_the_watchdog():
    """A debug build never counts row block 0's gemm1 tiles, so its gemm2 tiles wait forever: the producer
    that waits gives up after 200 ms and the error names the kernel, the tile ticket and the row block."""
    lines, _ = _tripped_child(MOE_WITHHELD)
    for what in ("CHECK", "RUN"):
        msg = lines[what]
        assert "meld watchdog on cuda:0: meld_moe_main" in msg and "(tile ticket " in msg, msg
        assert "for the gemm1 tiles of row block 0" in msg, msg
