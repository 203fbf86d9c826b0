"""meld.distributed on two GPUs of one node (the device tool's nvidia-h200-x2), and as two ranks sharing one GPU
(`spawn(share_gpu=True)`: CUDA IPC windows, the ranks' kernels time-sliced: the cross-rank protocols
without a second GPU): sequence-parallel decode attention, the row-parallel linear and the expert-parallel
MoE, checked on every rank against float64 on fresh random inputs, outputs poisoned before each run,
repeated launches bit-identical, a CUDA graph replayed on new inputs."""
import math

import pytest
import torch

from meld.workloads import lengths, paged

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# Where the ranks run: one GPU each (skipped without two), or both on one GPU.
GPUS = [pytest.param(False, id="two-gpus", marks=pytest.mark.skipif(
            not torch.cuda.is_available() or torch.cuda.device_count() < 2,
            reason="needs two CUDA GPUs in one node (the device tool's nvidia-h200-x2)")),
        pytest.param(True, id="one-gpu-shared")]


def _device():
    """This rank's GPU (spawn set it: GPU r, or GPU 0 for ranks sharing one)."""
    return torch.device("cuda", torch.cuda.current_device())


def _all_gather(t):
    """Every rank's `t`, on this rank's device (through the host: a gloo group has no GPU collectives)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, t.cpu())
    return [e.to(t.device) for e in every]

HKV, GROUP, D, P = 8, 4, 128, 16
# Lengths: BENCH's skewed batch, one request split over both ranks, empties and odd lengths, a lone short
# request (one rank has no part at all), and a batch with several split requests.
CASES = [lengths("skewed", 8), [70001], [0, 3001, 17, 0, 9000, 1], [33], [20000, 5, 64000, 700, 4096, 4095]]


def _batch(lens, seed, dev):
    g = torch.Generator().manual_seed(seed)   # the same on every rank: replicated q and cache
    pb = paged(lens, P, generator=g)
    kv = torch.randn(pb.num_pages, 2, P, HKV, D, generator=g).to(torch.bfloat16).to(dev)
    q = torch.randn(len(lens), HKV * GROUP, D, generator=g).to(torch.bfloat16).to(dev)
    return pb, kv, q


def _check(op, pb, kv, q, out, lse, what):
    from meld.runtime.reference import attention_reference

    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr.to(q.device), pb.kv_indices.to(q.device),
                                       pb.kv_last_page_len.to(q.device))
    assert not out.isnan().any() and not lse.isnan().any(), f"{what}: unwritten or NaN output on rank {op.rank}"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, f"{what}: relative error {err:.2e} on rank {op.rank}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse = -inf must mark exactly the empty requests"
    if finite.any():
        assert (lse.double() - ref_lse)[finite].abs().max().item() < 2e-3, what


def _failure(op, what) -> str:
    """`what` went wrong on this rank: with the watchdog's record and the proxy's state."""
    from meld.runtime import watchdog

    proxy = op.proxy and f"; proxy landed {op.proxy.landed_ops} ops, error {op.proxy.error!r}"
    wd = watchdog.for_device(op.device)
    return f"rank {op.rank}: {what}; {wd.message() if wd.tripped() else 'no watchdog record'}{proxy or ''}"


def _sync(op, fn=lambda: None):
    """Run fn and wait for the device; a failed kernel is reported with the watchdog's record and the proxy's
    state."""
    try:
        fn()
        torch.cuda.synchronize(op.device)
    except Exception as e:   # (a fault surfaces in the next CUDA call: a module load raises CudaError)
        raise AssertionError(_failure(op, e)) from None


def _cases(cases: list, engine: str, n: int) -> list:
    """The cases a rank function runs: all of them, or the first n on the NVSHMEM engine (the same code paths, the
    engine underneath: its tests check the engine, and two ranks time-sliced on one GPU take minutes a case list)."""
    return cases[:n] if engine == "nvshmem" else cases


def _poisoned_run(op, q, kv):
    """Poison this rank's outputs, and let no rank start before every rank has (a peer's run writes here)."""
    import torch.distributed as dist

    out, lse = op.outputs(q.shape[0])
    out.fill_(math.nan)
    lse.fill_(math.nan)
    torch.cuda.synchronize()
    dist.barrier()
    return op.run(q, kv, return_lse=True)


def _seq_parallel_rank(rank, world, cluster_size, transport, ordered, engine="cuda"):
    import torch.distributed as dist

    from meld.distributed import SeqParallelDecode
    from meld.runtime.cuda_graphs import capture

    dev = _device()
    op = SeqParallelDecode(HKV * GROUP, HKV, D, P, torch.bfloat16, max_batch_size=16, max_num_pages=16384,
                           min_split_tokens=1024, cluster_size=cluster_size, transport=transport, ordered=ordered,
                           chunk_bytes=1000, engine=engine)   # (the proxy: puts cut into chunks that do not divide rows)
    for i, lens in enumerate(_cases(CASES, engine, 3)):
        pb, kv, q = _batch(lens, 100 + i, dev)
        op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        assert int(op.shard.num_parts.max()) == (world if max(lens) >= 1024 * world else 1)
        out, lse = _poisoned_run(op, q, kv)
        first = out.clone(), lse.clone()   # stream order: the launch has ended, with every rank's units here
        for _ in range(3):                 # the counters reset themselves: repeated launches agree bit for bit
            op.run(q, kv)
        _sync(op)
        _check(op, pb, kv, q, out, lse, f"lengths {lens}")
        assert torch.equal(first[0], out) and torch.equal(first[1], lse), "launches differ: a race"
        if i == 0:   # bad input: clear errors before anything launches, and the plan before stays in force
            with pytest.raises(ValueError, match="kv_indptr"):
                op.plan(pb.kv_indptr.long(), pb.kv_indices, pb.kv_last_page_len)
            big = paged([5] * 17, P)
            with pytest.raises(ValueError, match="max_batch_size=16"):
                op.plan(big.kv_indptr, big.kv_indices, big.kv_last_page_len)
            with pytest.raises(ValueError, match="q"):
                op.run(q[:-1], kv)
            with pytest.raises(ValueError, match="kv_cache"):
                op.run(q, kv[:1])
            again = op.run(q, kv).clone()
            _sync(op)
            assert torch.equal(again, first[0]), "a call that raised changed the operator"
            apart = op.run(q, (kv[:, 0].clone(), kv[:, 1].clone())).clone()   # K and V in two allocations
            _sync(op)
            assert torch.equal(apart, first[0]), "K and V apart differ from the same values in one cache"
    # Layers back to back, each output read by the stream's next work and no host sync between: no rank may
    # write a layer's results into a window whose rank still reads the layer before (outputs or partials).
    pb = paged(CASES[4], P, generator=torch.Generator().manual_seed(50))
    layers = []
    for i in range(4):
        g = torch.Generator().manual_seed(60 + i)
        layers.append((torch.randn(pb.num_pages, 2, P, HKV, D, generator=g).to(torch.bfloat16).to(dev),
                       torch.randn(len(CASES[4]), HKV * GROUP, D, generator=g).to(torch.bfloat16).to(dev)))
    op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    _sync(op)
    dist.barrier()
    outs = [tuple(t.clone() for t in op.run(q_l, kv_l, return_lse=True)) for kv_l, q_l in layers]
    _sync(op)
    for i, ((kv_l, q_l), (o, l)) in enumerate(zip(layers, outs)):
        _check(op, pb, kv_l, q_l, o, l, f"layer {i} of 4 run back to back")
    # A captured run, replayed after a replan to other lengths (the plan rewrites the tables in place).
    batches = [paged(lens, P, generator=torch.Generator().manual_seed(7 + j))
               for j, lens in enumerate((CASES[0], [20000, 5, 64000, 700, 4096, 4095, 0, 3]))]
    g = torch.Generator().manual_seed(9)
    kv = torch.randn(max(b.num_pages for b in batches), 2, P, HKV, D, generator=g).to(torch.bfloat16).to(dev)
    q = torch.empty(8, HKV * GROUP, D, dtype=torch.bfloat16, device=dev)
    op.plan(batches[0].kv_indptr, batches[0].kv_indices, batches[0].kv_last_page_len)
    torch.cuda.synchronize()
    dist.barrier()
    graph, _ = capture(lambda: op.run(q, kv), device=dev)
    q.copy_(torch.randn(q.shape, generator=g).to(torch.bfloat16))
    pb = batches[1]
    op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out, lse = op.outputs(8)
    out.fill_(math.nan)
    lse.fill_(math.nan)
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    _sync(op)
    _check(op, pb, kv, q, out, lse, "graph replay after a replan")
    op.close()


@pytest.mark.parametrize("share_gpu", GPUS)
@pytest.mark.parametrize("cluster_size, transport, ordered", [(1, "peer", True), (4, "peer", True),
                                                             (1, "proxy", True), (1, "proxy", False)])
def test_seq_parallel_decode_on_two_ranks_matches_float64(cluster_size, transport, ordered, share_gpu):
    """cluster_size 4: a mix of cluster grids, split units merging on chip before they cross ranks. The proxy
    transport as if the GPUs were two nodes, its chunks landing in issue order or shuffled."""
    from meld.distributed import spawn

    spawn(_seq_parallel_rank, 2, cluster_size, transport, ordered, share_gpu=share_gpu)


def _watchdog_rank(rank, world):
    import dataclasses
    import os

    import torch.distributed as dist

    from meld.codegen import DecodeKernelConfig
    from meld.distributed import SeqParallelDecode
    from meld.runtime import watchdog

    host = dist.new_group(backend="gloo")   # rank 0's CUDA context dies with its kernel: meet on the host
    dev = _device()
    kc = dataclasses.replace(DecodeKernelConfig.default("bfloat16", D), xrank="peer", watchdog_ms=100)
    op = SeqParallelDecode(HKV * GROUP, HKV, D, P, torch.bfloat16, max_batch_size=4, max_num_pages=1024,
                           min_split_tokens=1024, kernel_config=kc)
    pb, kv, q = _batch([5000, 300], 3, dev)
    op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    if rank == 0:   # rank 1 never runs this plan: rank 0's launch must give up and say why
        op.run(q, kv)
        with pytest.raises(RuntimeError):
            torch.cuda.synchronize(dev)
        with pytest.raises(watchdog.WatchdogTimeout, match="rank 1 to start this launch"):
            watchdog.check(dev)
    dist.barrier(group=host)
    os._exit(0)   # no teardown through a dead context


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs in one node (the device tool's nvidia-h200-x2)")
def test_seq_parallel_watchdog_names_a_rank_that_never_ran():
    from meld.distributed import spawn

    spawn(_watchdog_rank, 2)


# --- the row-parallel linear, its all-reduce fused per tile --------------------------------------------------
# (M, K per rank, N): every token block (8..256 and two blocks of 256), N and K not multiples of the 64-wide
# tiles, K below one stage.
TP_CASES = [(1, 4096, 1024), (5, 1000, 1000), (13, 512, 264), (40, 256, 512), (64, 2048, 8), (70, 520, 256),
            (300, 264, 136), (17, 24, 64), (520, 264, 8200), (130, 1000, 8200),   # these two: CTAs of 2 pieces
            (300, 1024, 264)]   # two consumer warpgroups, K in two pieces: four partials a tile, merged by both CTAs


def _tp_inputs(m, k, n, world, seed, dev):
    g = torch.Generator().manual_seed(seed)   # every rank draws every rank's slices: the reference is local
    xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    ws = [(torch.randn(n, k, generator=g) / math.sqrt(k * world)).to(torch.bfloat16) for _ in range(world)]
    ref = sum(x.double() @ w.double().T for x, w in zip(xs, ws))
    return xs, ws, ref


def _sync_holding_gil() -> int:
    """cuCtxSynchronize called through ctypes.PyDLL, which keeps the GIL for the call (as a first cuBLAS call
    loading its module does, for instance)."""
    import ctypes

    return ctypes.PyDLL("libcuda.so.1").cuCtxSynchronize()


def _tp_rank(rank, world, merge, transport, ordered, partials, engine="cuda"):
    import torch.distributed as dist

    from meld.codegen.tp_kernel import TpKernelConfig
    from meld.distributed import RowParallelLinear
    from meld.runtime.cuda_graphs import capture

    dev = _device()
    kc = TpKernelConfig(merge=merge, transport=transport, partials=partials)
    for i, (m, k, n) in enumerate(_cases(TP_CASES, engine, 4)):
        xs, ws, ref = _tp_inputs(m, k, n, world, 300 + i, dev)
        x, w = xs[rank].to(dev), ws[rank].to(dev)
        op = RowParallelLinear(k, n, max_tokens=max(m, 8), kernel_config=kc, ordered=ordered, chunk_bytes=1000,
                               engine=engine)
        out = op.output(m)
        out.fill_(math.nan)
        torch.cuda.synchronize()
        dist.barrier()
        y = op(x, w)
        if transport == "proxy":   # a host thread that waits for the GPU holding the GIL starves no proxy
            rc = _sync_holding_gil()
            assert rc == 0, _failure(op, f"cuCtxSynchronize returned {rc} at (M, K, N) = {(m, k, n)}")
        assert y.data_ptr() == out.data_ptr() and y.shape == (m, n)
        first = y.clone()
        for _ in range(3):
            op(x, w)
        torch.cuda.synchronize()
        assert not first.isnan().any(), f"(M, K, N) = {(m, k, n)}: unwritten output on rank {rank}"
        err = ((first.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"(M, K, N) = {(m, k, n)}: relative error {err:.2e} on rank {rank}"
        assert torch.equal(first, y), f"(M, K, N) = {(m, k, n)}: launches differ: a race"
        every = _all_gather(first)
        assert all(torch.equal(e, first) for e in every), "ranks disagree"
        if i == 1:   # bad input: clear errors, nothing launched, the operator usable afterwards
            with pytest.raises(ValueError, match="x"):
                op(x.float(), w)
            with pytest.raises(ValueError, match="weight"):
                op(x, w[:, :-8])
            with pytest.raises(ValueError, match="max_tokens=8"):
                op(torch.zeros(9, k, dtype=torch.bfloat16, device=dev), w)
            assert torch.equal(op(x, w), first)
            # Layers back to back, each output read in stream order: no rank writes a layer's tiles into a
            # window whose rank still reads the layer before.
            layers = [(torch.randn(m, k, device=dev).to(torch.bfloat16), w) for _ in range(4)]
            outs = [op(xl, wl).clone() for xl, wl in layers]
            for j, ((xl, wl), o) in enumerate(zip(layers, outs)):
                parts = _all_gather(xl)   # every rank's input of layer j
                wfull = _all_gather(wl)
                r = sum(p.double() @ q.double().T for p, q in zip(parts, wfull))
                e = ((o.double() - r).norm() / r.norm()).item()
                assert e < 1e-2, f"layer {j} of 4 back to back: relative error {e:.2e}"
                assert all(torch.equal(a, o) for a in _all_gather(o))
            # A captured call, replayed on new inputs.
            xg = x.clone()
            graph, _ = capture(lambda: op(xg, w), device=dev)
            xs2, _, _ = _tp_inputs(m, k, n, world, 999, dev)
            xg.copy_(xs2[rank])
            out.fill_(math.nan)
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            r2 = sum(a.double() @ b.double().T for a, b in zip(xs2, ws))
            e = ((out.double().cpu() - r2).norm() / r2.norm()).item()
            assert e < 1e-2, f"graph replay: relative error {e:.2e}"
        torch.cuda.synchronize()
        dist.barrier()
        op.close()


@pytest.mark.parametrize("merge, transport, ordered, partials", [
    ("owner", "peer", True, "bfloat16"), ("owner", "peer", True, "float32"), ("every_rank", "peer", True, "bfloat16"),
    ("every_rank", "proxy", True, "bfloat16"), ("every_rank", "proxy", False, "float32")])
@pytest.mark.parametrize("share_gpu", GPUS)
def test_row_parallel_linear_on_two_ranks_matches_float64(merge, transport, ordered, partials, share_gpu):
    """Both merges through NVLink peer memory; every-rank merges through the proxy transport as if the GPUs
    were two nodes, its chunks (1000 bytes: not whole rows) landing in issue order or shuffled."""
    from meld.distributed import spawn

    if share_gpu and transport == "proxy":
        pytest.skip("on one GPU the proxy's copy into the other rank's IPC mapping did not return while this "
                    "rank's kernel ran (CUDA error 719 once the watchdog trapped it): the proxy needs two GPUs")
    spawn(_tp_rank, 2, merge, transport, ordered, partials, share_gpu=share_gpu)


# --- expert-parallel MoE -------------------------------------------------------------------------------
# (H, I, E, top_k, T per rank, routing): sizes off the tiles, a hot expert with empty ones, one token,
# and the qwen3-30b-a3b shape.
EP_CASES = [(256, 136, 8, 2, 37, "uniform"), (512, 264, 16, 4, 200, "hot"), (264, 200, 4, 3, 1, "uniform"),
            (2048, 768, 128, 8, 128, "uniform")]


def _ep_inputs(H, I, E, k, T, routing, world, seed):
    """Every rank's tokens and routing and all experts' weights (the same draw on every rank: the
    reference is local)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(world)]
    w13 = (torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / math.sqrt(I)).to(torch.bfloat16)
    ids, wts = [], []
    for _ in range(world):
        score = torch.rand(T, E, generator=g)
        if routing == "hot":   # expert 1 in almost every token's choice, experts E-2 and E-1 in none
            score[:, 1] += 0.9
            score[:, E - 2:] = -1.0
        ids.append(score.topk(k, dim=1).indices.to(torch.int32))
        wts.append(torch.rand(T, k, generator=g) + 0.1)
    return xs, ids, wts, w13, w2


