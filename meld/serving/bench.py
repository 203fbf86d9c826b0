"""`meld serve-bench`: the decode loop on a trace for each (max batch, attention backend), one table.

For every max batch it builds one trace and one KV pool, then runs each backend over the same trace in
turn (same model, same weights, same scheduling), times each sampled step's attention alone for its share
of the step, and with `check` compares the logits of the first steps against the reference run (the
`sdpa` backend with torch's MoE; `meld` when `sdpa` is the backend measured).

Columns: tokens/s = decode tokens over the summed wall time of the decode steps (prefill, done on
admission, is not counted); step p50/p99 = wall time of a step, host work and the final sync included;
attn ms/step = the sampled steps' attention (every layer) timed alone; attn share = that over the same
steps' wall time; check = the largest relative L2 error of a row's logits and the argmax agreement (MoE
models: of an eager run that replays the reference run's routing, `RoutingTape`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch

from .backends import BackendUnavailable, make_backend, not_installed, unavailable
from .engine import Engine, RunResult, buckets_for, check_fits
from .models import MODELS, PREFILL_CHUNK, DecoderModel, ModelConfig, RoutingTape, make_cache, tiny_config
from .trace import TraceConfig, make_trace

CHECK_TOL = 2e-2     # relative L2 error of a step's logits, bf16 end to end: a few bf16 ulps through the layers
# With FP8 experts meld's MoE quantises its activations (each token's x and act, per 128 channels, to e4m3: 3
# mantissa bits) where the reference runs the dequantised weights on bf16 activations: the tiny qwen3-moe model's
# two layers differ by 3.1e-2 with every argmax equal.
CHECK_TOL_FP8 = 8e-2


@dataclass
class BenchConfig:
    """One serve-bench invocation. None: the size's default (see `resolved`)."""

    model: str = "llama"
    size: str = "full"                  # "full": the published shapes; "tiny": for the CPU executor
    layers: int | None = None
    backends: list[str] = field(default_factory=lambda: ["meld"])
    max_batches: list[int] = field(default_factory=lambda: [64])
    requests: int | None = None         # default 2 x max batch (full), 8 (tiny)
    steps: int | None = None            # measured decode steps; default 200 (full), 12 (tiny)
    arrival_rate: float | None = None   # requests per step; default max batch / 4 (full), 2 (tiny)
    kv_pages: int | None = None         # pool pages; default 8192 tokens per request slot (full), 256 (tiny)
    page_size: int = 16                 # the flashmla backend runs 64 only
    graphs: bool = True
    moe: str = "auto"                   # auto: meld's MoE on the meld backend, torch's on the others
    moe_dtype: str = "bf16"             # the MoE models' experts: bf16, or fp8 (block-scaled e4m3; ModelConfig)
    check: bool = False
    check_steps: int = 4
    check_tol: float | None = None      # default CHECK_TOL, CHECK_TOL_FP8 with fp8 experts
    samples: int = 16                   # steps whose attention is timed alone
    seed: int = 1
    device: str = "cpu"

    @property
    def tolerance(self) -> float:
        """--check's bound on a step's logits: check_tol, or the default for the experts' dtype."""
        return self.check_tol if self.check_tol is not None else CHECK_TOL_FP8 if self.moe_dtype == "fp8" else CHECK_TOL


def model_config(cfg: BenchConfig) -> ModelConfig:
    if cfg.model not in MODELS:
        raise ValueError(f"unknown model {cfg.model!r}; expected one of {', '.join(MODELS)}")
    over = {} if cfg.layers is None else {"num_layers": cfg.layers}
    if cfg.moe_dtype != "bf16":
        over["moe_dtype"] = cfg.moe_dtype
    return tiny_config(cfg.model, **over) if cfg.size == "tiny" else MODELS[cfg.model](**over)


def trace_config(cfg: BenchConfig, max_batch: int) -> TraceConfig:
    tiny = cfg.size == "tiny"
    n = cfg.requests or (8 if tiny else 2 * max_batch)
    rate = cfg.arrival_rate or (2.0 if tiny else max_batch / 4)
    return TraceConfig.tiny(n, rate, cfg.seed) if tiny else TraceConfig(n, rate, seed=cfg.seed)


