"""A decode loop that a serving engine would recognise, to measure what meld gives a whole model.

`models` (Llama-style, Qwen3-MoE-style and DeepSeek-V3-style (MLA) decoders with random weights), `kv_cache`
(one preallocated pool, K/V or MLA latent pages, a block allocator, FlashInfer-layout page tables), `trace`
(log-normal request traces as BENCH.md's `skewed`), `backends` (meld, FlashInfer, FlashMLA, torch SDPA behind
plan-once-per-step / run-per-layer), `engine`
(continuous batching, CUDA graphs per batch bucket) and `bench` (`meld serve-bench`). Not imported by
`import meld`; it imports no TVM.

Example:
    >>> from meld.serving import *
    >>> cfg = llama_config(num_layers=4)
    >>> model = DecoderModel(cfg, "cuda", moe="meld")
    >>> kv = PagedKVCache(cfg.num_layers, 65536, 16, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, "cuda")
    >>> engine = Engine(model, make_backend("meld", cfg, 16, "cuda", 64, 65536 + 64), kv, max_batch=64, graphs=True)
    >>> result = engine.run(make_trace(TraceConfig(num_requests=128)), max_steps=200, samples=16)
    >>> engine.time_attention(result); print(result.summary())
"""
from .backends import BACKENDS, AttentionBackend, BackendUnavailable, make_backend
from .engine import Engine, RunResult, buckets_for
from .kv_cache import NULL_PAGE, BlockAllocator, PagedKVCache, PagedLatentCache, PageTable
from .models import DecoderModel, ModelConfig, deepseek_config, llama_config, make_cache, qwen3_moe_config, tiny_config
from .trace import Request, TraceConfig, make_trace, request_tokens

__all__ = ["BACKENDS", "AttentionBackend", "BackendUnavailable", "BlockAllocator", "DecoderModel", "Engine",
           "ModelConfig", "NULL_PAGE", "PageTable", "PagedKVCache", "PagedLatentCache", "Request", "RunResult",
           "TraceConfig", "buckets_for", "deepseek_config", "llama_config", "make_backend", "make_cache", "make_trace",
           "qwen3_moe_config", "request_tokens", "tiny_config"]
