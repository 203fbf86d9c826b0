"""meld.distributed.RowParallelLinear (templates/tp_linear.cuh): every token-block variant compiles for sm_90a,
the window layout holds the largest call, the token block covers the rows; on one GPU (a process group of
one rank: the GEMM and the tile protocol without a peer) it matches float64 on fresh random inputs, with
the output poisoned first and repeated launches bit-identical. Two GPUs: tests/test_dist_gpu.py."""
import functools
import math

import numpy as np
import pytest
import torch

from meld.codegen.tp_kernel import (TP_BLOCK_TOKENS, TpKernelConfig, TpSchedule, block_config, call_configs,
                                    tp_block_tokens)
from meld.distributed.tp_linear import _describe_tile, _window_layout
from tests.kernel_matrix import nvcc, pairwise


VARIANTS = [(1, 0, "owner", "peer", "bfloat16", 0), (2, 1, "owner", "peer", "bfloat16", 0),
            (1, 2, "owner", "peer", "float32", 0), (0, 0, "every_rank", "peer", "bfloat16", 0),
            (1, 0, "every_rank", "proxy", "bfloat16", 0), (1, 0, "every_rank", "proxy", "float32", 0),
            (1, 1, "owner", "peer", "bfloat16", 2), (0, 0, "every_rank", "peer", "bfloat16", 2)]
DEFAULT = (0, 0, "every_rank", "peer", "bfloat16", 0)   # TpKernelConfig()'s


# Every token block with every variant is 48 compiles: by default the default build at every block and
# every pair of values (block and variant fields) at least once, 31 of them; -m full_matrix the other 17.
@pytest.mark.parametrize("bt, k_boxes, ctas, merge, transport, partials, wgs",
                         pairwise([(bt, *v) for bt in TP_BLOCK_TOKENS for v in VARIANTS], keep=lambda c: c[1:] == DEFAULT))
def test_kernel_compiles_for_sm90a(bt, k_boxes, ctas, merge, transport, partials, wgs):
    cfg = block_config(TpKernelConfig(k_boxes=k_boxes, ctas_per_sm=ctas, merge=merge, transport=transport,
                                      partials=partials, warpgroups=wgs), bt)
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert len(cubin) > 0
    assert "wgmma" not in log.lower(), f"ptxas serialised the wgmma pipeline:\n{log}"
    spills = [line for line in log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills), f"registers spill:\n{log}"
    wide_float_stage = merge == "every_rank" and partials == "float32" and bt == 256   # a 128 KiB staged tile
    assert cfg.stages >= (3 if cfg.boxes == 1 and not wide_float_stage else 2) and cfg.smem_bytes <= (112 << 10 if cfg.ctas == 2 else 227 << 10)


@pytest.mark.parametrize("bt, merge", [(8, "every_rank"), (256, "every_rank"), (128, "owner")])
def test_profiling_kernel_compiles_for_sm90a(bt, merge):
    """Profiling builds record from several threads of a CTA (common.cuh: Profiler.join)."""
    cfg = block_config(TpKernelConfig(profile=True, merge=merge), bt)
    assert cfg.name.endswith("_prof") and "#define MELD_PROFILE 1" in cfg.render()
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert len(cubin) > 0 and "wgmma" not in log.lower()


