"""Decoder models with random weights for the decode loop: a Llama-style dense decoder, a Qwen3-MoE-style
one and a DeepSeek-V3-style one (MLA attention, MoE), built from a config and a seed.

What matters to attention is exact (GQA heads, head_dim, RoPE applied to q and k before the cache write,
since meld's attention has no positional encoding inside; for MLA the latent cache [c, k_pe] and the
absorbed query), and the rest is what a step spends its time on besides attention (RMSNorm, the
projections, a SwiGLU MLP or a routed MoE, the LM head), at the published sizes of Llama-3-8B,
Qwen3-30B-A3B and DeepSeek-V3 with fewer layers. Weights are N(0, 1/fan_in), so activations stay O(1) and
logits are comparable across attention backends.

Model code is backend-agnostic: attention goes through `backend.run(layer, q, kv_cache)` (see
`backends.py`), the KV write through `PagedKVCache.write` (`PagedLatentCache.write` for MLA), the MoE
through `self.moe` (meld's fused MoE or torch's grouped-GEMM pipeline). `decode()` only launches work, so
it can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.moe_reference import dequantize_blocks, quantize_blocks
from .kv_cache import PagedKVCache, PagedLatentCache
from .torch_moe import topk_route, torch_grouped_mm_moe

PREFILL_CHUNK = 8192   # default tokens per MLP/MoE call in prefill: bounds activations and meld.MoE's capacity


MOE_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shapes. `intermediate_size` for a dense SwiGLU MLP, or `num_experts` > 0 for MoE layers
    (`top_k` experts of `moe_intermediate_size` each, softmax routing renormalised over the top k).

    `kv_lora_rank` > 0 makes attention DeepSeek's MLA: what the attention backends see is then one latent
    kv head (num_kv_heads 1) of head_dim = kv_lora_rank + qk_rope_head_dim (the cached [c, k_pe] row and
    the absorbed query); values are its first kv_lora_rank channels."""

    name: str
    num_layers: int
    hidden_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int = 0
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    qk_norm: bool = False          # Qwen3: RMSNorm over each q and k head before RoPE
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    max_position: int = 131072
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    moe_dtype: str = "bf16"        # MoE experts: "bf16", or "fp8": e4m3 with a scale per 128 x 128 block (DeepSeek-V3's)
    q_lora_rank: int = 0           # MLA: the query's low-rank projection (DeepSeek-V3: 1536)
    kv_lora_rank: int = 0          # MLA: the latent c cached per token (DeepSeek-V3: 512)
    qk_nope_head_dim: int = 0      # MLA: per-head q/k channels without RoPE (128)
    qk_rope_head_dim: int = 0      # MLA: channels with RoPE, k_pe shared by every head (64)
    v_head_dim: int = 0            # MLA: per-head value channels after the up-projection (128)

    def __post_init__(self):
        if self.is_mla:
            dims = dict(q_lora_rank=self.q_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                        qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
            if min(dims.values()) <= 0:
                raise ValueError(f"MLA (kv_lora_rank={self.kv_lora_rank}) needs positive {dims}")
            if (self.num_kv_heads, self.head_dim) != (1, self.kv_lora_rank + self.qk_rope_head_dim):
                raise ValueError(f"MLA attention is one latent kv head of kv_lora_rank + qk_rope_head_dim = "
                                 f"{self.kv_lora_rank + self.qk_rope_head_dim} channels: need num_kv_heads=1 and "
                                 f"head_dim={self.kv_lora_rank + self.qk_rope_head_dim}, got {self.num_kv_heads} "
                                 f"and {self.head_dim}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_dim % 2:
            raise ValueError(f"the RoPE width ({'qk_rope_head_dim' if self.is_mla else 'head_dim'}) must be even, "
                             f"got {self.rope_dim}")
        if (self.num_experts > 0) == (self.intermediate_size > 0):
            raise ValueError("give intermediate_size (dense MLP) or num_experts (MoE), exactly one")
        if self.moe_dtype not in MOE_DTYPES:
            raise ValueError(f"moe_dtype must be one of {MOE_DTYPES}, got {self.moe_dtype!r}")
        if self.moe_dtype != "bf16" and not self.num_experts:
            raise ValueError(f"moe_dtype={self.moe_dtype!r} needs MoE layers (num_experts > 0)")
        if self.num_experts and not (1 <= self.top_k <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(f"MoE needs 1 <= top_k <= num_experts and moe_intermediate_size > 0, got top_k="
                             f"{self.top_k}, num_experts={self.num_experts}, "
                             f"moe_intermediate_size={self.moe_intermediate_size}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates: a head's (GQA) or k_pe's (MLA)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def sm_scale(self) -> float:
        """Attention's softmax scale: 1/sqrt(head_dim), or for MLA 1/sqrt(qk_nope + qk_rope head dims), the
        head dim of the unabsorbed q.k (DeepSeek-V3's YaRN factor left out: no long context here)."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim) ** -0.5

    @property
    def cache_bytes_per_token(self) -> int:
        """KV cache bytes of one token in one layer: K and V rows (GQA), or one latent row (MLA)."""
        return (1 if self.is_mla else 2) * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def describe(self) -> str:
        mlp = (f"MoE {self.num_experts} experts top-{self.top_k} I={self.moe_intermediate_size}"
               + (" (FP8 block-scaled experts)" if self.moe_dtype == "fp8" else "") if self.is_moe
               else f"SwiGLU I={self.intermediate_size}")
        attn = (f"MLA {self.num_qo_heads} heads, latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}, q rank "
                f"{self.q_lora_rank}" if self.is_mla else
                f"GQA {self.num_qo_heads}/{self.num_kv_heads}/{self.head_dim}")
        return (f"{self.name}: {self.num_layers} layers, hidden {self.hidden_size}, {attn}, {mlp}, "
                f"vocab {self.vocab_size}")


def llama_config(num_layers: int = 4, **over) -> ModelConfig:
    """Llama-3-8B's shapes (GQA 32/8/128, hidden 4096, SwiGLU 14336, vocab 128256), `num_layers` layers."""
    return ModelConfig(**{**dict(name="llama", num_layers=num_layers, hidden_size=4096, num_qo_heads=32,
                                 num_kv_heads=8, head_dim=128, vocab_size=128256, intermediate_size=14336,
                                 rope_theta=500000.0, rms_eps=1e-5), **over})


def qwen3_moe_config(num_layers: int = 4, **over) -> ModelConfig:
    """Qwen3-30B-A3B's shapes (GQA 32/4/128 with q/k norms, hidden 2048, 128 experts top-8 of I=768 —
    BENCH.md's qwen3-30b-a3b MoE shape —, vocab 151936), `num_layers` layers, every one MoE."""
    return ModelConfig(**{**dict(name="qwen3-moe", num_layers=num_layers, hidden_size=2048, num_qo_heads=32,
                                 num_kv_heads=4, head_dim=128, vocab_size=151936, num_experts=128, top_k=8,
                                 moe_intermediate_size=768, qk_norm=True, rope_theta=1e6, rms_eps=1e-6), **over})


def deepseek_config(num_layers: int = 2, **over) -> ModelConfig:
    """DeepSeek-V3's attention and routed experts (MLA with 128 heads, q rank 1536, latent 512 + rope 64,
    nope/v head dims 128; hidden 7168; 256 experts top-8 of I=2048; vocab 129280), `num_layers` layers, every
    one MoE. Left out: the shared expert, the first three layers' dense MLP, sigmoid group-limited routing
    (meld's MoE routes by softmax top-k) and YaRN. Two layers by default: one layer's experts are 21 GiB
    in bf16, and meld's MoE keeps a packed copy beside them on the GPU."""
    return ModelConfig(**{**dict(name="deepseek", num_layers=num_layers, hidden_size=7168, num_qo_heads=128,
                                 num_kv_heads=1, head_dim=576, vocab_size=129280, num_experts=256, top_k=8,
                                 moe_intermediate_size=2048, q_lora_rank=1536, kv_lora_rank=512,
                                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0,
                                 rms_eps=1e-6), **over})


def tiny_config(kind: str, **over) -> ModelConfig:
    """The same architecture small enough for the CPU executor: 2 layers, hidden 256, GQA 4/2/64 (DeepSeek:
    MLA at 64 heads, the fewest meld.DecodeMLA runs, with the kernel's 512 + 64 latent)."""
    small = dict(num_layers=2, hidden_size=256, num_qo_heads=4, num_kv_heads=2, head_dim=64, vocab_size=512,
                 max_position=4096)
    moe = dict(num_experts=8, top_k=2, moe_intermediate_size=128)
    if kind == "llama":
        return llama_config(**{**small, "intermediate_size": 512, **over})
    if kind == "qwen3-moe":
        return qwen3_moe_config(**{**small, **moe, **over})
    if kind == "deepseek":
        return deepseek_config(**{**small, **moe, "num_qo_heads": 64, "num_kv_heads": 1, "head_dim": 576,
                                  "q_lora_rank": 128, **over})
    raise ValueError(f"unknown model {kind!r}; expected one of {sorted(MODELS)}")


MODELS = {"llama": llama_config, "qwen3-moe": qwen3_moe_config, "deepseek": deepseek_config}


def make_cache(config: ModelConfig, num_pages: int, page_size: int, device: str | torch.device = "cpu",
               seed: int = 0) -> PagedKVCache:
    """The paged cache `config`'s attention reads: K/V pages (GQA) or latent pages (MLA)."""
    if config.is_mla:
        return PagedLatentCache(config.num_layers, num_pages, page_size, config.head_dim, config.dtype, device, seed)
    return PagedKVCache(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, config.dtype,
                        device, seed)


# --- building blocks ---------------------------------------------------------------------------------------
def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it is (a float64 model stays a float64 reference)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = _wide(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_tables(head_dim: int, max_position: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, head_dim / 2] (float32) of the rotary embedding."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv[None]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by the angles of its token (cos, sin [N, D/2]), Llama's rotate-half form."""
    x1, x2 = _wide(x).chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


# --- MoE implementations ---------------------------------------------------------------------------------
class RoutingTape:
    """Every MoE routing decision of one run, in call order, to replay in another run of the same trace.

    Two attention backends differ in the last bits of their outputs; where a token's router logits hold a
    near-tie at the top-k boundary that flips its experts, and its logits end far from the other run's
    however right both backends are: against SDPA with torch's MoE, logits compared directly failed for
    meld and FlashInfer alike, from a few such flips (bench/RESULTS.md, "Checking an MoE model across
    backends", and "Figures moved from code comments"). A check that replays the reference run's routing
    compares the attention backends alone: the replaying run takes the recorded experts of each call,
    weighted by the softmax of its own router logits.
    """

    def __init__(self, top_k: int, renormalize: bool = True):
        self.top_k, self.renormalize = top_k, renormalize
        self.ids: list[torch.Tensor] = []
        self.replaying, self._next = False, 0

    def replay(self) -> "RoutingTape":
        """Switch from recording to replaying from the first call on."""
        self.replaying, self._next = True, 0
        return self

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int64) for this call's router logits [T, E]."""
        if not self.replaying:
            weights, ids = topk_route(logits, self.top_k, self.renormalize)
            self.ids.append(ids)
            return weights, ids
        if self._next >= len(self.ids):
            raise RuntimeError(f"the routing tape holds {len(self.ids)} MoE calls; this run makes more (the runs "
                               "must decode the same trace)")
        ids = self.ids[self._next]
        if ids.shape[0] != logits.shape[0]:
            raise RuntimeError(f"MoE call {self._next} routes {logits.shape[0]} tokens; the recorded run routed "
                               f"{ids.shape[0]} (the runs must decode the same trace)")
        self._next += 1
        weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class TorchMoE:
    """The unfused torch MoE (BENCH.md's peer): softmax top-k routing -> (token, expert) pairs sorted by
    expert -> grouped GEMM gate/up -> SiLU(gate) * up -> grouped GEMM down -> weighted index_add_ (fp32).
    No host synchronisation on the GPU, so it is capturable."""

    name = "torch"

    def __init__(self, top_k: int, renormalize: bool = True):
        self.top_k, self.renormalize = top_k, renormalize

    def __call__(self, x, router_logits, weights: tuple, routing=None) -> torch.Tensor:
        """weights: (w13, w2) in the activations' dtype (an FP8 model's dequantised: `DecoderModel.moe_weights`)."""
        w13, w2 = weights
        return torch_grouped_mm_moe(x, w13, w2, router_logits, self.top_k, self.renormalize, routing=routing)


class MeldMoE:
    """meld's fused MoE (`meld.MoE`), one operator for every layer (the weights are arguments)."""

    name = "meld"

    def __init__(self, config: ModelConfig, device, max_num_tokens: int):
        import meld

        self.fp8 = config.moe_dtype == "fp8"
        self.name = "meld-fp8" if self.fp8 else "meld"
        self.op = meld.MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.top_k,
                           config.dtype, device, max_num_tokens=max_num_tokens, renormalize=True,
                           weight_dtype=torch.float8_e4m3fn if self.fp8 else None)
        self.max_num_tokens = max_num_tokens

    def __call__(self, x, router_logits, weights: tuple, routing=None) -> torch.Tensor:
        """weights: (w13, w2), packed or not, or an FP8 model's (w13, w2, w13_scale, w2_scale)."""
        w13, w2, *scales = weights
        kw = dict(zip(("w13_scale", "w2_scale"), scales))
        if routing is None:
            return self.op(x, router_logits, w13, w2, **kw)
        return self.op(x, None, w13, w2, topk_weights=routing[0], topk_ids=routing[1], **kw)


# --- the model ---------------------------------------------------------------------------------------------
@dataclass
class MLAWeights:
    """DeepSeek's MLA projections, the up-projections of the latent split per head for the absorbed form."""

    q_a: torch.Tensor        # [q_lora_rank, H]
    q_a_norm: torch.Tensor   # [q_lora_rank]
    q_b: torch.Tensor        # [Hq (nope + rope), q_lora_rank]
    kv_a: torch.Tensor       # [kv_lora_rank + rope, H]: c, then k_pe
    kv_norm: torch.Tensor    # [kv_lora_rank]
    w_uk: torch.Tensor       # [Hq, nope, kv_lora_rank]: k_nope = c @ w_uk[h].T; absorbed into q
    w_uv: torch.Tensor       # [Hq, kv_lora_rank, v_head_dim]: v = c @ w_uv[h]; applied to the latent output


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    o: torch.Tensor                   # [H, Hq D] (MLA: [H, Hq v_head_dim])
    post_norm: torch.Tensor
    qkv: torch.Tensor | None = None   # GQA: [(Hq + 2 Hkv) D, H]
    mla: MLAWeights | None = None     # MLA
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None   # dense: [2 I, H] (gate rows, then up rows)
    down: torch.Tensor | None = None      # dense: [H, I]
    router: torch.Tensor | None = None    # MoE: [E, H]
    w13: torch.Tensor | None = None       # MoE: [E, 2 I, H] (an FP8 model's: its e4m3 blocks dequantised)
    w2: torch.Tensor | None = None        # MoE: [E, H, I]
    packed: tuple[torch.Tensor, torch.Tensor] | None = None   # MoE on the GPU: meld.pack_moe_weights(w13, w2)
    fp8: tuple[torch.Tensor, ...] | None = None   # an FP8 model's experts: (w13, w2 in e4m3, w13_scale, w2_scale)


class DecoderModel:
    """A decoder with random weights (seeded) on `device`.

    Args:
        config: a ModelConfig (`llama_config()`, `qwen3_moe_config()`, `deepseek_config()`, `tiny_config(kind)`).
        device: where weights and activations live.
        moe: "torch" or "meld": the MoE implementation (MoE models only; `use_moe` switches later).
        moe_max_tokens: capacity of meld's MoE, at least the largest decode batch; prefill runs its MLP/MoE
            in chunks of this many tokens.

    Example:
        >>> model = DecoderModel(llama_config(num_layers=2), "cuda")
        >>> logits = model.decode(tokens, positions, slots, backend, kv)   # one token per request
    """

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu", moe: str = "torch",
                 moe_max_tokens: int = PREFILL_CHUNK):
        self.config = c = config
        self.device = torch.device(device)
        g = torch.Generator(device=self.device).manual_seed(c.seed)
        dt = c.dtype

        def randn(*shape, fan_in: int | None = None) -> torch.Tensor:
            w = torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32)
            return (w / fan_in ** 0.5 if fan_in else w).to(dt)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=dt, device=self.device)

        H, D, Hq, Hkv = c.hidden_size, c.head_dim, c.num_qo_heads, c.num_kv_heads
        self.embed = randn(c.vocab_size, H)
        self.layers: list[LayerWeights] = []
        for _ in range(c.num_layers):
            if c.is_mla:
                R, C, qk = c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim + c.qk_rope_head_dim
                mla = MLAWeights(randn(R, H, fan_in=H), ones(R), randn(Hq * qk, R, fan_in=R),
                                 randn(C + c.qk_rope_head_dim, H, fan_in=H), ones(C),
                                 randn(Hq, c.qk_nope_head_dim, C, fan_in=C), randn(Hq, C, c.v_head_dim, fan_in=C))
                w = LayerWeights(ones(H), randn(H, Hq * c.v_head_dim, fan_in=Hq * c.v_head_dim), ones(H), mla=mla)
            else:
                w = LayerWeights(ones(H), randn(H, Hq * D, fan_in=Hq * D), ones(H),
                                 qkv=randn((Hq + 2 * Hkv) * D, H, fan_in=H))
            if c.qk_norm:
                w.q_norm, w.k_norm = ones(D), ones(D)
            if c.is_moe:
                E, I = c.num_experts, c.moe_intermediate_size
                w.router = randn(E, H, fan_in=H)
                w.w13, w.w2 = randn(E, 2 * I, H, fan_in=H), randn(E, H, I, fan_in=I)
                if c.moe_dtype == "fp8":   # the checkpoint's blocks; torch's MoE runs on what they stand for
                    (q13, s13), (q2, s2) = quantize_blocks(w.w13), quantize_blocks(w.w2)
                    w.fp8 = (q13, q2, s13, s2)
                    w.w13, w.w2 = dequantize_blocks(q13, s13).to(dt), dequantize_blocks(q2, s2).to(dt)
            else:
                w.gate_up, w.down = randn(2 * c.intermediate_size, H, fan_in=H), randn(H, c.intermediate_size,
                                                                                        fan_in=c.intermediate_size)
            self.layers.append(w)
        self.final_norm = ones(H)
        self.lm_head = randn(c.vocab_size, H, fan_in=H)
        self.cos, self.sin = rope_tables(c.rope_dim, c.max_position, c.rope_theta, self.device)
        self._moe_max_tokens = self.prefill_chunk = moe_max_tokens
        self._moes: dict[str, object] = {}
        self.moe = None
        self.routing: RoutingTape | None = None   # eager runs only: records or replays every MoE routing
        if c.is_moe:
            self.use_moe(moe)

    def use_moe(self, impl: str) -> None:
        """Run the MoE layers with "meld" (meld.MoE) or "torch" (the grouped-GEMM pipeline)."""
        if not self.config.is_moe:
            return
        if impl not in ("meld", "torch"):
            raise ValueError(f"moe must be 'meld' or 'torch', got {impl!r}")
        if impl not in self._moes:
            self._moes[impl] = (MeldMoE(self.config, self.device, self._moe_max_tokens) if impl == "meld"
                                else TorchMoE(self.config.top_k))
        if impl == "meld" and self.device.type == "cuda" and self.config.moe_dtype == "bf16":
            # meld's bf16 MoE runs on packed weights, packed at load
            import meld

            for w in self.layers:
                if w.packed is None:
                    w.packed = meld.pack_moe_weights(w.w13, w.w2)
        self.moe = self._moes[impl]

    def moe_weights(self, w: LayerWeights) -> tuple[torch.Tensor, ...]:
        """A layer's expert weights as the current MoE takes them: meld's (w13, w2) packed on the GPU, or an FP8
        model's (w13, w2, w13_scale, w2_scale) in e4m3; torch's (w13, w2) in the activations' dtype."""
        if self.moe is self._moes.get("meld"):
            if w.fp8 is not None:
                return w.fp8
            if w.packed is not None:
                return w.packed
        return (w.w13, w.w2)

    @property
    def moe_name(self) -> str:
        return self.moe.name if self.moe is not None else "-"

    # --- pieces ------------------------------------------------------------------------------------------
    def _qkv(self, w: LayerWeights, x: torch.Tensor, positions: torch.Tensor):
        """q [N, Hq, D], k and v [N, Hkv, D] of the normed hidden states x [N, H], RoPE applied to q and k."""
        c = self.config
        qkv = (x @ w.qkv.T).view(x.shape[0], c.num_qo_heads + 2 * c.num_kv_heads, c.head_dim)
        q, k, v = qkv.split([c.num_qo_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
        if c.qk_norm:
            q, k = rms_norm(q, w.q_norm, c.rms_eps), rms_norm(k, w.k_norm, c.rms_eps)
        cos, sin = self.cos[positions], self.sin[positions]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attention(self, i: int, w: LayerWeights, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   cache: PagedKVCache, backend) -> torch.Tensor:
        """Layer i's attention block on the normed hidden states x [N, H]: K/V written to `slots`, then
        attention through `backend` (decode: one token per request), or with backend None causal over the
        N tokens themselves (the prefill of one request). Returns the o projection's output [N, H]."""
        if self.config.is_mla:
            return self._mla(i, w, x, positions, slots, cache, backend)
        c = self.config
        q, k, v = self._qkv(w, x, positions)
        cache.write(i, slots, k, v)
        if backend is not None:
            o = backend.run(i, q, cache.layer(i))
        else:
            G = c.num_qo_heads // c.num_kv_heads
            q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)   # [N, Hq, D]
        return o.reshape(o.shape[0], -1) @ w.o.T

    def _mla(self, i: int, w: LayerWeights, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             cache: PagedLatentCache, backend) -> torch.Tensor:
        """`_attention` as DeepSeek's MLA. The cache row is [RMSNorm(c), RoPE(k_pe)]. Decode runs the absorbed
        form through `backend`: the query [q_nope @ W_UK, RoPE(q_pe)] per head over the latent rows, the latent
        output through W_UV per head. Prefill runs the unabsorbed form, as DeepSeek's prefill does: K = [c W_UK^T,
        k_pe] and V = c W_UV per head, causal SDPA over heads of qk_nope + qk_rope channels (V zero-padded to that
        width: one width takes SDPA's fused kernel, which the absorbed form's 576-wide heads have none of)."""
        c, m = self.config, w.mla
        N, Hq, C, R = x.shape[0], c.num_qo_heads, c.kv_lora_rank, c.qk_rope_head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        q = (rms_norm(x @ m.q_a.T, m.q_a_norm, c.rms_eps) @ m.q_b.T).view(N, Hq, -1)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, R], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        ckv, k_pe = (x @ m.kv_a.T).split([C, R], dim=-1)
        latent = torch.cat([rms_norm(ckv, m.kv_norm, c.rms_eps), apply_rope(k_pe[:, None], cos, sin)[:, 0]], dim=-1)
        cache.write(i, slots, latent)
        if backend is not None:
            q = torch.cat([torch.einsum("nhd,hdc->nhc", q_nope, m.w_uk), q_pe], dim=-1)
            o = torch.einsum("nhc,hcv->nhv", backend.run(i, q, cache.layer(i)), m.w_uv)
        else:
            c_kv = latent[:, :C]
            k = torch.cat([torch.einsum("nc,hdc->nhd", c_kv, m.w_uk), latent[:, None, C:].expand(N, Hq, R)], dim=-1)
            v = torch.einsum("nc,hcv->nhv", c_kv, m.w_uv)
            D = max(k.shape[-1], c.v_head_dim)   # one width for the fused kernel; zero channels change nothing
            q = torch.cat([q_nope, q_pe], dim=-1)
            q, k, v = (F.pad(t, (0, D - t.shape[-1])).transpose(0, 1)[None] for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.sm_scale)[0].transpose(0, 1)
            o = o[..., :c.v_head_dim]
        return o.reshape(N, -1) @ w.o.T

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if self.config.is_moe:
            logits = (x @ w.router.T).float()
            return self.moe(x, logits, self.moe_weights(w), self.routing(logits) if self.routing is not None else None)
        gate, up = (x @ w.gate_up.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w.down.T

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.final_norm, self.config.rms_eps) @ self.lm_head.T

    # --- the two passes ----------------------------------------------------------------------------------
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, backend,
               cache: PagedKVCache) -> torch.Tensor:
        """One decode step: logits [B, vocab] of tokens [B] at positions [B] (int64, on the device).
        Each token's K/V goes to its slot first; attention (planned by the caller, once for the step)
        then reads it with the rest of the request's cache."""
        c = self.config
        h = self.embed[tokens]
        for i, w in enumerate(self.layers):
            h = h + self._attention(i, w, rms_norm(h, w.input_norm, c.rms_eps), positions, slots, cache, backend)
            h = h + self._mlp(w, rms_norm(h, w.post_norm, c.rms_eps))
        return self._logits(h)

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """The dense prefill of one request: tokens [L] (positions 0..L-1) with causal SDPA over the prompt,
        K/V written to `slots` [L]. Returns the last position's logits [1, vocab]."""
        c = self.config
        L = tokens.shape[0]
        positions = torch.arange(L, device=tokens.device)
        h = self.embed[tokens]
        for i, w in enumerate(self.layers):
            h = h + self._attention(i, w, rms_norm(h, w.input_norm, c.rms_eps), positions, slots, cache, None)
            n = self.prefill_chunk
            for s in range(0, L, n):
                h[s:s + n] += self._mlp(w, rms_norm(h[s:s + n], w.post_norm, c.rms_eps))
        return self._logits(h[-1:])
