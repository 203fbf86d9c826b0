"""Multi-GPU operators (meld.distributed) against their unfused torch + NCCL baselines, on the GPUs of one node.

(a) Sequence-parallel decode attention (`SeqParallelDecode`): the KV of long requests sharded across the
GPUs, partials merged by the last arriving piece through NVLink peer memory, every rank's output complete
when its launch ends. Baselines in the same run, on the same shard: meld's single-GPU kernel on each GPU's
parts + one `all_gather_into_tensor` of (out, lse) + a torch merge ("unfused"); and meld on one GPU with the
whole batch ("1 GPU"); and the single-GPU kernel on each GPU's parts alone, no exchange ("parts only",
the floor). Times: CUDA-graph replays per rank (bench/harness.py's timer, L2 flushed), the
slowest rank's median. Correctness: every rank's first output (poisoned before) against float64.

(b) Expert-parallel MoE (`ExpertParallelMoE`, `--op ep`): qwen3-30b-a3b's experts split over the GPUs, each
with its own T tokens; rows to their experts' GPUs, each GPU's MoE kernels over what it received, rows back,
combined in choice order; through NVLink peer memory, and through the proxy transport (ordered, 64 KiB
chunks). Baselines in the same run, each NCCL
`all_to_all_single` + a grouped GEMM + `all_to_all_single` back + a weighted sum: with exact splits (read on
the host, so eager), and padded to T k rows per pair of ranks (no host synchronisation: CUDA graphs), its
grouped GEMM torch's or meld.MoE's (what the fusion alone buys). Correctness:
every pipeline against float64.

(c) The row-parallel linear with its all-reduce fused per tile (`RowParallelLinear`, `--op tp`): each
rank's x_r [M, K/world] @ W_r.T, every partial tile sent to every rank through NVLink peer memory as
soon as it is computed and each rank's output summed from them (`--merge owner`: summed at the tile's
owner and written to every rank). Baseline in the same run: `torch.matmul` +
NCCL `all_reduce` ("unfused"), and the matmul alone (its share gives the communication's).

`--engine nvshmem` puts every meld operator's windows on NVSHMEM's symmetric heap and lands the proxy
transport's puts and signals with NVSHMEM's stream operations (`meld.distributed.nvshmem`): its speed beside
the default engine's peer copies.

    python3 bench/dist.py [--world 2] [--cases 1m skewed8 skewed64 one-long64] [--json F] [--engine nvshmem]
    python3 bench/dist.py --op ep [--tokens 1 16 128 1024 4096]
    python3 bench/dist.py --op tp [--tokens 1 16 128 200 1024 4096] [--shapes llama70b-o ...]
                                  [--merge owner every_rank] [--partials bfloat16 float32] [--max-block 0 128]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HQ, HKV, D, P = 32, 8, 128, 16
CASES = {"1m": [1 << 20], "skewed8": "skewed:8", "skewed64": "skewed:64", "one-long64": "one-long:64"}


def case_lengths(name: str) -> list[int]:
    from meld.workloads import lengths

    spec = CASES[name]
    if isinstance(spec, list):
        return spec
    dist_name, b = spec.split(":")
    return lengths(dist_name, int(b))


class Unfused:
    """meld's single-GPU kernel on this rank's parts, one all_gather of (out, lse), a torch merge."""

    def __init__(self, shard, rank: int, world: int, pb, dev):
        import meld

        self.world, self.B = world, len(shard.kv_len)
        idx, ip, ind, last = shard.local_tables(rank, pb.kv_indptr.numpy(), pb.kv_indices.numpy(), P)
        n_max = max(len(shard.on(r)) for r in range(world))
        self.attn = meld.DecodeAttention(HQ, HKV, D, P, torch.bfloat16, dev)
        self.attn.plan(torch.from_numpy(ip), torch.from_numpy(ind), torch.from_numpy(last))
        self.n = len(idx)
        self.q_idx = torch.from_numpy(shard.req[idx]).to(dev)
        o_bytes, l_bytes = n_max * HQ * D * 2, n_max * HQ * 4
        self.buf = torch.zeros(o_bytes + l_bytes, dtype=torch.uint8, device=dev)
        self.out = self.buf[:o_bytes].view(torch.bfloat16).view(n_max, HQ, D)
        self.lse = self.buf[o_bytes:].view(torch.float32).view(n_max, HQ)
        self.lse.fill_(-math.inf)
        self.gathered = torch.empty(world, o_bytes + l_bytes, dtype=torch.uint8, device=dev)
        self.o_all = self.gathered[:, :o_bytes].view(torch.bfloat16).view(world, n_max, HQ, D)
        self.l_all = self.gathered[:, o_bytes:].view(torch.float32).view(world, n_max, HQ)
        # Each request's parts as rows of the gathered batch ([B, world]; missing parts read a padding row).
        ranks, rows = torch.zeros(self.B, world, dtype=torch.int64), torch.zeros(self.B, world, dtype=torch.int64)
        valid = torch.zeros(self.B, world, dtype=torch.bool)
        for r in range(world):
            for k, i in enumerate(shard.on(r)):
                ranks[shard.req[i], shard.part[i]], rows[shard.req[i], shard.part[i]] = r, k
                valid[shard.req[i], shard.part[i]] = True
        self.ranks, self.rows, self.valid = ranks.to(dev), rows.to(dev), valid.to(dev)[:, :, None]

    def run(self, q, kv):
        import torch.distributed as dist

        if self.n:
            self.attn.run(q.index_select(0, self.q_idx), kv, out=self.out[:self.n], lse=self.lse[:self.n])
        dist.all_gather_into_tensor(self.gathered, self.buf)
        lse = torch.where(self.valid, self.l_all[self.ranks, self.rows], -math.inf)          # [B, world, Hq]
        m = lse.amax(1, keepdim=True)
        w = torch.exp(lse - torch.where(torch.isfinite(m), m, 0))
        s = w.sum(1)
        out = (w[..., None] * self.o_all[self.ranks, self.rows].float()).sum(1) / s[..., None].clamp_min(1e-30)
        return out.to(torch.bfloat16), (m[:, 0] + torch.log(s))


def _bench_rank(rank: int, world: int, names: list[str], reps: int, out_json: str | None, with_proxy: bool,
                engine: str = "cuda") -> None:
    import torch.distributed as dist

    import meld
    from bench.harness import graph_time_us
    from meld.distributed import SeqParallelDecode
    from meld.runtime.reference import attention_reference
    from meld.workloads import paged

    dev = torch.device("cuda", rank)
    rows = []
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for _ in range(200):   # clocks up before the first case is timed
        a @ a
    torch.cuda.synchronize()

    def slowest(t: float | None) -> float:
        v = torch.tensor([t if t is not None else 0.0], device=dev)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()

    for name in names:
        lens = case_lengths(name)
        g = torch.Generator().manual_seed(1234)
        pb = paged(lens, P, generator=g)
        kv = torch.randn(pb.num_pages, 2, P, HKV, D, generator=g).to(torch.bfloat16).to(dev)
        q = torch.randn(len(lens), HQ, D, generator=g).to(torch.bfloat16).to(dev)
        op = SeqParallelDecode(HQ, HKV, D, P, torch.bfloat16, max_batch_size=len(lens), max_num_pages=pb.num_pages,
                               engine=engine)
        op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        base = Unfused(op.shard, rank, world, pb, dev)
        out, lse = op.outputs(len(lens))
        out.fill_(math.nan)
        torch.cuda.synchronize()
        dist.barrier()
        op.run(q, kv)
        b_out, _ = base.run(q, kv)
        outs = (out.clone(), b_out.clone())   # checked after the timing (the float64 reference is heavy)
        dist.barrier()
        t_meld = slowest(graph_time_us(lambda: op.run(q, kv), reps=reps).median_us)
        dist.barrier()
        t_unfused = slowest(graph_time_us(lambda: base.run(q, kv), reps=reps).median_us)
        dist.barrier()
        q_local = q.index_select(0, base.q_idx)
        t_local = slowest(graph_time_us(lambda: base.attn.run(q_local, kv, out=base.out[:base.n], lse=base.lse[:base.n]),
                                        reps=reps).median_us if base.n else None)
        dist.barrier()
        t_one = None
        if rank == 0:   # meld on one GPU, the whole batch
            one = meld.DecodeAttention(HQ, HKV, D, P, torch.bfloat16, dev)
            one.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
            t_one = graph_time_us(lambda: one.run(q, kv), reps=reps).median_us
        t_one = slowest(t_one)
        proxy = {}
        for ordered in ((True, False) if with_proxy else ()):   # the RDMA model: puts through a host proxy thread
            px = SeqParallelDecode(HQ, HKV, D, P, torch.bfloat16, max_batch_size=len(lens), max_num_pages=pb.num_pages,
                                   transport="proxy", ordered=ordered, engine=engine)
            px.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
            p_out, _ = px.outputs(len(lens))
            p_out.fill_(math.nan)
            torch.cuda.synchronize()
            dist.barrier()
            px.run(q, kv)
            torch.cuda.synchronize()
            outs = outs + (p_out.clone(),)
            ops0 = px.proxy.landed_ops
            t = graph_time_us(lambda: px.run(q, kv), reps=reps)
            launches = 1 + 5 + 5 + t.n   # the check, graph_time_us: eager warm-ups, warm replays, timed replays
            proxy["ordered" if ordered else "unordered"] = (slowest(t.median_us), (px.proxy.landed_ops - ops0) / launches)
            px.close()
            dist.barrier()
        ref, _ = attention_reference(q, kv, pb.kv_indptr.to(dev), pb.kv_indices.to(dev), pb.kv_last_page_len.to(dev))
        errs = [((o.double() - ref).norm() / ref.norm()).item() for o in outs]
        del ref
        if any(math.isnan(e) for e in errs) or max(errs) > 1e-2:
            raise AssertionError(f"{name} rank {rank}: relative errors (meld, unfused, proxy ordered, unordered) {errs}")
        split = int((op.shard.num_parts > 1).sum())
        rows.append(dict(case=name, B=len(lens), tokens=int(sum(lens)), split=split, err=max(errs), meld_us=t_meld,
                         unfused_us=t_unfused, local_us=t_local, one_gpu_us=t_one, proxy=proxy, vs_unfused=t_unfused / t_meld, vs_one_gpu=t_one / t_meld))
        dist.barrier()
    if rank == 0:
        print(f"seq-parallel decode attention, {world} GPUs, bf16 Hq={HQ} Hkv={HKV} D={D} page {P}; "
              "median µs of graph replays, slowest rank")
        print("case | B | tokens | split reqs | max rel err | meld | unfused | parts only | meld 1 GPU | unfused/meld | "
              "1GPU/meld")
        for r in rows:
            print(f"{r['case']} | {r['B']} | {r['tokens']} | {r['split']} | {r['err']:.1e} | {r['meld_us']:.1f} | "
                  f"{r['unfused_us']:.1f} | {r['local_us']:.1f} | {r['one_gpu_us']:.1f} | {r['vs_unfused']:.2f} | "
                  f"{r['vs_one_gpu']:.2f}")
        print("parts only: meld's single-GPU kernel on each GPU's parts, nothing exchanged (the floor for meld)")
        if with_proxy:
            landing = "NVSHMEM stream puts" if engine == "nvshmem" else "peer copies"
            print(f"\nthe proxy transport (puts and signals through the C++ host proxy thread, {landing}): µs per launch, "
                  "operations the proxy landed per launch on rank 0 (chunks of 64 KiB)")
            print("case | ordered µs | unordered µs | proxy ops per launch | ordered µs per op")
            for r in rows:
                (to, n), (tu, _) = r["proxy"]["ordered"], r["proxy"]["unordered"]
                print(f"{r['case']} | {to:.1f} | {tu:.1f} | {n:.0f} | {to / max(n, 1):.1f}")
        if out_json:
            Path(out_json).write_text(json.dumps(rows, indent=1))


# (K over all ranks, N). Llama-8B's N = 4096 leaves few output tiles at prefill sizes: K is split in pieces
# and tiles have four partials at two ranks (a path the 70B shapes never take).
TP_SHAPES = {"llama70b-o": (8192, 8192), "llama70b-down": (28672, 8192), "llama8b-o": (4096, 4096),
             "llama8b-down": (14336, 4096)}


def peer_copy_gbs(dev: torch.device, nbytes: int = 256 << 20, reps: int = 10) -> float:
    """This rank's copy into the next rank's symmetric memory, every rank at once (the copy engines over
    NVLink, both directions loaded as meld's exchange loads them): GB/s per rank, the slowest rank's."""
    import torch.distributed as dist

    from meld.distributed.seq_parallel import SymmetricWindow

    win = SymmetricWindow(nbytes, dev, dist.group.WORLD)
    peer = win.handle.get_buffer((win.rank + 1) % win.world, (nbytes,), torch.uint8, 0)
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        dist.barrier()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        peer.copy_(src)
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3)
    v = torch.tensor([sorted(times[1:])[reps // 2]], device=dev)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    torch.cuda.synchronize()
    dist.barrier()
    return nbytes / v.item() / 1e3


def _warm_rank(dev: torch.device):
    """Runs matmuls until the clocks are up (before the first case is timed); returns `slowest`: a time's
    maximum over the ranks."""
    import torch.distributed as dist

    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    torch.cuda.synchronize()

    def slowest(t: float) -> float:
        v = torch.tensor([t], device=dev)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()
    return slowest


def tp_weights(shape: str, rank: int, world: int, dev: torch.device, slices: int | None = None):
    """A TP_SHAPES weight [N, K over all ranks] drawn the same on every rank (the reference is local), this
    rank's K slice of it (K cut into `slices`, default `world`), and the generator to draw the inputs with:
    (k per rank, n, w_all, w, g)."""
    k_all, n = TP_SHAPES[shape]
    k = k_all // (slices or world)
    g = torch.Generator(device=dev).manual_seed(7)
    w_all = (torch.randn(n, k_all, generator=g, device=dev) / math.sqrt(k_all)).to(torch.bfloat16)
    return k, n, w_all, w_all[:, rank * k:(rank + 1) * k].contiguous(), g


def _tp_rank(rank: int, world: int, tokens: list[int], reps: int, out_json: str | None, merges: list[str],
             partials: list[str], shapes: list[str], max_blocks: list[int], engine: str = "cuda") -> None:
    import torch.distributed as dist

    from bench.harness import graph_time_us
    from meld.codegen.tp_kernel import TpKernelConfig
    from meld.distributed import RowParallelLinear

    dev = torch.device("cuda", rank)
    slowest = _warm_rank(dev)

    ceiling = peer_copy_gbs(dev)
    rows = []
    alone = [dist.new_group([r]) for r in range(world)]   # meld on a group of one rank: its GEMM, no exchange
    for shape in shapes:
        k, n, w_all, w, g = tp_weights(shape, rank, world, dev)
        ops = {(mg, pt, mb): RowParallelLinear(k, n, max_tokens=max(tokens), kernel_config=TpKernelConfig(
                   merge=mg, partials=pt, max_block_tokens=mb), engine=engine)
               for mg in merges for pt in partials for mb in max_blocks}
        solo = RowParallelLinear(k, n, max_tokens=max(tokens), group=alone[rank])
        for m in tokens:
            x_all = torch.randn(m, w_all.shape[1], generator=g, device=dev).to(torch.bfloat16)
            x = x_all[:, rank * k:(rank + 1) * k].contiguous()
            got = {}
            for mg, op in ops.items():
                op.output(m).fill_(math.nan)
                torch.cuda.synchronize()
                dist.barrier()
                got[mg] = op(x, w).clone()
            base = torch.empty(m, n, dtype=torch.bfloat16, device=dev)

            def unfused():
                torch.matmul(x, w.T, out=base)
                dist.all_reduce(base)

            unfused()
            torch.cuda.synchronize()
            ref = x_all.double() @ w_all.double().T
            errs = [((o.double() - ref).norm() / ref.norm()).item() for o in (*got.values(), base)]
            del ref
            if any(math.isnan(e) for e in errs) or max(errs) > 1e-2:
                raise AssertionError(f"{shape} M={m} rank {rank}: relative errors ({', '.join(map(str, ops))}, unfused) {errs}")
            t_meld = {}
            for mg, op in ops.items():
                dist.barrier()
                t_meld[mg] = slowest(graph_time_us(lambda op=op: op(x, w), reps=reps).median_us)
            dist.barrier()
            t_unf = slowest(graph_time_us(unfused, reps=reps).median_us)
            dist.barrier()
            t_mm = slowest(graph_time_us(lambda: torch.matmul(x, w.T, out=base), reps=reps).median_us)
            t_solo = slowest(graph_time_us(lambda: solo(x, w), reps=reps).median_us)
            # bytes of the M rows each rank sends over NVLink: owner merges, its partials of the tiles other ranks
            # own and the bf16 tiles it merged for them ((world - 1) / world of the output each); every-rank
            # merges, its partials of every tile to each other rank
            for mg, pt, mb in ops:
                ps = 2 if pt == "bfloat16" else 4
                sent = m * n * (ps + 2) * (world - 1) / world if mg == "owner" else m * n * ps * (world - 1)
                t = t_meld[(mg, pt, mb)]
                rows.append(dict(shape=shape, M=m, K=k, N=n, merge=mg, partials=pt, max_block=mb,
                                 block=ops[(mg, pt, mb)]._calls[m][0].block_tokens, err=max(errs), meld_us=t,
                                 unfused_us=t_unf, matmul_us=t_mm, solo_us=t_solo, comm_share=1 - t_mm / t_unf,
                                 vs_unfused=t_unf / t, nvlink_gbs=sent / t / 1e3))
            dist.barrier()
    if rank == 0:
        print(f"row-parallel linear + all-reduce, {world} GPUs, bf16; median µs of graph replays, slowest rank; "
              f"peer-copy ceiling {ceiling:.0f} GB/s per rank (256 MiB copies into the next rank, all ranks at once)")
        print("shape | M | K per rank | N | merge | partials | token block (cap) | max rel err | meld | meld 1 rank | matmul | "
              "matmul + all_reduce | comm share | unfused/meld | meld NVLink GB/s per rank | of ceiling")
        for r in rows:
            print(f"{r['shape']} | {r['M']} | {r['K']} | {r['N']} | {r['merge']} | {r['partials']} | "
                  f"{r['block']} ({r['max_block'] or 256}) | {r['err']:.1e} | "
                  f"{r['meld_us']:.1f} | "
                  f"{r['solo_us']:.1f} | "
                  f"{r['matmul_us']:.1f} | {r['unfused_us']:.1f} | {r['comm_share']:.0%} | {r['vs_unfused']:.2f} | "
                  f"{r['nvlink_gbs']:.0f} | {r['nvlink_gbs'] / ceiling:.0%}")
        print("meld 1 rank: the same kernel on a group of one rank (this rank's GEMM, nothing exchanged); comm share: "
              "1 - matmul / (matmul + all_reduce)")
        if out_json:
            Path(out_json).write_text(json.dumps(dict(peer_copy_gbs=ceiling, rows=rows), indent=1))


def _to_ranks(ids, experts_per_rank: int):
    """The pairs sorted by their expert's rank (stable): the order, each pair's rank and local expert id."""
    flat = ids.flatten().long()
    dest = flat // experts_per_rank
    order = torch.argsort(dest, stable=True)
    return order, dest[order], flat[order] % experts_per_rank


def _combine(back, order, wts, T: int, k: int):
    """out[t] = sum of its pairs' expert rows times their weights (float32, then bf16)."""
    contrib = back.float() * wts.flatten()[order, None]
    return torch.zeros(T, back.shape[1], dtype=torch.float32, device=back.device).index_add_(
        0, order // k, contrib).to(back.dtype)


def unfused_ep_moe(x, ids, wts, w13, w2, experts_per_rank: int):
    """The unfused expert-parallel MoE with exact splits: counts exchanged and read on the host (NCCL's
    all_to_all_single takes the splits as ints, so this path cannot be captured), rows to their ranks by
    all_to_all, this rank's experts by torch's grouped GEMM, rows back by all_to_all, weighted sum."""
    import torch.distributed as dist

    from meld.serving.torch_moe import torch_grouped_mm_moe

    T, k = ids.shape
    order, dest, eid = _to_ranks(ids, experts_per_rank)
    send = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=x.device).scatter_add_(
        0, dest, torch.ones_like(dest))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    sc, rc = send.tolist(), recv.tolist()
    rows = torch.empty(sum(rc), x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(rows, x[order // k], rc, sc)
    reid = torch.empty(sum(rc), dtype=torch.int64, device=x.device)
    dist.all_to_all_single(reid, eid, rc, sc)
    ones = torch.ones(len(reid), 1, dtype=torch.float32, device=x.device)
    y = torch_grouped_mm_moe(rows, w13, w2, None, 1, routing=(ones, reid[:, None]))
    back = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(back, y, sc, rc)
    return _combine(back, order, wts, T, k)


def padded_ep_moe(x, ids, wts, w13, w2, experts_per_rank: int, group_moe=None):
    """The unfused expert-parallel MoE without a host synchronisation (CUDA-graph capturable): every rank
    sends every other a block of T k rows (as many as could go there), filled from the start; all_to_all
    with equal splits; this rank's experts over the received rows by torch's grouped GEMM (padding sorted
    last, outside every group), or by `group_moe` (a meld.MoE that skips absent pairs); all_to_all back;
    each pair's row read from its block; weighted sum."""
    import torch.distributed as dist

    from meld.serving.torch_moe import grouped_mm

    T, k = ids.shape
    world, H, El, C = dist.get_world_size(), x.shape[1], experts_per_rank, T * k
    order, dest, eid = _to_ranks(ids, El)
    counts = torch.zeros(world, dtype=torch.int64, device=x.device).scatter_add_(0, dest, torch.ones_like(dest))
    slot = dest * C + torch.arange(C, device=x.device) - (counts.cumsum(0) - counts)[dest]
    send = torch.zeros(world * C, H, dtype=x.dtype, device=x.device)
    send[slot] = x[order // k]
    send_eid = torch.full((world * C,), -1, dtype=torch.int64, device=x.device)
    send_eid[slot] = eid
    rows, reid = torch.empty_like(send), torch.empty_like(send_eid)
    dist.all_to_all_single(rows, send)
    dist.all_to_all_single(reid, send_eid)
    if group_moe is None:
        key = torch.where(reid < 0, El, reid)
        o2 = torch.argsort(key, stable=True)
        offs = torch.zeros(El + 1, dtype=torch.int32, device=x.device).scatter_add_(
            0, key, torch.ones_like(key, dtype=torch.int32))[:El].cumsum(0, dtype=torch.int32)
        inter = w2.shape[-1]
        gu = grouped_mm(rows[o2], w13.transpose(1, 2), offs)
        ys = grouped_mm(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], w2.transpose(1, 2), offs)
        y = torch.empty_like(rows)
        y[o2] = ys
    else:
        ones = torch.ones(len(reid), 1, dtype=torch.float32, device=x.device)
        y = group_moe(rows, None, w13, w2, topk_weights=ones, topk_ids=reid[:, None])
    back = torch.empty_like(y)
    dist.all_to_all_single(back, y)
    return _combine(back[slot], order, wts, T, k)


def _ep_rank(rank: int, world: int, tokens: list[int], reps: int, out_json: str | None, engine: str = "cuda") -> None:
    import torch.distributed as dist

    import meld
    from bench.harness import eager_time_us, graph_time_us
    from bench.moe import SHAPES, make_weights, reference_moe, router_logits
    from meld.codegen.ep_kernel import EpKernelConfig
    from meld.codegen.moe_kernel import MoeKernelConfig
    from meld.distributed import ExpertParallelMoE
    from meld.serving.torch_moe import topk_route

    dev = torch.device("cuda", rank)
    slowest = _warm_rank(dev)

    rows = []
    shape = SHAPES["qwen3-30b-a3b"]
    E, k = shape.experts, shape.top_k
    El = E // world
    w13, w2 = make_weights(shape, 0, dev)   # every expert on every rank: the reference is local
    mine = slice(rank * El, (rank + 1) * El)
    lw13, lw2 = w13[mine].contiguous(), w2[mine].contiguous()
    op = ExpertParallelMoE(shape.hidden, shape.inter, E, k, max_num_tokens=max(tokens), engine=engine)
    proxy_op = ExpertParallelMoE(shape.hidden, shape.inter, E, k, max_num_tokens=max(tokens),
                                 kernel_config=EpKernelConfig(transport="proxy"), engine=engine)
    group_moe = meld.MoE(shape.hidden, shape.inter, El, 1, max_num_tokens=world * max(tokens) * k, device=dev,
                         renormalize=False, kernel_config=MoeKernelConfig(absent_pairs=True))
    for T in tokens:
        logits = router_logits(shape, T, "uniform", seed=1 + rank).to(dev)   # each rank its own tokens
        wts, ids = topk_route(logits, k, True)
        ids = ids.to(torch.int32)
        x = torch.randn(T, shape.hidden, generator=torch.Generator(device=dev).manual_seed(11 + rank), device=dev,
                        dtype=torch.bfloat16)
        out = torch.full((T, shape.hidden), math.nan, dtype=torch.bfloat16, device=dev)
        torch.cuda.synchronize()
        dist.barrier()
        op(x, wts, ids, lw13, lw2, out=out)
        outs = {"exact": lambda: unfused_ep_moe(x, ids, wts, lw13, lw2, El),
                "padded": lambda: padded_ep_moe(x, ids, wts, lw13, lw2, El),
                "padded meld.MoE": lambda: padded_ep_moe(x, ids, wts, lw13, lw2, El, group_moe)}
        got = {name: f() for name, f in outs.items()}
        got["meld proxy"] = proxy_op(x, wts, ids, lw13, lw2)
        torch.cuda.synchronize()
        ref = reference_moe(x, w13, w2, logits, k, True)
        errs = [((o.double() - ref).norm() / ref.norm()).item() for o in (out, *got.values())]
        del ref
        if any(math.isnan(e) for e in errs) or max(errs) > 1e-2:
            raise AssertionError(f"T={T} rank {rank}: relative errors (meld, {', '.join(got)}) {errs}")
        dist.barrier()
        t_meld = slowest(graph_time_us(lambda: op(x, wts, ids, lw13, lw2, out=out), reps=reps).median_us)
        dist.barrier()
        t_meld_eager = slowest(eager_time_us(lambda: op(x, wts, ids, lw13, lw2, out=out), reps=reps).median_us)
        dist.barrier()
        t_proxy = slowest(graph_time_us(lambda: proxy_op(x, wts, ids, lw13, lw2, out=out), reps=reps).median_us)
        t = {}
        for name, f in outs.items():
            dist.barrier()
            timer = eager_time_us if name == "exact" else graph_time_us
            t[name] = slowest(timer(f, reps=reps).median_us)
        # bytes this rank sends over NVLink: its rows to the other rank's experts, and their outputs back
        crossing = int(((ids.long() // El) != rank).sum())
        sent = 2 * crossing * shape.hidden * 2
        rows.append(dict(shape=shape.name, T=T, err=max(errs), meld_us=t_meld, meld_eager_us=t_meld_eager,
                         meld_proxy_us=t_proxy,
                         exact_eager_us=t["exact"], padded_us=t["padded"], padded_meld_moe_us=t["padded meld.MoE"],
                         nvlink_gbs=sent / t_meld / 1e3))
        dist.barrier()
    if rank == 0:
        print(f"expert-parallel MoE, {shape.name} (E={E}, top {k}, {El} experts per GPU), {world} GPUs, bf16, uniform "
              "routing; T tokens per GPU; median µs, slowest rank; CUDA-graph replays except where eager")
        print("T | max rel err | meld | meld eager | meld proxy | exact a2a + grouped_mm + a2a (eager) | padded a2a + grouped_mm + a2a | "
              "padded a2a + meld.MoE + a2a | exact/meld | padded/meld | padded meld.MoE/meld | meld NVLink GB/s per rank")
        for r in rows:
            print(f"{r['T']} | {r['err']:.1e} | {r['meld_us']:.1f} | {r['meld_eager_us']:.1f} | {r['meld_proxy_us']:.1f} | "
                  f"{r['exact_eager_us']:.1f} | "
                  f"{r['padded_us']:.1f} | {r['padded_meld_moe_us']:.1f} | {r['exact_eager_us'] / r['meld_us']:.2f} | "
                  f"{r['padded_us'] / r['meld_us']:.2f} | {r['padded_meld_moe_us'] / r['meld_us']:.2f} | {r['nvlink_gbs']:.0f}")
        if out_json:
            Path(out_json).write_text(json.dumps(dict(rows=rows), indent=1))
    proxy_op.close()


def main() -> None:
    from meld.distributed import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument("--no-proxy", action="store_true", help="skip the proxy transport")
    ap.add_argument("--op", choices=("decode", "tp", "ep"), default="decode")
    ap.add_argument("--tokens", type=int, nargs="+",
                    help="--op tp: rows M (default 1 16 128 200 1024 4096: 200 is not a multiple of a token "
                         "block); --op ep: tokens per GPU (default 1 16 128 1024 4096)")
    ap.add_argument("--shapes", nargs="+", default=list(TP_SHAPES), choices=list(TP_SHAPES),
                    help="--op tp: weight shapes (K over all ranks x N)")
    ap.add_argument("--merge", nargs="+", default=["every_rank"], choices=["owner", "every_rank"],
                    help="--op tp: how tiles merge (TpKernelConfig.merge), each measured")
    ap.add_argument("--partials", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"],
                    help="--op tp: how partials travel (TpKernelConfig.partials), each measured")
    ap.add_argument("--max-block", type=int, nargs="+", default=[0], choices=[0, 8, 16, 32, 64, 128, 256],
                    help="--op tp: the widest token block (TpKernelConfig.max_block_tokens; 0: 256), each measured")
    ap.add_argument("--engine", default="cuda", choices=["cuda", "nvshmem"],
                    help="the meld operators' windows and proxy landing (module docstring)")
    a = ap.parse_args()
    if torch.cuda.device_count() < a.world:
        sys.exit(f"bench/dist.py: needs {a.world} GPUs, found {torch.cuda.device_count()}")
    if a.tokens is None:
        a.tokens = [1, 16, 128, 200, 1024, 4096] if a.op == "tp" else [1, 16, 128, 1024, 4096]
    if a.op == "ep":
        spawn(_ep_rank, a.world, a.tokens, a.reps, a.json, a.engine)
    elif a.op == "tp":
        spawn(_tp_rank, a.world, a.tokens, a.reps, a.json, a.merge, a.partials, a.shapes, a.max_block, a.engine)
    else:
        spawn(_bench_rank, a.world, a.cases, a.reps, a.json, not a.no_proxy, a.engine)


if __name__ == "__main__":
    main()