def test_block_tokens_cover_the_rows():
    assert [tp_block_tokens(m) for m in (1, 8, 9, 64, 65, 200, 256, 257, 8192)] == [8, 8, 16, 64, 128, 128, 128, 256, 256]
    with pytest.raises(ValueError, match="block_tokens=24"):
        TpKernelConfig(24)
    with pytest.raises(ValueError, match="watchdog_ms"):
        TpKernelConfig(8, watchdog_ms=0)
    with pytest.raises(ValueError, match="k_boxes=3"):
        TpKernelConfig(8, 3)
    with pytest.raises(ValueError, match="needs merge='every_rank'"):
        TpKernelConfig(merge="owner", transport="proxy")
    with pytest.raises(ValueError, match="merge='last'"):
        TpKernelConfig(merge="last")
    with pytest.raises(ValueError, match="partials='float16'"):
        TpKernelConfig(partials="float16")
    with pytest.raises(ValueError, match="ctas_per_sm=2"):
        TpKernelConfig(128, ctas_per_sm=2)
    assert block_config(TpKernelConfig(ctas_per_sm=2), 128).ctas == 1
    assert [block_config(TpKernelConfig(), b).ctas for b in TP_BLOCK_TOKENS] == [1, 1, 1, 1, 1, 1]
    assert [block_config(TpKernelConfig(), b).boxes for b in TP_BLOCK_TOKENS] == [2, 2, 2, 2, 1, 1]
    assert block_config(TpKernelConfig(ctas_per_sm=2), 64).boxes == 1 and TpKernelConfig(8, k_boxes=1).boxes == 1
    assert [block_config(TpKernelConfig(), b).wgs for b in TP_BLOCK_TOKENS] == [1, 1, 1, 1, 1, 2]
    assert [block_config(TpKernelConfig(warpgroups=2), b).wgs for b in TP_BLOCK_TOKENS] == [1, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="warpgroups=3"):
        TpKernelConfig(warpgroups=3)
    with pytest.raises(ValueError, match="warpgroups=2"):
        TpKernelConfig(warpgroups=2, ctas_per_sm=2)


@pytest.mark.parametrize("m, n, k, ctas, splits", [(1, 8192, 4096, 2, 2), (1, 4096, 4096, 2, 4), (1, 4096, 4096, 1, 2),
                                                   (16, 1024, 8192, 1, 8), (1, 8192, 256, 2, 1), (128, 8192, 4096, 2, 1),
                                                   (1, 8192, 4096, 1, 1), (4096, 8192, 4096, 1, 1)])
