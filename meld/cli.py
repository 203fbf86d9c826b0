"""meld's command line.

`meld demo`: the whole pipeline on one skewed decode batch. capture (TVM, if installed) -> task graph ->
plan -> generate + compile the kernel for sm_90a -> run: on a Hopper GPU the kernel, timed; elsewhere the
same schedule on the CPU reference executor. Either way the result is checked against float64 attention;
then the same for a fused MoE layer and for MLA decode attention.

`meld timeline`: summary, per-SM busy table and PNG timeline of a trace written under MELD_PROFILE=1.

`meld tune --workload bench|recorded:FILE`: search decode attention's planner constants on BENCH's B >= 64
batches (or on batches MELD_RECORD recorded), print the before/after table, and record a candidate that
wins beyond the noise in the tuning database (--db, or MELD_TUNING_DB); with `--fit FILE` (a fitted cost
model) the planner constants are searched on a finer grid and only the `--keep` the model predicts fastest
are measured; `--sweep` (with --fit) also sweeps that whole space and compares, recording nothing. `meld tune
--show`: what the database holds and whether each entry applies here.

`meld serve-bench`: a continuous-batching decode loop (meld.serving) on a log-normal request trace, per
attention backend: tokens/s, step latency p50/p99, attention's share of the step, and with --check the
logits against the reference backend. Without a GPU it runs a tiny model on the CPU executor.

Bad arguments (checked before any work) and bad files end in one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from meld.runtime.profile import MARGIN_PX, Trace, render_png

MAX_DEMO_BATCH = 1024              # about 4M skewed tokens: a 15 GB cache, and minutes on the CPU executor
MAX_WIDTH_PX, MAX_ROW_PX = 16384, 32   # a timeline PNG of 132 SMs stays under ~200 MB in memory


def _show_graph(capture, built) -> None:
    """Step 1 of the demo: print the task graph captured from the TVM definition (checked equal to the
    builder's), or the builder's where apache-tvm is not installed."""
    try:
        graph = capture()
        assert graph == built, "TVM capture and the builder disagree"
        print("1. captured from the TVM definition (equal to meld.ops' builder):")
    except ImportError:
        graph = built
        print("1. apache-tvm not installed: task graph from meld.ops' builder:")
    print("   " + str(graph).replace("\n", "\n   "))


def _compiled(kc, device: str) -> str:
    """Compile a kernel config for sm_90a (the run-time compiler on a GPU, nvcc elsewhere) and say what came out."""
    from meld.codegen import compile_nvcc, compile_source

    t0 = time.perf_counter()
    cubin = (compile_source(kc.render(), kc.name).cubin if device != "cpu"
             else compile_nvcc(kc.render(), kc.name, "sm_90a")[0])
    return (f"{kc.name} ({kc.smem_bytes} B shared memory), compiled for sm_90a: {len(cubin)} B cubin "
            f"({time.perf_counter() - t0:.1f} s)")


def demo(batch: int, device: str) -> int:
    import meld
    from meld.ops import decode_attention_graph
    from meld.runtime.reference import attention_reference
    from meld.workloads import lengths, paged

    Hq, Hkv, D, P, dtype = 32, 8, 128, 16, torch.bfloat16
    torch.manual_seed(0)
    print(f"meld {meld.__version__} demo: paged GQA decode attention, Hq={Hq} Hkv={Hkv} D={D} page={P} bf16")
    def captured():
        from meld.frontend import capture, decode_attention_primfunc
        return capture(decode_attention_primfunc(Hq, Hkv, D, P))

    _show_graph(captured, decode_attention_graph(Hq, Hkv, D, P))

    lens = lengths("skewed", batch)
    pb = paged(lens, P, spare_pages=0)
    indptr, indices, last, num_pages = pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, pb.num_pages
    print(f"2. batch: {batch} requests, log-normal lengths {min(lens)}..{max(lens)}, sum {sum(lens)} tokens")

    attn = meld.DecodeAttention(Hq, Hkv, D, P, dtype, device)
    print(f"3. generated {_compiled(attn.kernel_config, device)}")

    attn.plan(indptr, indices, last)                  # first call warms NumPy and the staging buffers
    t0 = time.perf_counter()
    attn.plan(indptr, indices, last)
    plan_us = (time.perf_counter() - t0) * 1e6
    s = attn.schedule
    s.validate()
    it = s.items()
    topo = attn.topology
    busy = len(np.unique(it["cta"]))
    cost = s.cta_cost(s.meta["item_overhead_tokens"])[:max(busy, 1)]
    print(f"4. plan ({plan_us:.0f} us on the host): {len(it['unit'])} items over {busy} CTAs "
          f"({math.ceil(busy / topo.ctas_per_sm)} of {topo.sm_count} SMs, {topo.ctas_per_sm} CTAs/SM); "
          f"{len(np.unique(it['unit'][it['slot'] >= 0]))} of {s.num_units} (request, kv head) units split "
          f"into {int((it['slot'] >= 0).sum())} pieces; predicted balance max/mean {cost.max() / cost.mean():.3f}")

    kv = torch.randn(num_pages, 2, P, Hkv, D, device=device).to(dtype)
    q = torch.randn(batch, Hq, D, device=device).to(dtype)
    out, lse = attn.run(q, kv, return_lse=True)
    ref, ref_lse = attention_reference(q, kv, indptr.to(device), indices.to(device), last.to(device))
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ok = err < 1e-2 and not out.isnan().any()
    where = "GPU kernel" if device != "cpu" else "CPU reference executor (same schedule)"
    print(f"5. ran on the {where}: relative error vs float64 {err:.2e} -> {'OK' if ok else 'FAIL'}")
    if device != "cpu":
        out_buf = torch.empty_like(out)
        for _ in range(3):
            attn.run(q, kv, out=out_buf)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            attn.run(q, kv, out=out_buf)
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) / 20 * 1e3
        gbytes = sum(lens) * Hkv * D * 2 * 2 / 1e9
        print(f"   kernel time {us:.1f} us (eager), KV read {gbytes * 1e3:.0f} MB -> {gbytes / us * 1e3:.2f} TB/s")
    return 0 if ok and demo_moe(device) == 0 and demo_mla(device) == 0 else 1


def demo_moe(device: str) -> int:
    """The second operator through the same pipeline: a small MoE layer with a skewed routing."""
    import meld
    from meld.codegen import compile_nvcc
    from meld.codegen.moe_kernel import block_tokens_for
    from meld.ops import moe_graph
    from meld.runtime.moe_reference import route

    T, H, I, E, k = 200, 512, 256, 16, 4
    print(f"\nfused MoE: T={T} H={H} I={I} E={E} top_k={k} bf16, half the tokens' first choice on one expert")
    def captured():
        from meld.frontend.capture_moe import capture_moe
        from meld.frontend.moe import moe_primfunc
        return capture_moe(moe_primfunc(H, I, E, k))

    _show_graph(captured, moe_graph(H, I, E, k))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    logits[: T // 2, 3] += 20.0
    moe = meld.MoE(H, I, E, k, device=device, max_num_tokens=T)
    bt = block_tokens_for(T, k, E)
    cfg = dataclasses.replace(moe.lowering.kernel_config(), block_tokens=bt)
    t0 = time.perf_counter()
    cubin, _ = compile_nvcc(cfg.render(), cfg.name, "sm_90a")
    print(f"2. lowered to the {moe.lowering.family} family (merge: {moe.lowering.combiner}); generated {cfg.name} "
          f"({cfg.smem_bytes} B shared memory), compiled for sm_90a: {len(cubin)} B cubin "
          f"({time.perf_counter() - t0:.1f} s)")
    ids, w = route(logits, k, True)
    plan = moe.plan_for(ids.numpy(), T)
    counts = np.diff(plan.expert_off)
    print(f"3. plan from the routing (on the GPU it is made on the GPU): {int((counts > 0).sum())} of {E} experts "
          f"touched, the hottest has {counts.max()} rows; {len(plan.row_blocks)} row blocks of up to {bt} rows, "
          f"{plan.num_tiles} tiles in ticket order")
    dev = torch.device(device)
    out = moe(*(t.to(dev) for t in (x, logits, w13, w2)))
    xd, w13d, w2d, wd = (t.double() for t in (x, w13, w2, w))
    ref = torch.zeros(T, H, dtype=torch.float64)
    for j in range(k):
        e = ids[:, j]
        gate = torch.einsum("th,tih->ti", xd, w13d[e, :I])
        up = torch.einsum("th,tih->ti", xd, w13d[e, I:])
        ref += wd[:, j, None] * torch.einsum("ti,thi->th", gate * torch.sigmoid(gate) * up, w2d[e])
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    ok = err < 1e-2 and not out.isnan().any()
    where = "GPU kernel" if device != "cpu" else "CPU reference executor (same plan)"
    print(f"4. ran on the {where}: relative error vs float64 {err:.2e} -> {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


def demo_mla(device: str) -> int:
    """A third operator through the same pipeline: MLA decode attention (DeepSeek's absorbed form) on a
    skewed batch, planned by the same planner."""
    import meld
    from meld.ops import mla_decode_graph
    from meld.runtime.reference import mla_reference
    from meld.workloads import lengths, paged

    H, P, scale = 128, 64, 192 ** -0.5
    lens = lengths("skewed", 8)
    print(f"\nMLA decode attention: {H} heads, latent 512 + rope 64, page={P} bf16, {len(lens)} requests of "
          f"{min(lens)}..{max(lens)} tokens")

    def captured():
        from meld.frontend import capture_mla, mla_decode_primfunc
        return capture_mla(mla_decode_primfunc(H, page_size=P))

    _show_graph(captured, mla_decode_graph(H, 512, 64, P))
    mla = meld.DecodeMLA(H, P, torch.bfloat16, device, sm_scale=scale)
    print(f"2. lowered to the {mla.lowering.family} family; generated {_compiled(mla.kernel_config, device)}")
    pb = paged(lens, P, spare_pages=0)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    it = mla.schedule.items()
    print(f"3. plan: {len(it['unit'])} items over {len(np.unique(it['cta']))} CTAs; "
          f"{len(np.unique(it['unit'][it['slot'] >= 0]))} of {mla.schedule.num_units} (request, 64-head) units split")
    g = torch.Generator().manual_seed(2)
    ckv = torch.randn(pb.num_pages, P, 512, generator=g).to(torch.bfloat16)
    kpe = torch.randn(pb.num_pages, P, 64, generator=g).to(torch.bfloat16)
    qn = (torch.randn(len(lens), H, 512, generator=g) / 3 ** 0.5).to(torch.bfloat16)
    qp = (torch.randn(len(lens), H, 64, generator=g) / 3 ** 0.5).to(torch.bfloat16)
    dev = torch.device(device)
    out = mla.run(*(t.to(dev) for t in (qn, qp, ckv, kpe)))
    ref, _ = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, scale)
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    ok = err < 1e-2 and not out.isnan().any()
    where = "GPU kernel" if device != "cpu" else "CPU reference executor (same schedule)"
    print(f"4. ran on the {where}: relative error vs float64 {err:.2e} -> {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


def timeline(parser: argparse.ArgumentParser, trace_path: Path, out: Path | None, width: int,
             row_height: int) -> int:
    """Print a trace's summary and busy table and render its PNG; a bad file is a parser error."""
    out = out or trace_path.with_suffix(".png")
    _check_output(parser, "argument -o/--output", out, trace=trace_path)
    try:
        trace = Trace.from_chrome(trace_path)
    except OSError as e:
        parser.error(f"argument TRACE: cannot read {trace_path}: {e.strerror or e}")
    except ValueError as e:
        parser.error(f"argument TRACE: {trace_path}: {e}")
    print(trace.summary())
    print(trace.busy_table())
    try:
        print(f"wrote {render_png(trace, out, width, row_height)}")
    except OSError as e:
        parser.error(f"argument -o/--output: cannot write {out}: {e.strerror or e}")
    return 0


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:   # one of them does not exist (yet): not the same file
        return False


def _check_output(parser: argparse.ArgumentParser, option: str, path: Path, make_folders: bool = False,
                 **inputs: Path) -> None:
    """A parser error naming `option`, before any work, for an output path the work's end could not write:
    a directory, a folder that does not exist (unless the writer makes it: `make_folders`) or cannot be
    written in, a file that cannot be written, or the same file (symlinks and hard links followed) as one
    of the command's `inputs` ({name: path}), which writing would destroy."""
    if path.is_dir():
        parser.error(f"{option}: cannot write {path}: Is a directory")
    for name, source in inputs.items():
        if _same_file(path, source):
            parser.error(f"{option}: {path} is the {name} file {source} itself; writing it would overwrite the input")
    folder = path.parent
    while make_folders and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        parser.error(f"{option}: folder {path.parent} does not exist")
    try:
        if path.exists():
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        else:   # creating a file is what is asked of the folder; root passes os.access even where it fails
            tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        parser.error(f"{option}: cannot write {path}: {e.strerror or e}")


class _Parser(argparse.ArgumentParser):
    """Errors are one line on stderr, exit status 2: without the usage block above it (-h shows that)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_in(low: int, high: int):
    """argparse type: an integer in (low, high], else an error naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low < value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be > {low} and <= {high}")
        return value
    return parse


def _tuning_db(parser: argparse.ArgumentParser, db: Path | None, write: bool = False):
    """The tuning database --db (else MELD_TUNING_DB) names, loaded; one that cannot be read, is no
    database or (`write`) could not be saved at the end is a parser error naming where its path came from."""
    from meld import config
    from meld.tuning.db import TuningDB

    path = db or config.tuning_db()
    if path is None:
        parser.error("argument --db: no database given and MELD_TUNING_DB is not set")
    source = "argument --db" if db else "MELD_TUNING_DB"
    try:
        loaded = TuningDB.load(path)
    except ValueError as e:
        parser.error(f"{source}: {e}")
    if write:
        _check_output(parser, source, path, make_folders=True)   # TuningDB.save makes missing folders
    return loaded


def _workload(text: str) -> str:
    """argparse type of `meld tune --workload`: "bench" or "recorded:FILE" (an existing file)."""
    if text == "bench" or (text.startswith("recorded:") and Path(text[len("recorded:"):]).is_file()):
        return text
    if text.startswith("recorded:"):
        raise argparse.ArgumentTypeError(f"{text[len('recorded:'):]!r} is not a file")
    raise argparse.ArgumentTypeError(f"{text!r} is not 'bench' or 'recorded:FILE'")


def tune_run(parser: argparse.ArgumentParser, db: Path | None, workload: str, rounds: int,
             device: str | None, fit_path: Path | None = None, keep: int = 2, sweep: bool = False) -> int:
    from meld.tuning.tune import bench_batches, load_fit, recorded_batches, sweep_report, table, tune
    from meld.tuning.tune import sweep as sweep_compare

    if sweep and fit_path is None:
        parser.error("argument --sweep: needs --fit (the sweep is compared with the search a fitted model prunes)")
    # A damaged or unwritable database fails before any measurement; a sweep records nothing.
    path = None if sweep else _tuning_db(parser, db, write=True).path
    try:
        batches = bench_batches() if workload == "bench" else recorded_batches(workload[len("recorded:"):])
    except OSError as e:
        parser.error(f"argument --workload: cannot read {workload[len('recorded:'):]}: {e.strerror or e}")
    except ValueError as e:
        parser.error(f"argument --workload: {e}")
    fit = None
    if fit_path is not None:
        try:
            fit = load_fit(fit_path)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            parser.error(f"argument --fit: {fit_path}: {e}")
    if _devices() == ["cpu"]:
        parser.error("argument --workload: tuning measures on a GPU; this machine has no sm_90+ GPU")
    device = _device(parser, device or "cuda")
    if device == "cpu":
        parser.error("argument --device: tuning measures on a GPU, not the CPU")
    if sweep:
        compared = sweep_compare(batches, fit, rounds=rounds, device=device, keep=keep)
        print(table(compared.pruned))
        print(sweep_report(compared))
        return 0
    result = tune(path, batches, workload, rounds=rounds, device=device, fit=fit, keep=keep)
    print(table(result))
    print(f"recorded in {path}" if result.adopted else f"nothing recorded in {path}")
    return 0


def tune_show(parser: argparse.ArgumentParser, db: Path | None) -> int:
    from meld.tuning.db import describe

    loaded = _tuning_db(parser, db)
    gpu = torch.device("cuda") if torch.cuda.is_available() else None
    print(describe(loaded, gpu))
    return 0


def _devices() -> list[str]:
    """Where demo can run: the CPU and every sm_90+ GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + [f"cuda:{i}" for i in range(gpus) if torch.cuda.get_device_capability(i) >= (9, 0)]


def _device(parser: argparse.ArgumentParser, device: str | None) -> str:
    """--device, checked against this machine before any work (default: cuda if GPU 0 is sm_90+, else cpu)."""
    available = _devices()
    if device is None:
        return "cuda" if "cuda:0" in available else "cpu"
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if m is None:
        parser.error(f"argument --device: {device!r} is not cpu, cuda or cuda:N")
    if device != "cpu" and f"cuda:{int(m[1] or 0)}" not in available:
        parser.error(f"argument --device: {device!r} is no sm_90+ GPU here (available: {', '.join(available)})")
    return device


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="meld", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="capture, plan, compile and run decode attention on a skewed batch")
    d.add_argument("--batch", type=_int_in(0, MAX_DEMO_BATCH),
                   help=f"requests, at most {MAX_DEMO_BATCH} (default 64 on a GPU, 16 on the CPU)")
    d.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if a Hopper GPU is present)")
    t = sub.add_parser("timeline", help="summary, busy table and PNG of a MELD_PROFILE=1 trace",
                       description="Per-SM timeline of a profiled launch, from Trace.write_chrome's JSON "
                                   "(which also opens in Perfetto, ui.perfetto.dev, or chrome://tracing).")
    t.add_argument("trace", type=Path, metavar="TRACE", help="Chrome trace JSON written under MELD_PROFILE=1")
    t.add_argument("-o", "--output", type=Path, metavar="OUT", help="PNG to write (default: TRACE, suffix .png)")
    t.add_argument("--width", type=_int_in(MARGIN_PX, MAX_WIDTH_PX), default=1600,
                   help=f"image width in pixels, at most {MAX_WIDTH_PX}")
    t.add_argument("--row-height", type=_int_in(0, MAX_ROW_PX), default=6,
                   help=f"pixels per SM row, at most {MAX_ROW_PX}")
    tu = sub.add_parser("tune", help="the tuning database: what it holds and whether it applies here",
                        description="Tuned operator configurations are kept in one JSON file (MELD_TUNING_DB) "
                                    "keyed by GPU, driver, CUDA, kernel sources, dtype and shape; an entry "
                                    "recorded elsewhere is ignored with a warning.")
    what = tu.add_mutually_exclusive_group(required=True)
    what.add_argument("--show", action="store_true", help="list the entries and where each applies")
    what.add_argument("--workload", type=_workload, metavar="bench|recorded:FILE",
                      help="tune on BENCH.md's B >= 64 decode batches, or on batches recorded under MELD_RECORD, "
                           "and record what wins")
    tu.add_argument("--db", type=Path, help="the database file (default: MELD_TUNING_DB)")
    tu.add_argument("--rounds", type=_int_in(0, 1000), default=5, help="interleaved rounds of replays per batch")
    tu.add_argument("--device", help="cuda or cuda:N (default: cuda)")
    tu.add_argument("--fit", type=Path, help="a fitted cost model (bench/cost_fit.py --json): search the planner "
                                            "constants on a finer grid and measure only those it predicts fastest")
    tu.add_argument("--keep", type=_int_in(0, 100), default=2, help="with --fit: planner candidates measured")
    tu.add_argument("--sweep", action="store_true", help="with --fit: also measure every candidate of the space the "
                                                         "search prunes and compare the two (records nothing)")
    from meld.serving import cli as serving_cli   # argparse, torch and NumPy only: no TVM, no kernels

    sb = serving_cli.add_parser(sub)
    args = p.parse_args(argv)
    if args.cmd == "serve-bench":
        return serving_cli.serve_bench(sb, args, _device(sb, args.device))
    if args.cmd == "tune":
        return tune_show(tu, args.db) if args.show else tune_run(tu, args.db, args.workload, args.rounds, args.device,
                                                                 args.fit, args.keep, args.sweep)
    if args.cmd == "timeline":
        return timeline(t, args.trace, args.output, args.width, args.row_height)
    device = _device(d, args.device)
    return demo(args.batch if args.batch is not None else (64 if device != "cpu" else 16), device)


if __name__ == "__main__":
    sys.exit(main())
