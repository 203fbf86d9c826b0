"""The continuous-batching decode loop: a scheduler over a request trace, dense prefill on admission, and
decode steps planned once and run per layer, eager or replayed from one CUDA graph per batch-size bucket.

Each step, as vLLM and SGLang run theirs: admit arrived requests while the batch has room and the KV pool
can reserve their pages (prefill them: not timed), then one decode step for every running request —
append a slot per request, build the page table once, `backend.plan()` once, the model's layers each
calling `backend.run()`, logits, greedy argmax copied to the host (the step's one synchronisation). The
step's wall time, host work included, is its latency. Under graphs the batch is padded to the next bucket
and that bucket's graph, captured once, replays whatever the latest plan() holds; inputs reach it through
static buffers. Finished requests free their pages at once.

The loop feeds each request the trace's next token rather than its argmax (`trace.request_tokens`), so two
runs of one trace with different backends decode the same batches and their logits compare step by step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..runtime.cuda_graphs import capture
from .backends import AttentionBackend
from .kv_cache import NULL_SLOT, PagedKVCache, PageTable
from .models import DecoderModel, MeldMoE
from .trace import Request, request_tokens

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> list[int]:
    """The graph buckets up to max_batch, max_batch itself included (the last bucket)."""
    return sorted({b for b in buckets if b < max_batch} | {max_batch})


@dataclass
class StepRecord:
    batch: int       # running requests
    rows: int        # rows computed (the bucket under graphs)
    seconds: float


@dataclass
class RunResult:
    """What one run of a trace measured; `summary()` turns it into the table's numbers."""

    backend: str
    moe: str
    graphs: bool
    max_batch: int
    steps: list[StepRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0
    admitted: int = 0
    finished: int = 0
    logits: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)   # first steps: (rids, [B, V])
    samples: list[tuple[int, PageTable]] = field(default_factory=list)                 # (step, its table)
    attention_seconds: dict[int, float] = field(default_factory=dict)                  # step -> all layers, alone

    def summary(self) -> dict:
        t = np.array([s.seconds for s in self.steps])
        tokens = sum(s.batch for s in self.steps)
        out = dict(backend=self.backend, moe=self.moe, mode="graphs" if self.graphs else "eager",
                   max_batch=self.max_batch, steps=len(self.steps), admitted=self.admitted, finished=self.finished,
                   mean_batch=tokens / max(len(self.steps), 1), tokens_per_s=tokens / t.sum() if len(t) else 0.0,
                   step_p50_ms=float(np.percentile(t, 50) * 1e3) if len(t) else 0.0,
                   step_p99_ms=float(np.percentile(t, 99) * 1e3) if len(t) else 0.0,
                   prefill_s=self.prefill_seconds)
        timed = [i for i in self.attention_seconds if i < len(self.steps)]
        if timed:
            attn = sum(self.attention_seconds[i] for i in timed)
            out["attn_ms_per_step"] = attn / len(timed) * 1e3
            out["attn_share"] = attn / sum(self.steps[i].seconds for i in timed)
        return out


@dataclass
class _Live:
    req: Request
    tokens: np.ndarray      # the trace's tokens of this request
    context: int = 0        # tokens in the KV cache
    generated: int = 0