def test_schedule_gives_every_cta_slot_a_piece(m, n, k, ctas, splits):
    base = TpKernelConfig(ctas_per_sm=ctas)
    s = TpSchedule.of(m, n, k, 132, base)
    slots = block_config(base, s.block_tokens).ctas * 132
    assert s.k_splits == splits and s.m_tiles * s.block_tokens >= m
    assert s.pieces <= max(slots, s.out_tiles) and (s.k_splits == 1 or -(-k // 64) >= 8 * s.k_splits)


@pytest.mark.parametrize("m, n, k, ctas, block, splits", [
    (128, 4096, 2048, 1, 64, 1), (65, 4096, 7168, 1, 64, 1), (512, 4096, 2048, 1, 128, 1), (300, 4096, 7168, 1, 128, 1),
    (128, 8192, 4096, 1, 128, 1), (512, 8192, 4096, 1, 256, 1), (1024, 4096, 2048, 1, 256, 1),
    (128, 4096, 2048, 2, 128, 2), (512, 1024, 4096, 1, 256, 8), (100, 4096, 512, 1, 128, 1)])
def test_schedule_halves_a_block_that_would_split_k(m, n, k, ctas, block, splits):
    """A token block whose tiles are too few for the CTA slots gives way to one half as wide when that one
    fills them without a K split (not below 64 rows, and only with more token blocks)."""
    s = TpSchedule.of(m, n, k, 132, TpKernelConfig(ctas_per_sm=ctas))
    assert (s.block_tokens, s.k_splits) == (block, splits)
    assert s.m_tiles == -(-m // block) and s.pieces == s.out_tiles * splits


@pytest.mark.parametrize("m, n, k, cols, splits", [
    (200, 8192, 4096, 128, 1), (512, 4096, 2048, 128, 1), (300, 4096, 7168, 128, 1),   # 128 x 128 tiles, K whole
    (128, 8192, 4096, 64, 1), (200, 4096, 2048, 64, 1),   # 128 columns would split K: 64
    (512, 8192, 4096, 128, 1), (1, 8192, 4096, 64, 1)])   # 256-token blocks: two warpgroups; decode: one
def test_a_128_token_block_takes_128_columns_where_k_stays_whole(m, n, k, cols, splits):
    s = TpSchedule.of(m, n, k, 132, TpKernelConfig())
    assert (s.cols, s.k_splits) == (cols, splits) and s.config(TpKernelConfig()).cols == cols
    assert s.config(TpKernelConfig()) in call_configs(TpKernelConfig())   # (loaded up front for the proxy)
    one = TpSchedule.of(m, n, k, 132, TpKernelConfig(warpgroups=1))   # an explicit choice holds
    assert one.cols == 64 and one.config(TpKernelConfig(warpgroups=1)).wgs == 1


@pytest.mark.parametrize("m, n, k, world, ctas, sms", [   # K split (a piece a CTA), and several pieces a CTA
    (1, 4096, 4096, 2, 2, 132), (16, 1024, 8192, 1, 1, 132), (129, 200, 1000, 4, 1, 132), (5, 136, 1000, 3, 1, 7),
    (300, 4096, 7168, 2, 1, 7), (1, 4096, 4096, 2, 2, 7), (70, 150, 133, 2, 2, 1)])
def test_schedule_rows_cover_every_tile_split_once_as_the_closed_form(m, n, k, world, ctas, sms):
    """TpSchedule.tasks: one TP_PIECE row per (output tile, split of K), in walk order, each as the closed
    form the kernel computed before (tile o = t // k_splits, column block o // m_tiles, token block
    o % m_tiles, K stages nk split / k_splits ..), run by CTA t % grid at slot ordinal t // grid of its
    block; an EVENT row per tile: world x k_splits parts from the tile's first piece. Bad arguments named."""
    from meld.ir.work_table import EVENT, TP_PIECE

    base = TpKernelConfig(ctas_per_sm=ctas)
    s = TpSchedule.of(m, n, k, sms, base)
    grid = min(s.pieces, block_config(base, s.block_tokens).ctas * sms)
    tasks, events = s.tasks(grid, world)
    assert tasks.dtype == events.dtype == np.int32
    r, e = TP_PIECE.unpack(tasks, s.pieces), EVENT.unpack(events, s.out_tiles)
    assert sorted(zip(r["tile"], r["split"])) == [(o, j) for o in range(s.out_tiles) for j in range(s.k_splits)]
    t = np.arange(s.pieces)
    o, split = t // s.k_splits, t % s.k_splits
    nk = -(-k // s.k_block)
    assert np.array_equal(r["tile"], o) and np.array_equal(r["last_tile"], o) and np.array_equal(r["split"], split)
    assert np.array_equal(r["col"], o // s.m_tiles) and np.array_equal(r["tok0"], o % s.m_tiles * s.block_tokens)
    assert np.array_equal(r["k0"], nk * split // s.k_splits) and np.array_equal(r["k1"], nk * (split + 1) // s.k_splits)
    assert np.all(r["kind"] == TP_PIECE.kind) and np.array_equal(r["cta"], t % grid)
    assert np.array_equal(r["slot"], t % grid * -(-s.pieces // grid) + t // grid) and len(set(r["slot"])) == s.pieces
    assert np.array_equal(r["event_first"], o) and np.all(r["event_count"] == 1)
    assert np.all(e["parts"] == world * s.k_splits) and np.array_equal(e["part_first"], np.arange(s.out_tiles) * s.k_splits)
    covered = np.zeros(k, int)   # every element of K once per tile, within the shape
    for i in range(s.k_splits):
        covered[s.piece_slices(r, i)[2]] += 1
    assert np.all(covered == 1) and s.piece_slices(r, s.pieces - 1)[:2] == (
        slice((s.m_tiles - 1) * s.block_tokens, m), slice(s.cols * (-(-n // s.cols) - 1), n))
    describe = _describe_tile({"sched": s, "grid": grid, "world": world})   # the watchdog's names, from the rows
    assert describe(s.pieces - 1).startswith(f"piece {s.k_splits - 1} of {s.k_splits} of K of output tile {s.out_tiles - 1}:")
    assert describe(s.pieces - 1).endswith(f"..{n - 1}, tokens {(s.m_tiles - 1) * s.block_tokens}..{m - 1}")
    for bad in ({"grid": 0}, {"world": -1}, {"grid": 2.0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            s.tasks(**{"grid": grid, "world": world, **bad})


def test_max_block_tokens_caps_the_token_block():
    """A cap on the token block: more, narrower tiles (pieces a CTA); a wrong cap is named."""
    assert TpSchedule.of(512, 8192, 4096, 132, TpKernelConfig()).block_tokens == 256
    s = TpSchedule.of(512, 8192, 4096, 132, TpKernelConfig(max_block_tokens=128))
    assert (s.block_tokens, s.cols, s.m_tiles, s.out_tiles, s.k_splits) == (128, 128, 4, 256, 1)
    assert TpSchedule.of(16, 8192, 4096, 132, TpKernelConfig(max_block_tokens=128)).block_tokens == 16
    assert TpSchedule.of(100, 8192, 4096, 132, TpKernelConfig(max_block_tokens=64)).block_tokens == 64
    with pytest.raises(ValueError, match="max_block_tokens=100"):
        TpKernelConfig(max_block_tokens=100)


def test_direct_path_takes_decode_sizes_only():
    """One piece a CTA (K split or not), token blocks of at most 64 at one CTA per SM, every-rank merges over
    peer memory, and room for both launches' slots of every rank and CTA slot: else the general path."""
    from meld.codegen.tp_kernel import LL_MAX_TOKENS, direct_path, direct_room

    room = direct_room(TpKernelConfig(), 256, 2, 132)
    assert room == 2 * 2 * 132 * (LL_MAX_TOKENS * 64 // 2) * 8   # 8.6 MB: one CTA slot per SM
    L = _window_layout(256, 8192, 2, 132, 1, room)
    assert L["nbytes"] - L["ll"] >= room and L["ll"] > L["signal"]

    def direct(m, n=8192, k=4096, world=2, room=room, **cfg):
        base = TpKernelConfig(**cfg)
        s = TpSchedule.of(m, n, k, 132, base)
        c = block_config(base, s.block_tokens)
        return direct_path(c, s, min(s.pieces, c.ctas * 132), world, 132, room)

    assert direct(1) and direct(16) and direct(64) and direct(1, world=2, partials="float32")
    assert direct(1, n=4096) and direct(16, n=1024)   # K split: 64 tiles x 2, 16 tiles x 8
    assert not direct(65) and not direct(300)         # wider token blocks: their words would carry too many bytes
    assert direct(128, n=4096) and not direct(129, n=4096)   # two 64-token blocks rather than a K split
    assert not direct(1, n=16384)                     # 256 tiles: two a CTA
    assert not direct(64, ctas_per_sm=2)              # the registers of its words: one CTA per SM
    assert not direct(1, merge="owner") and not direct(1, transport="proxy")
    assert direct(16, world=4) and not direct(64, world=4)   # a region sized for two ranks of 64 rows
    assert not direct(32, room=direct_room(TpKernelConfig(), 16, 2, 132))   # sized for 16 rows
    s = TpSchedule.of(1, 4096, 4096, 132, TpKernelConfig())
    c = block_config(TpKernelConfig(), s.block_tokens)
    assert direct_path(c, s, 132, 2, 132, room) and not direct_path(c, s, 133, 2, 132, room)   # a slot per SM


@pytest.mark.parametrize("max_tokens, n, world", [(1, 8, 2), (300, 1000, 2), (8192, 8192, 4), (77, 136, 1), (16, 64, 2)])
@pytest.mark.parametrize("own_parts_only", [False, True])
def test_window_holds_the_largest_call(max_tokens, n, world, own_parts_only):
    """Owner merges and the proxy keep every rank's partials in a window; every-rank merges over peer memory
    only their own rank's."""
    L = _window_layout(max_tokens, n, world, 132, 1 if own_parts_only else world)
    offsets = [L[k] for k in ("out", "part", "count", "landed", "started")] + [L["nbytes"]]
    assert offsets == sorted(offsets) and all(o % 256 == 0 for o in offsets)
    assert L["part"] - L["out"] >= max_tokens * n * 2
    for m in range(1, max_tokens + 1, max(1, max_tokens // 40)):
        for k, ctas in ((64, 1), (4096, 2), (4096, 1), (1 << 16, 2)):
            s = TpSchedule.of(m, n, k, 132, TpKernelConfig(ctas_per_sm=ctas))
            grid = min(s.pieces, block_config(TpKernelConfig(ctas_per_sm=ctas), s.block_tokens).ctas * 132)
            per_cta = -(-s.pieces // grid)   # every-rank merges: each CTA's block of pieces
            ranks = 1 if own_parts_only else world
            assert L["count"] - L["part"] >= grid * per_cta * ranks * s.cols * s.block_tokens * 4, (m, k, s)
            if not own_parts_only:
                assert L["count"] - L["part"] >= s.pieces * world * s.cols * s.block_tokens * 4, (m, k, s)
            assert L["landed"] - L["count"] >= s.out_tiles * 8


ONE_RANK_CASES = [(1, 4096, 1024, "owner", "bfloat16"), (37, 1000, 136, "owner", "bfloat16"),
                  (200, 264, 520, "owner", "bfloat16"), (1, 4096, 1024, "every_rank", "bfloat16"),
                  (37, 1000, 136, "every_rank", "bfloat16"), (1, 4096, 1024, "owner", "float32"),
                  (37, 1000, 136, "every_rank", "float32"), (300, 1000, 200, "owner", "bfloat16"),
                  (300, 520, 136, "every_rank", "bfloat16"), (520, 264, 8200, "every_rank", "bfloat16"),
                  (130, 1000, 8200, "every_rank", "float32"), (128, 2048, 4096, "every_rank", "bfloat16"),
                  (500, 2048, 4096, "every_rank", "bfloat16"), (250, 1000, 8192, "owner", "bfloat16")]
# Small enough for compute-sanitizer's racecheck: the direct path (M = 1, every rank), the general path with
# its sender and merge teams (M = 37, 300), and the owner merge.
RACECHECK_CASES = [(1, 1024, 256, "every_rank", "bfloat16"), (37, 264, 136, "every_rank", "bfloat16"),
                   (300, 264, 136, "every_rank", "float32"), (37, 264, 136, "owner", "bfloat16")]


def _one_rank(rank, world, cases=ONE_RANK_CASES):
    from meld.distributed import RowParallelLinear

    dev = torch.device("cuda", rank)
    for m, k, n, merge, partials in cases:
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        ref = x.double() @ w.double().T
        op = RowParallelLinear(k, n, max_tokens=m, kernel_config=TpKernelConfig(merge=merge, partials=partials))
        op.output(m).fill_(math.nan)
        y = op(x.to(dev), w.to(dev)).clone()
        for _ in range(3):
            again = op(x.to(dev), w.to(dev))
        torch.cuda.synchronize()
        assert not y.isnan().any()
        err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"(M, K, N) = {(m, k, n)}: relative error {err:.2e}"
        assert torch.equal(y, again), "launches differ"


@pytest.mark.gpu
def test_one_rank_matches_float64():
    from meld.distributed import spawn

    spawn(_one_rank, 1)


@pytest.mark.gpu
@pytest.mark.racecheck
def test_one_rank_small_cases():
    """Every path of the kernel at sizes compute-sanitizer's racecheck runs in seconds."""
    from meld.distributed import spawn

    spawn(functools.partial(_one_rank, cases=RACECHECK_CASES), 1)


def _one_rank_trace(rank, world):
    from meld.distributed import RowParallelLinear

    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(3)
    # the direct path; the general path with one piece a CTA, with two, and (blocks capped at 64) with eight
    for m, k, n, cap in [(1, 2048, 4096, 0), (500, 2048, 4096, 0), (1000, 1000, 8200, 0), (500, 1000, 8200, 64)]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        ref = x.double() @ w.double().T
        x, w = x.to(dev), w.to(dev)
        plain = RowParallelLinear(k, n, max_tokens=m, kernel_config=TpKernelConfig(max_block_tokens=cap))
        prof = RowParallelLinear(k, n, max_tokens=m, kernel_config=TpKernelConfig(profile=True, max_block_tokens=cap))
        with pytest.raises(RuntimeError, match="needs a launch"):
            prof.last_trace()
        plain.output(m).fill_(math.nan)
        y = plain(x, w).clone()
        err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"(M, K, N, cap) = {(m, k, n, cap)}: relative error {err:.2e}"
        assert torch.equal(prof(x, w), y), "profiling changed the output"
        trace = prof.last_trace()
        sched, _, _, grid, direct, _ = prof._calls[m]
        kinds = [t.kind for t in trace.tasks]
        assert len(trace.cta_spans) == grid and trace.overflowed == 0
        assert sorted(t.unit for t in trace.tasks if t.kind == "tp-gemm") == list(range(sched.pieces))
        if direct:
            assert kinds.count("tp-direct") == sched.pieces and "tp-send" not in kinds
        else:
            assert kinds.count("tp-send") == kinds.count("tp-stage") == sched.pieces
            units = sched.merge_units[1]   # each unit of each tile merged once
            merged = sorted((u // 8 // units, u // 8 % units + i) for t in trace.tasks if t.kind == "tp-merge"
                            for u in [t.unit] for i in range(u % 8))
            assert merged == [(o * sched.k_splits, q) for o in range(sched.out_tiles) for q in range(units)]
        for t in trace.tasks:   # inside the CTA's span
            span = trace.cta_spans[[s.cta for s in trace.cta_spans].index(t.cta)]
            assert span.begin_ns <= t.start_ns <= t.end_ns <= span.end_ns, t


@pytest.mark.gpu
def test_one_rank_trace_records_every_piece():
    """A profiling build gives the plain build's output bits (float64-checked, capped token blocks too) and a
    trace: every piece's GEMM, and per path the direct exchange or each piece's stage and send and the
    tiles' merges, inside their CTA's span."""
    from meld.distributed import spawn

    spawn(_one_rank_trace, 1)


def _one_rank_plans(rank, world):
    from meld.distributed import RowParallelLinear

    dev = torch.device("cuda", rank)
    k, n = 4000, 1000   # a last K stage and a last column tile in part
    g = torch.Generator().manual_seed(38)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(torch.bfloat16)
    op = RowParallelLinear(k, n, max_tokens=300)
    # the direct path with K split, 64-token blocks, 256-token blocks with a short last one, and back again:
    # each M its own rows on the device, switched with M
    for m in (1, 37, 300, 37, 130, 1, 300):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        nan_rows = sorted({m // 2, m - 1}) if m > 1 else []
        for i in nan_rows:
            x[i, (7 * i) % k] = math.nan
        ref = x.double() @ w.double().T
        op.output(m).fill_(math.nan)
        y = op(x.to(dev), w.to(dev)).clone().cpu()
        sched, _, _, _, direct, tasks = op._calls[m]
        assert tasks.numel() == 13 * sched.pieces
        bad = y.isnan().any(dim=1)
        assert bad.nonzero().flatten().tolist() == nan_rows, f"M = {m}: NaN rows {bad.nonzero().flatten().tolist()}"
        ok = ~bad
        err = ((y[ok].double() - ref[ok]).norm() / ref[ok].norm()).item() if ok.any() else 0.0
        assert err < 1e-2, f"M = {m} (k_splits {sched.k_splits}, direct {direct}): relative error {err:.2e}"
    # a first call of a new M while a graph is being captured is refused by name, the operator unchanged
    x5 = torch.randn(5, k, generator=g).to(torch.bfloat16).to(dev)
    wd = w.to(dev)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            with pytest.raises(RuntimeError, match="first call with 5 rows"):
                op(x5, wd)
    assert 5 not in op._calls
    y5 = op(x5, wd).double().cpu()
    ref5 = x5.double().cpu() @ w.double().T
    assert ((y5 - ref5).norm() / ref5.norm()).item() < 1e-2


@pytest.mark.gpu
def test_one_rank_calls_of_several_m_run_their_own_rows():
    """One operator called with several M in turn: each M's plan rows (TpSchedule.tasks) on the device, the
    kernel's table switched with M: float64-close on fresh inputs every call, NaN in a row of x giving NaN
    in exactly that row of y; a first call of a new M under capture is refused, the operator unchanged."""
    from meld.distributed import spawn

    spawn(_one_rank_plans, 1)


def test_needs_a_process_group():
    import torch.distributed as dist

    from meld.distributed import RowParallelLinear

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        RowParallelLinear(64, 64, max_tokens=8)


def test_graph_lowers_to_the_row_parallel_kernel_and_its_sum():
    """The operator's task graph decides the family and the merge (as for decode attention and MoE); a
    split-reduce over K that asks for another combiner is refused before anything compiles."""
    import dataclasses

    from meld.codegen.lowering import lower
    from meld.ir import Reduction
    from meld.ir.task_graph import GraphError
    from meld.ops.tp_linear_graph import tp_linear_graph

    g = tp_linear_graph(4096, 8192, 2)
    assert (lower(g).family, lower(g).combiner) == ("tp_linear", "sum")
    assert g.attrs["world"] == 2 and {t.kind for t in g.tasks} == {"split_reduce", "combine"}
    with pytest.raises(ValueError, match="world=0"):
        tp_linear_graph(64, 64, 0)
    red = Reduction("weighted_sum", "k")
    bad = tp_linear_graph(64, 64, 2)
    for t in bad.tasks:
        bad.graph.nodes[t.name]["task"] = dataclasses.replace(t, reduction=red)
    for s, d in bad.graph.edges:
        bad.graph.edges[s, d]["reduction"] = red
    with pytest.raises(GraphError, match="weighted_sum"):
        lower(bad)


# --- the TVM frontend ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, n, world, dtype", [(64, 136, 2, "bfloat16"), (24, 8, 3, "float16"), (512, 64, 1, "bfloat16")])
def test_capture_gives_the_builders_graph(k, n, world, dtype):
    from meld.frontend.capture_tp import capture_tp_linear
    from meld.frontend.tp_linear import tp_linear_primfunc
    from meld.ops.tp_linear_graph import tp_linear_graph

    g = capture_tp_linear(tp_linear_primfunc(k, n, world, dtype), world)
    assert g.to_json() == tp_linear_graph(k, n, world, dtype).to_json()


def _variant(update):
    """A definition like tp_linear_primfunc(16, 8, 2)'s whose reduction is `update(x, w, t, n, k)`."""
    from tvm import te, tirx

    T = tirx.Var("num_tokens", "int32")
    x, w = te.placeholder((T, 32), "bfloat16", "x"), te.placeholder((8, 32), "bfloat16", "weight")
    k = te.reduce_axis((0, 32), "k")
    acc = te.compute((T, 8), lambda t, n: update(x, w, t, n, k), name="acc")
    out = te.compute((T, 8), lambda t, n: acc[t, n].astype("bfloat16"), name="out")
    return te.create_prim_func([x, w, out])


def test_capture_rejects_other_math():
    from tvm import te

    from meld.frontend.capture_tp import capture_tp_linear
    from meld.frontend.tp_linear import tp_linear_primfunc

    f32 = "float32"
    with pytest.raises(ValueError, match="no known combiner|matches no"):   # a max, not a sum
        capture_tp_linear(_variant(lambda x, w, t, n, k: te.max(x[t, k].astype(f32) * w[n, k].astype(f32), axis=k)), 2)
    with pytest.raises(ValueError, match="another formula"):                 # a sum, of another product
        capture_tp_linear(_variant(lambda x, w, t, n, k: te.sum(x[t, k].astype(f32) * w[n, k].astype(f32)
                                                               * x[t, k].astype(f32), axis=k)), 2)
    with pytest.raises(ValueError, match="world=3 does not divide"):
        capture_tp_linear(tp_linear_primfunc(16, 8, 2), 3)
    with pytest.raises(ValueError, match="world=0"):
        capture_tp_linear(tp_linear_primfunc(16, 8, 2), 0)


def test_bad_construction_names_the_argument(tmp_path):
    """In a process group of one (gloo, CPU): every check before a window is allocated."""
    import torch.distributed as dist

    from meld.distributed import RowParallelLinear

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for kwargs, match in [(dict(in_features=0), "in_features must be a positive int"),
                              (dict(out_features=100), "out_features=100: must be a multiple of 8"),
                              (dict(in_features=12), "in_features=12: must be a multiple of 8"),
                              (dict(max_tokens=-1), "max_tokens must be a positive int"),
                              (dict(dtype=torch.float16), "dtype must be torch.bfloat16"),
                              (dict(device="cpu"), "device must be a CUDA device"),
                              (dict(kernel_config="fast"), "kernel_config must be"),
                              (dict(kernel_config=TpKernelConfig(8, k_boxes=4)), "room for 1 stages")]:
            args = dict(in_features=64, out_features=64, max_tokens=8) | kwargs
            with pytest.raises(ValueError, match=match):
                RowParallelLinear(args.pop("in_features"), args.pop("out_features"), **args)
    finally:
        dist.destroy_process_group()