def _ep_reference(x, ids, wts, w13, w2):
    """out[t] = sum_j w[t, j] W2[e] (SiLU(W_gate[e] x[t]) * W_up[e] x[t]), in float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = x[t] @ w13[e].T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
        out.index_add_(0, t, y * wts[t, j].double()[:, None])
    return out


def _ep_rank(rank, world, transport, ordered, engine="cuda"):
    import torch.distributed as dist

    from meld.codegen.ep_kernel import EpKernelConfig
    from meld.distributed import ExpertParallelMoE
    from meld.runtime.cuda_graphs import capture

    dev = _device()
    for i, (H, I, E, k, T, routing) in enumerate(_cases(EP_CASES, engine, 2)):
        xs, ids, wts, w13, w2 = _ep_inputs(H, I, E, k, T, routing, world, 500 + i)
        op = ExpertParallelMoE(H, I, E, k, max_num_tokens=T + 3, kernel_config=EpKernelConfig(transport=transport),
                               ordered=ordered, chunk_bytes=1000, engine=engine)   # (the proxy: chunks not of whole rows)
        mine = slice(op.first_expert, op.first_expert + op.experts_per_rank)
        x, tid, tw = xs[rank].to(dev), ids[rank].to(dev), wts[rank].to(dev)
        lw13, lw2 = w13[mine].contiguous().to(dev), w2[mine].contiguous().to(dev)
        what = f"(H, I, E, k, T) = {(H, I, E, k, T)} {routing}"
        out = torch.full((T, H), math.nan, dtype=torch.bfloat16, device=dev)
        torch.cuda.synchronize()
        dist.barrier()
        _sync(op, lambda: op(x, tw, tid, lw13, lw2, out=out))
        first = out.clone()
        for _ in range(3):
            op(x, tw, tid, lw13, lw2, out=out)
        torch.cuda.synchronize()
        assert not first.isnan().any(), f"{what}: unwritten or NaN output on rank {rank}"
        ref = _ep_reference(xs[rank], ids[rank], wts[rank], w13, w2)
        err = ((first.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{what}: relative error {err:.2e} on rank {rank}"
        assert torch.equal(first, out), f"{what}: calls differ: a race"
        assert op.errors() == 0
        if i == 1:
            # Layers back to back, each read in stream order: no rank writes into a window still being read.
            layers = [_ep_inputs(H, I, E, k, T, "uniform", world, 600 + j) for j in range(3)]
            outs = [op(a[rank].to(dev), c[rank].to(dev), b[rank].to(dev), lw13, lw2).clone()
                    for a, b, c, _, _ in layers]
            for j, ((a, b, c, _, _), o) in enumerate(zip(layers, outs)):
                r = _ep_reference(a[rank], b[rank], c[rank], w13, w2)
                e = ((o.double().cpu() - r).norm() / r.norm()).item()
                assert e < 1e-2, f"layer {j} of 3 back to back: relative error {e:.2e}"
            # NaN in, NaN out: a repeated id and one out of range poison their tokens only.
            bad = tid.clone()
            bad[3, 1] = bad[3, 0]
            bad[7, 0] = E
            got = op(x, tw, bad, lw13, lw2)
            torch.cuda.synchronize()
            nan_rows = got.isnan().any(dim=1).nonzero().flatten().tolist()
            assert nan_rows == [3, 7], f"NaN rows {nan_rows}"
            assert op.errors() != 0 and op.errors() == 0
            # Bad input: a clear error naming the argument, nothing launched, the operator usable afterwards.
            with pytest.raises(ValueError, match="topk_ids"):
                op(x, tw, tid[:, :1], lw13, lw2)
            with pytest.raises(ValueError, match="w13"):
                op(x, tw, tid, w13.to(dev), lw2)
            with pytest.raises(ValueError, match="max_num_tokens"):
                op(torch.zeros(T + 4, H, dtype=torch.bfloat16, device=dev), tw, tid, lw13, lw2)
            with pytest.raises(ValueError, match="same number of tokens"):
                n = T - 1 - rank
                op(x[:n], tw[:n], tid[:n], lw13, lw2)
            assert torch.equal(op(x, tw, tid, lw13, lw2), first)
            # A captured call, replayed on new inputs.
            xg, idg, wg = x.clone(), tid.clone(), tw.clone()
            og = torch.empty_like(out)
            graph, _ = capture(lambda: op(xg, wg, idg, lw13, lw2, out=og), device=dev)
            xs2, ids2, wts2, _, _ = _ep_inputs(H, I, E, k, T, "hot", world, 999)
            xg.copy_(xs2[rank])
            idg.copy_(ids2[rank])
            wg.copy_(wts2[rank])
            og.fill_(math.nan)
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            r2 = _ep_reference(xs2[rank], ids2[rank], wts2[rank], w13, w2)
            e = ((og.double().cpu() - r2).norm() / r2.norm()).item()
            assert e < 1e-2, f"graph replay: relative error {e:.2e}"
        torch.cuda.synchronize()
        dist.barrier()
        op.close()


@pytest.mark.parametrize("transport, ordered", [("peer", True), ("proxy", True), ("proxy", False)])
@pytest.mark.parametrize("share_gpu", GPUS)
def test_expert_parallel_moe_on_two_ranks_matches_float64(transport, ordered, share_gpu):
    """Each rank's tokens through experts split over both GPUs, against float64: through NVLink peer memory,
    and through the proxy transport as if the GPUs were two nodes, its chunks (1000 bytes: not whole rows)
    landing in issue order or shuffled."""
    from meld.distributed import spawn

    spawn(_ep_rank, 2, transport, ordered, share_gpu=share_gpu)


def _nvshmem_missing() -> str:
    """Why the NVSHMEM engine cannot run here ("" where its host library loads)."""
    from meld.distributed import nvshmem

    try:
        nvshmem.library()
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("operator, transport, ordered", [
    ("seq", "proxy", False), ("tp", "peer", True), ("tp", "proxy", False), ("ep", "peer", True),
    ("ep", "proxy", False)])
@pytest.mark.parametrize("share_gpu", GPUS)
def test_the_operators_on_the_nvshmem_engine_match_float64(operator, transport, ordered, share_gpu):
    """The same checks as above with the windows on NVSHMEM's symmetric heap and the proxy's puts and signals
    landed by NVSHMEM's stream operations (engine="nvshmem": what runs across nodes): the peer transport over
    NVSHMEM's peer pointers, the proxy's shuffled delivery (the harder order) over its puts and signals."""
    from meld.distributed import spawn

    missing = _nvshmem_missing()
    if missing:
        pytest.skip(missing)
    if share_gpu and operator == "tp" and transport == "proxy":
        pytest.skip("the row-parallel linear's proxy transport needs two GPUs (as above)")
    if operator == "seq":
        spawn(_seq_parallel_rank, 2, 1, transport, ordered, "nvshmem", share_gpu=share_gpu)
    elif operator == "tp":
        merge = "owner" if transport == "peer" else "every_rank"
        spawn(_tp_rank, 2, merge, transport, ordered, "bfloat16", "nvshmem", share_gpu=share_gpu)
    else:
        spawn(_ep_rank, 2, transport, ordered, "nvshmem", share_gpu=share_gpu)
