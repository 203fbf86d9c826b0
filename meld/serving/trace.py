"""Request traces for the decode loop: arrivals at a fixed rate, prompt and output lengths log-normal.

Prompt lengths follow BENCH.md's `skewed` decode batch (ln-mean 7.5, ln-sd 1.2, clipped to [64, 65536])
and are drawn exactly as it draws them, so with the default seed the first B prompts of a trace are the
`skewed` batch of B that the kernel benchmarks measure; output lengths follow BENCH's decode-loop
workload (ln-mean 5, ln-sd 1, clipped to [16, 2048]). Everything is seeded: one trace per config.

Tokens are fixed by the trace too (`request_tokens`): the loop feeds each request the trace's next token
instead of the one it samples, so runs with different attention backends see the same inputs at every
step and their logits can be compared step by step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.checks import INT32_MAX, SEED_RANGE, check_finite, check_positive, check_seed, is_int

MAX_REQUESTS = 1 << 20   # requests in one trace (each is drawn in Python: a few microseconds)


@dataclass(frozen=True)
class Request:
    """One request of a trace: it arrives before decode step `arrival`, holds `prompt_len` tokens after
    prefill and ends once it has produced `output_len` tokens (the first comes from prefill)."""

    rid: int
    arrival: int
    prompt_len: int
    output_len: int

    def __post_init__(self):
        for name, low in (("rid", 0), ("arrival", 0), ("prompt_len", 1), ("output_len", 1)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                raise ValueError(f"Request.{name} must be an int >= {low}, got {v!r}")

    @property
    def max_tokens(self) -> int:
        """KV tokens it holds at most (its last output token is sampled, never written to the cache)."""
        return self.prompt_len + self.output_len - 1


@dataclass(frozen=True)
class TraceConfig:
    """A trace's distributions. Defaults: BENCH.md's decode-loop workload (prompts as `skewed`).

    Args:
        num_requests: requests in the trace.
        arrival_rate: requests arriving per decode step (request i arrives at step floor(i / rate)).
        prompt, output: (ln-mean, ln-sd, min, max) of the log-normal lengths, clipped to [min, max].
        seed: prompts use torch.Generator().manual_seed(seed), outputs seed + 1 (tokens: `request_tokens`).
    """

    num_requests: int = 256
    arrival_rate: float = 16.0
    prompt: tuple[float, float, int, int] = (7.5, 1.2, 64, 65536)
    output: tuple[float, float, int, int] = (5.0, 1.0, 16, 2048)
    seed: int = 1

    @classmethod
    def tiny(cls, num_requests: int = 8, arrival_rate: float = 2.0, seed: int = 1) -> "TraceConfig":
        """Short prompts and outputs for the CPU executor and the tests: the same shape of distribution,
        scaled down."""
        return cls(num_requests, arrival_rate, (4.0, 0.8, 4, 200), (2.2, 0.6, 2, 20), seed)


def lognormal(n: int, ln_mean: float, ln_sd: float, low: int, high: int, seed: int) -> list[int]:
    """n lengths, each int(clip(exp(N(ln_mean, ln_sd)), low, high)), drawn as BENCH.md draws `skewed`."""
    g = torch.Generator().manual_seed(seed)
    return [int(min(high, max(low, math.exp(torch.empty(1).normal_(ln_mean, ln_sd, generator=g).item()))))
            for _ in range(n)]


def make_trace(cfg: TraceConfig) -> list[Request]:
    """The trace of `cfg`: requests in arrival order.

    Example:
        >>> trace = make_trace(TraceConfig(num_requests=128, arrival_rate=8))
        >>> trace[0]   # Request(rid=0, arrival=0, prompt_len=..., output_len=...)
    """
    check_positive("num_requests", cfg.num_requests, MAX_REQUESTS)
    if not check_finite("arrival_rate", cfg.arrival_rate) > 0:
        raise ValueError(f"arrival_rate must be > 0 requests per step, got {cfg.arrival_rate}")
    check_seed("seed", cfg.seed, span=2)
    for name in ("prompt", "output"):
        d = getattr(cfg, name)
        if not isinstance(d, (tuple, list)) or len(d) != 4:
            raise ValueError(f"{name} must be (ln-mean, ln-sd, min, max), got {d!r}")
        mean, sd, low, high = d
        check_finite(f"{name}'s ln-mean", mean, 700)   # (exp overflows a float beyond ~709)
        check_finite(f"{name}'s ln-sd", sd)
        if not (is_int(low) and is_int(high) and 1 <= low <= high <= INT32_MAX) or sd < 0:
            raise ValueError(f"{name} lengths: need int 1 <= min <= max <= {INT32_MAX} and ln-sd >= 0, got {d}")
    n = cfg.num_requests
    prompts = lognormal(n, *cfg.prompt, seed=cfg.seed)
    outputs = lognormal(n, *cfg.output, seed=cfg.seed + 1)
    return [Request(i, int(i / cfg.arrival_rate), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]


def request_tokens(req: Request, vocab_size: int, seed: int) -> torch.Tensor:
    """The request's tokens (prompt, then the outputs fed back), int64 on the CPU, its own seeded stream."""
    check_positive("vocab_size", vocab_size)
    low, high = SEED_RANGE
    if not is_int(seed) or not low <= seed * 1_000_003 + req.rid <= high:
        raise ValueError(f"seed must be an int with seed * 1_000_003 + rid in [{low}, {high}] (it seeds the request's "
                         f"generator), got seed={seed!r} for rid {req.rid}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + req.rid)
    return torch.randint(vocab_size, (req.prompt_len + req.output_len,), generator=g)