def check_fits(trace: list[Request], max_position: int, page_size: int, usable_pages: int) -> None:
    """ValueError naming the first request that could never run (too long for the pool or RoPE): what a
    run checks first, and `meld serve-bench` before it builds anything."""
    for r in trace:
        if r.max_tokens > max_position:
            raise ValueError(f"request {r.rid} reaches {r.max_tokens} tokens, beyond the model's max_position="
                             f"{max_position}")
        pages = -(-r.max_tokens // page_size)
        if pages > usable_pages:
            raise ValueError(f"request {r.rid} needs {pages} KV pages ({r.max_tokens} tokens) but the pool has "
                             f"{usable_pages}: give the pool more pages")


class Engine:
    """Runs traces through `model` with one attention `backend` over one KV pool.

    Args:
        model, backend, cache: the pieces (the cache's pool is reused run after run; each run starts empty).
        max_batch: most requests decoded per step.
        graphs: capture one CUDA graph per bucket (`buckets_for(max_batch)`) and replay it (GPU only).
        token_seed: seed of the trace's tokens.

    Example:
        >>> engine = Engine(model, make_backend("meld", ...), kv, max_batch=64, graphs=True)
        >>> result = engine.run(make_trace(TraceConfig()), max_steps=200)
        >>> engine.time_attention(result); result.summary()
    """

    def __init__(self, model: DecoderModel, backend: AttentionBackend, cache: PagedKVCache, max_batch: int,
                 graphs: bool = False, token_seed: int = 0):
        self.model, self.backend, self.cache, self.max_batch = model, backend, cache, max_batch
        self.device = cache.pool.device
        self.cuda = self.device.type == "cuda"
        if graphs and not self.cuda:
            raise ValueError("CUDA graphs need a CUDA device (this engine runs on the CPU)")
        self.graphs, self.token_seed = graphs, token_seed
        self.buckets = buckets_for(max_batch)
        rows = self.buckets[-1]
        # Inputs of a step: tokens, positions, slots. Staged on the host (pinned on a GPU), copied in one go.
        self._host = torch.zeros(3, rows, dtype=torch.int64, pin_memory=self.cuda)
        self._host_np = self._host.numpy()
        self._inputs = torch.zeros(3, rows, dtype=torch.int64, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._attn_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._attn_q: dict[int, torch.Tensor] = {}
        if self.cuda:
            self._warm_up()
        if graphs:
            backend.prepare_graphs(self.buckets)
            self._capture()

    # --- setup ---------------------------------------------------------------------------------------
    def _padding_table(self, rows: int) -> PageTable:
        return self.cache.page_table([], pad_to=rows, pad_page=self.backend.pad_page)

    def _forward(self, rows: int) -> torch.Tensor:
        tokens, positions, slots = self._inputs[:, :rows]
        return self.model.decode(tokens, positions, slots, self.backend, self.cache)

    def _stage_padding(self) -> None:
        self._host[0].zero_()
        self._host[1].zero_()
        self._host[2].fill_(NULL_SLOT)
        self._inputs.copy_(self._host)

    def _warm_up(self) -> None:
        """Compile and load every kernel a measured step can meet (meld's MoE variants by token count,
        FlashInfer's JIT), with padding rows only, before anything is timed."""
        moe = self.model.moe
        if isinstance(moe, MeldMoE):
            from ..codegen.moe_kernel import block_tokens_for

            c = self.model.config
            seen = set()
            for t in range(1, self.buckets[-1] + 1):
                bt = block_tokens_for(t, c.top_k, c.num_experts, moe.fp8)
                if bt not in seen:
                    seen.add(bt)
                    w = self.model.layers[0]
                    x = torch.zeros(t, c.hidden_size, dtype=c.dtype, device=self.device)
                    moe(x, torch.zeros(t, c.num_experts, device=self.device), self.model.moe_weights(w))
        self._stage_padding()
        for rows in (self.buckets[0], self.buckets[-1]):
            self.backend.plan(self._padding_table(rows))
            self._forward(rows)
        torch.cuda.synchronize(self.device)

    def _capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool (as vLLM captures them)."""
        pool = torch.cuda.graph_pool_handle()
        self._stage_padding()
        for rows in reversed(self.buckets):
            self.backend.plan(self._padding_table(rows))
            self._graphs[rows] = capture(lambda: self._forward(rows), pool=pool, device=self.device)
        torch.cuda.synchronize(self.device)

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    # --- the loop ------------------------------------------------------------------------------------
    def run(self, trace: list[Request], max_steps: int, record_logits: int = 0, samples: int = 0) -> RunResult:
        """Decode `trace` until `max_steps` decode steps ran or every request finished.

        Args:
            record_logits: keep the logits of the first this many steps (for cross-backend checks).
            samples: keep the page tables of this many steps spread over the run (for `time_attention`).
        """
        check_fits(trace, self.model.config.max_position, self.cache.page_size, self.cache.usable_pages)
        for rid in self.cache.requests:
            self.cache.release(rid)
        res = RunResult(self.backend.name, self.model.moe_name, self.graphs, self.max_batch)
        pending = deque(sorted(trace, key=lambda r: (r.arrival, r.rid)))
        waiting: deque[Request] = deque()
        running: list[_Live] = []
        stride = max(1, max_steps // samples) if samples else 0
        clock = 0
        while len(res.steps) < max_steps:
            while pending and pending[0].arrival <= clock:
                waiting.append(pending.popleft())
            t0 = time.perf_counter()
            while waiting and len(running) < self.max_batch and self.cache.can_admit(waiting[0].max_tokens):
                live = self._prefill(waiting.popleft())
                res.admitted += 1
                if live.generated < live.req.output_len:
                    running.append(live)
                else:
                    self.cache.release(live.req.rid)
                    res.finished += 1
            if self.cuda:
                torch.cuda.synchronize(self.device)
            res.prefill_seconds += time.perf_counter() - t0
            if not running:
                if not pending:
                    break
                clock = max(clock + 1, pending[0].arrival)
                continue
            step = len(res.steps)
            logits, rows, seconds, table = self._decode(running)
            res.steps.append(StepRecord(len(running), rows, seconds))
            if step < record_logits:
                res.logits.append((tuple(r.req.rid for r in running), logits.float().cpu()))
            if stride and step % stride == 0 and len(res.samples) < samples:
                res.samples.append((step, table))
            still = []
            for r in running:
                if r.generated < r.req.output_len:
                    still.append(r)
                else:
                    self.cache.release(r.req.rid)
                    res.finished += 1
            running = still
            clock += 1
        for r in running:
            self.cache.release(r.req.rid)
        return res

    def _prefill(self, req: Request) -> _Live:
        live = _Live(req, request_tokens(req, self.model.config.vocab_size, self.token_seed).numpy())
        self.cache.add(req.rid, req.max_tokens)
        slots = torch.from_numpy(self.cache.extend(req.rid, req.prompt_len)).to(self.device)
        self.model.prefill(torch.from_numpy(live.tokens[:req.prompt_len]).to(self.device), slots, self.cache)
        live.context, live.generated = req.prompt_len, 1
        return live

    def _decode(self, running: list[_Live]) -> tuple[torch.Tensor, int, float, PageTable]:
        """One timed decode step of every running request: (logits [B, V], rows computed, seconds, table)."""
        t0 = time.perf_counter()
        B = len(running)
        rows = self.bucket(B) if self.graphs else B
        rids = [r.req.rid for r in running]
        host = self._host_np
        host[0, :B] = [r.tokens[r.context] for r in running]
        host[1, :B] = [r.context for r in running]
        host[2, :B] = self.cache.append(rids)
        for r in running:
            r.context += 1
            r.generated += 1
        if rows > B:   # padding rows: token 0 at position 0, K/V written to the null slot
            host[:2, B:rows] = 0
            host[2, B:rows] = NULL_SLOT
        table = self.cache.page_table(rids, pad_to=rows if self.graphs else None, pad_page=self.backend.pad_page)
        self.backend.plan(table)
        self._inputs.copy_(self._host, non_blocking=True)   # the whole (small) buffer: one contiguous copy
        if self.graphs:
            g, out = self._graphs[rows]
            g.replay()
            logits = out[:B]
        else:
            logits = self._forward(rows)
        logits.argmax(dim=-1).cpu()   # greedy sampling; the trace's tokens are fed back (see module doc)
        return logits, rows, time.perf_counter() - t0, table

    # --- attention alone -------------------------------------------------------------------------------
    def time_attention(self, result: RunResult, reps: int = 10) -> None:
        """Time the attention of each sampled step alone: plan its table, then run() in every layer
        (replayed from a graph of those calls under graphs), `reps` times; fills result.attention_seconds.
        On a GPU with CUDA events; small batches may find their KV still in L2, so their share is a floor."""
        c = self.model.config
        for step, table in result.samples:
            self.backend.plan(table)
            rows = table.rows
            if rows not in self._attn_q:
                self._attn_q[rows] = torch.randn(rows, c.num_qo_heads, c.head_dim, device=self.device).to(c.dtype)
            q = self._attn_q[rows]

            def call(q=q):
                for i in range(c.num_layers):
                    self.backend.run(i, q, self.cache.layer(i))

            if self.graphs:
                call = self._attention_graph(rows, call)
            call()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                call()
                start.record()
                for _ in range(reps):
                    call()
                end.record()
                end.synchronize()
                result.attention_seconds[step] = start.elapsed_time(end) / 1e3 / reps
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    call()
                result.attention_seconds[step] = (time.perf_counter() - t0) / reps

    def _attention_graph(self, rows: int, call):
        """A graph of one step's attention calls for this bucket (captured once, after a plan of it)."""
        if rows not in self._attn_graphs:
            self._attn_graphs[rows] = capture(call, device=self.device)[0]
        return self._attn_graphs[rows].replay