def pool_pages(cfg: BenchConfig, max_batch: int, trace_cfg: TraceConfig) -> int:
    if cfg.kv_pages:
        return cfg.kv_pages
    per_request = 256 if cfg.size == "tiny" else 8192
    longest = trace_cfg.prompt[3] + trace_cfg.output[3]
    return -(-max(max_batch * per_request, longest) // cfg.page_size) + 1 + max_batch


def available_bytes(device: torch.device) -> int:
    """Memory a pool on `device` can take: the GPU's free memory, or on the CPU the host's available memory
    (Linux's MemAvailable: free plus what the kernel can reclaim)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_pool_fits(mc: ModelConfig, pages: int, page_size: int, device: torch.device) -> None:
    """ValueError, before allocating, when the pool would not fit in 80% of its device's available memory
    (on the CPU too: there an allocation that cannot be met dies in the allocator, or in the OOM killer)."""
    need = mc.num_layers * pages * page_size * mc.cache_bytes_per_token
    free = available_bytes(device)
    if need > 0.8 * free:
        raise ValueError(f"--kv-pages: a KV pool of {pages} pages needs {need} bytes ({need / 2**30:.1f} GiB), more "
                         f"than 80% of the {free / 2**30:.1f} GiB available on {device}: pass a smaller --kv-pages")


def compare(run: RunResult, ref: RunResult) -> dict:
    """The largest relative L2 error of a row's logits against the reference over the compared steps, the
    median one, and argmax agreement."""
    errs, agree = [], 0
    for (rids, a), (ref_rids, b) in zip(run.logits, ref.logits):
        if rids != ref_rids:
            raise RuntimeError(f"the runs decoded different batches ({rids} vs {ref_rids}): scheduling must not "
                               "depend on the backend")
        a, b = a.float(), b.float()
        errs += ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
    errs.sort()
    return dict(check_steps=len(run.logits), check_rel_err=errs[-1] if errs else 0.0,
                check_row_err_p50=errs[len(errs) // 2] if errs else 0.0, check_argmax_agree=agree / max(len(errs), 1))


def run_with_routing(model: DecoderModel, engine: Engine, trace, steps: int, tape: RoutingTape | None) -> RunResult:
    """`steps` eager steps of `engine` recording their logits, the MoE routing recorded to or replayed from
    `tape` (None: routed as the model routes)."""
    model.routing = tape
    try:
        return engine.run(trace, steps, record_logits=steps)
    finally:
        model.routing = None


def _engine(model, name, moe, mc, cache, max_batch, pages, graphs, device):
    model.use_moe(moe)
    rows = buckets_for(max_batch)[-1]
    try:
        backend = make_backend(name, mc, cache.page_size, device, rows, pages + rows)
    except ValueError as e:   # e.g. meld on a GPU its kernels do not support
        raise BackendUnavailable(f"backend {name!r}: {e}") from None
    return Engine(model, backend, cache, max_batch, graphs=graphs and backend.supports_graphs, token_seed=0)


def serve_bench(cfg: BenchConfig, echo=print) -> tuple[int, list[dict]]:
    """Run the configurations of `cfg`, print the table through `echo`; (exit status, rows).
    A backend whose package does not import is skipped, with the reason printed. Raises BackendUnavailable
    or ValueError, before any run, for what cannot run here (and when no backend is left)."""
    device = torch.device(cfg.device)
    mc = model_config(cfg)
    for name in cfg.backends:
        why = unavailable(name, device, mc, cfg.page_size)
        if why:
            raise BackendUnavailable(why)
    skipped = {name: why for name in cfg.backends if (why := not_installed(name))}
    backends = [name for name in cfg.backends if name not in skipped]
    if not backends:
        raise BackendUnavailable("; ".join(skipped.values()))
    if cfg.moe not in ("auto", "meld", "torch"):
        raise ValueError(f"moe must be auto, meld or torch, got {cfg.moe!r}")
    runs = []   # (max batch, trace config, trace, pool pages): every pool and trace checked before any is built
    for max_batch in cfg.max_batches:
        tc = trace_config(cfg, max_batch)
        pages = pool_pages(cfg, max_batch, tc)
        check_pool_fits(mc, pages, cfg.page_size, device)
        trace = make_trace(tc)
        check_fits(trace, mc.max_position, cfg.page_size, pages - 1)   # every page but the null page
        runs.append((max_batch, tc, trace, pages))
    graphs = cfg.graphs and device.type == "cuda"
    model = DecoderModel(mc, device, moe="torch", moe_max_tokens=max(PREFILL_CHUNK, *cfg.max_batches))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU reference executor"
    echo(f"{mc.describe()}; bf16 on {device} ({where}); page size {cfg.page_size}; "
         f"{'CUDA graphs per batch bucket' if graphs else 'eager'}")
    for name, why in skipped.items():
        echo(f"skipped backend {name}: {why}")
    rows, status = [], 0
    for max_batch, tc, trace, pages in runs:
        cache = make_cache(mc, pages, cfg.page_size, device, seed=cfg.seed)
        echo(f"max batch {max_batch}: trace of {tc.num_requests} requests, {tc.arrival_rate:g} arriving per step, "
             f"prompts log-normal{tc.prompt[:2]} in [{tc.prompt[2]}, {tc.prompt[3]}], outputs log-normal"
             f"{tc.output[:2]} in [{tc.output[2]}, {tc.output[3]}] (seed {tc.seed}); KV pool {pages} pages")
        steps = cfg.steps or (12 if cfg.size == "tiny" else 200)
        ref = None
        for name in backends:
            moe = cfg.moe if cfg.moe != "auto" else ("meld" if name == "meld" else "torch")
            engine = _engine(model, name, moe, mc, cache, max_batch, pages, graphs, device)
            result = engine.run(trace, steps, record_logits=cfg.check_steps if cfg.check else 0,
                                samples=cfg.samples)
            engine.time_attention(result)
            row = result.summary()
            if cfg.check:
                if ref is None or (name == "sdpa") != ref[0]:
                    ref_name = "meld" if name == "sdpa" else "sdpa"
                    ref_engine = _engine(model, ref_name, "torch", mc, cache, max_batch, pages, False, device)
                    tape = RoutingTape(mc.top_k) if mc.is_moe else None
                    ref = (name == "sdpa", run_with_routing(model, ref_engine, trace, cfg.check_steps, tape), tape)
                    del ref_engine
                got, against = result, ref[1].backend
                if mc.is_moe:   # the measured run routed by its own logits: check an eager run on the reference's routing
                    check_engine = _engine(model, name, moe, mc, cache, max_batch, pages, False, device)
                    got = run_with_routing(model, check_engine, trace, cfg.check_steps, ref[2].replay())
                    against += f" + {ref[1].moe} MoE, eager, its routing replayed"
                    del check_engine
                row.update(compare(got, ref[1]), check_against=against)
                row["check_ok"] = row["check_rel_err"] <= cfg.tolerance
                status |= 0 if row["check_ok"] else 1
            del engine
            rows.append(row)
            echo(format_row(row, header=name == backends[0]))
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return status, rows


_COLUMNS = ("backend", "moe", "mode", "max batch", "steps", "mean batch", "tokens/s", "step p50 ms", "step p99 ms",
            "attn ms/step", "attn share", "check")


def format_row(row: dict, header: bool = False) -> str:
    """One table row (and the header above the first)."""
    check = "-"
    if "check_rel_err" in row:
        check = (f"{'OK' if row['check_ok'] else 'FAIL'} rel err {row['check_rel_err']:.1e}, argmax "
                 f"{row['check_argmax_agree']:.0%} vs {row['check_against']}")
    cells = (row["backend"], row["moe"], row["mode"], row["max_batch"], row["steps"], f"{row['mean_batch']:.1f}",
             f"{row['tokens_per_s']:.0f}", f"{row['step_p50_ms']:.2f}", f"{row['step_p99_ms']:.2f}",
             f"{row['attn_ms_per_step']:.2f}" if "attn_ms_per_step" in row else "-",
             f"{row['attn_share']:.0%}" if "attn_share" in row else "-", check)
    line = "| " + " | ".join(str(c) for c in cells) + " |"
    if not header:
        return line
    return "| " + " | ".join(_COLUMNS) + " |\n|" + "---|" * len(_COLUMNS) + "\n" + line


def write_json(path, cfg: BenchConfig, rows: list[dict]) -> None:
    device = torch.device(cfg.device)
    meta = dict(config=asdict(cfg), check_tolerance=cfg.tolerance, torch=torch.__version__,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
